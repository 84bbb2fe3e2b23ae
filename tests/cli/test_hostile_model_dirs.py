"""Crafted model directories: every command finds and checks a model's files the same way.

Each case is a directory a user might be handed: a FIFO named like the weights, symlinks
out of the directory, a shard index naming files elsewhere, a truncated file, a header
that claims more than the file holds. `info` (headers only) and `generate` (the loader)
must each refuse it with one error line and exit code 2, promptly, and `quantize` must
never copy a file from outside the directory into its output.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from pagedweight.cli.main import main
from service_procs import REPO
from tests.conftest import BUNDLED_MODEL

WEIGHTS = "model.safetensors"


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def hostile_dir(tmp_path, case: str):
    model, outside = tmp_path / "model", tmp_path / "outside"
    shutil.copytree(BUNDLED_MODEL, model)
    shutil.copytree(BUNDLED_MODEL, outside)
    if case == "fifo weights":
        (model / WEIGHTS).unlink()
        os.mkfifo(model / WEIGHTS)
    elif case in ("weights link out", "config link out", "tokenizer link out"):
        name = {"weights link out": WEIGHTS, "config link out": "config.json",
                "tokenizer link out": "tokenizer.json"}[case]
        (model / name).unlink()
        (model / name).symlink_to(outside / name)
    elif case == "index names a path elsewhere":
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "..\\..\\x"}}))
    elif case == "index names a shard out":
        (model / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"x": "../outside/model.safetensors"}}))
    elif case == "truncated":
        data = (model / WEIGHTS).read_bytes()
        (model / WEIGHTS).write_bytes(data[: len(data) // 2])
    elif case == "huge shape":
        header = {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [2 ** 31, 2 ** 31],
                                                "data_offsets": [0, 8]}}
        (model / WEIGHTS).write_bytes(_safetensors(header, b"\0" * 8))
    else:
        raise AssertionError(case)
    return model


CASES = ["fifo weights", "weights link out", "config link out", "index names a path elsewhere",
         "index names a shard out", "truncated", "huge shape"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "services"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pagedweight.cli.main", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


def one_error_line(result: subprocess.CompletedProcess, command: str) -> str:
    err = result.stderr.strip()
    assert result.returncode == 2, (result.returncode, err[-600:])
    assert len(err.splitlines()) == 1 and err.startswith(f"pagedweight {command}: error:"), err[-600:]
    return err


@pytest.mark.parametrize("case", CASES)
def test_info_refuses_a_crafted_model_directory(tmp_path, case):
    model = hostile_dir(tmp_path, case)
    if case == "fifo weights":  # in a process of its own: a hang must fail the test, not stall it
        one_error_line(run_cli("info", str(model)), "info")
        return
    code = main(["info", str(model)])
    assert code == 2


@pytest.mark.parametrize("case", CASES + ["tokenizer link out"])
def test_generate_refuses_a_crafted_model_directory(tmp_path, case):
    model = hostile_dir(tmp_path, case)
    one_error_line(run_cli("generate", "--model", str(model), "--prompt", "x", "--max-tokens", "1"), "generate")


def test_info_reports_the_error_of_each_check(tmp_path, capsys):
    expected = {"weights link out": "outside the model directory", "config link out": "outside the model directory",
                "index names a path elsewhere": "not a plain relative path",
                "index names a shard out": "outside the model directory", "truncated": "past the end of the file",
                "huge shape": "needs"}
    for case, fragment in expected.items():
        model = hostile_dir(tmp_path / case.replace(" ", "_"), case)
        assert main(["info", str(model)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and fragment in err, (case, err)


def test_quantize_never_copies_a_tokenizer_from_outside(tmp_path, capsys):
    model = hostile_dir(tmp_path, "tokenizer link out")
    out = tmp_path / "out"
    code = main(["quantize", "--model", str(model), "--out", str(out), "--calib-tokens", "256", "--quiet"])
    assert code == 2 and "outside the model directory" in capsys.readouterr().err
    assert not (out / "tokenizer.json").exists()


def test_serve_never_hashes_or_records_a_file_outside_the_model(tmp_path):
    from pagedweight.cluster.model_cache import DIGESTS_FILE, checkpoint_digest
    from pagedweight.common.errors import UserError

    model, cache = tmp_path / "model", tmp_path / "cache"
    shutil.copytree(BUNDLED_MODEL, model)
    secret = tmp_path / "secret.txt"
    secret.write_text("not the model's")
    (model / "README.md").symlink_to(secret)
    with pytest.raises(UserError, match="outside the model directory"):
        checkpoint_digest(model, cache)
    assert not (cache / DIGESTS_FILE).exists()
    (model / "README.md").unlink()
    assert checkpoint_digest(model, cache) and str(secret) not in (cache / DIGESTS_FILE).read_text()
