"""`pagedweight serve`: the model cache, and the whole cluster as real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pagedweight.cluster.model_cache import checkpoint_digest, paged_model_for
from pagedweight.common.errors import UserError
from service_procs import REPO, free_port


def test_a_paged_model_is_served_as_is_and_bad_dirs_are_refused(paged_micro_dir, tmp_path):
    assert paged_model_for(paged_micro_dir, tmp_path / "cache") == paged_micro_dir
    assert not (tmp_path / "cache").exists()  # nothing quantised
    with pytest.raises(UserError, match="not a directory"):
        paged_model_for(tmp_path / "missing", tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        paged_model_for(tmp_path / "empty", tmp_path / "cache")


def test_the_cache_key_follows_the_checkpoint_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = checkpoint_digest(tmp_path)
    assert checkpoint_digest(tmp_path) == first
    os.utime(tmp_path / "model.safetensors", (1, 1))  # a fresh clone: new times, same files
    assert checkpoint_digest(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"y" * 10)
    assert checkpoint_digest(tmp_path) != first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert checkpoint_digest(tmp_path) != first


def test_the_cache_key_covers_every_byte_and_remembers_digests_by_stat(tmp_path):
    model, cache = tmp_path / "m", tmp_path / "cache"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"h" * (3 << 20))
    first = checkpoint_digest(model, cache)
    assert (cache / "file-digests.json").is_file()
    with open(weights, "r+b") as f:  # one byte past the header's first MiB (the old key's blind spot)
        f.seek(2 << 20)
        f.write(b"X")
    assert checkpoint_digest(model, cache) != first
    # a digest is reused only while size, mtime and inode match: a forged record for the
    # current file's stat is believed (that is the speed-up), a stale one is not
    stat = weights.stat()
    records = json.loads((cache / "file-digests.json").read_text())
    records[str(weights.resolve())] = {"stat": [stat.st_size, stat.st_mtime_ns + 1, stat.st_ino], "sha256": "0" * 64}
    (cache / "file-digests.json").write_text(json.dumps(records))
    second = checkpoint_digest(model, cache)
    assert second == checkpoint_digest(model)  # the stale record was ignored: hashed again
    (cache / "file-digests.json").write_text("not json")  # an unreadable record file: hashed again
    assert checkpoint_digest(model, cache) == second


@pytest.mark.slow
def test_serve_runs_the_cluster_and_stops_it(paged_micro_dir, tmp_path):
    pytest.importorskip("pagedweight.gateway")
    port = free_port()
    argv = [sys.executable, "-m", "pagedweight.cli.main", "serve", "--model", str(paged_micro_dir),
            "--port", str(port), "--memory-budget", "32MiB", "--served-model-name", "micro",
            "--worker-port", str(free_port()), "--planner-port", str(free_port()),
            "--worker-metrics-port", str(free_port()), "--planner-metrics-port", str(free_port())]
    log = open(tmp_path / "serve.log", "w+")
    # started with SIGINT ignored, as a shell script's background job is: the SIGINT below
    # must stop the cluster all the same
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 120
        while "PagedWeight is serving" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        text = (tmp_path / "serve.log").read_text()
        assert f"http://127.0.0.1:{port}/v1" in text
        body = json.dumps({"model": "micro", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 5
        assert answer["choices"][0]["finish_reason"] == "length"
        # the planner dies: the cluster keeps serving and the supervisor starts a new one
        planner_pid = int(re.findall(r"started planner \(pid (\d+)\)", text)[-1])
        os.kill(planner_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(re.findall(r"started planner \(pid (\d+)\)", (tmp_path / "serve.log").read_text())) < 2:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 5
        while "registered with the planner service" not in (tmp_path / "serve.log").read_text().split(
                "planner exited with code -9; restarting it", 1)[-1]:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM, serve's other stop path: a failure leaves no services running
            proc.wait(60)
            raise
        finally:
            log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()
    text = (tmp_path / "serve.log").read_text()
    assert "[worker]" in text and "worker stopped" in text and "planner stopped" in text


def test_serve_with_a_taken_port_is_one_line_and_exit_2(paged_micro_dir, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "pagedweight.cli.main", "serve", "--model", str(paged_micro_dir),
             "--port", str(free_port()), "--worker-port", str(port)],
            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and f"--worker-port {port}" in lines[0] and "in use" in lines[0], lines
    assert "serving" not in result.stdout
