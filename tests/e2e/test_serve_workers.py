"""`pagedweight serve --workers 2` on the CPU, as its users meet it: two workers behind one
gateway, each with its own gRPC and metrics port. One worker is killed mid-stream: that
stream ends with an error naming the worker, new requests are served by the other, serve
restarts the dead one and the gateway routes to it again. The gateway logs no traceback
and no task or generator left behind by the broken stream."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from service_procs import REPO, free_port_runs, metric, scrape
from tests.e2e.cluster import REDIS_URL

MODEL = "micro"
PROMPT = "In the beginning"
pytestmark = pytest.mark.slow


class Serve:
    """`pagedweight serve` in a subprocess, its output (every service's, prefixed) in a file."""

    def __init__(self, model_dir, log_path, *flags: str):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen([sys.executable, "-m", "pagedweight.cli.main", "serve", "--model",
                                         str(model_dir), *flags], stdout=self._log, stderr=subprocess.STDOUT,
                                        cwd=REPO)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.process.poll() is None, f"serve exited before {what}:\n{self.log()}"
            assert time.monotonic() < deadline, f"not {what} after {timeout_s} s:\n{self.log()}"
            time.sleep(0.1)

    def pids(self, name: str) -> list[int]:
        return [int(p) for p in re.findall(rf"started {name} \(pid (\d+)\)", self.log())]

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            self._log.close()


def busy(metrics_port: int) -> float:
    return metric(scrape(metrics_port), "vllm:num_requests_running")


def served(metrics_port: int) -> float:
    """Prompt tokens the worker took in since it started (any request it was given); 0
    while it is still loading (its page has no engine series yet)."""
    samples = scrape(metrics_port)
    return metric(samples, "vllm:prompt_tokens_total") if any("vllm:" in s for s in samples) else 0.0


def test_two_workers_one_killed_mid_stream_and_restarted(paged_micro_dir, tmp_path):
    port, worker_port, metrics_port, planner_port, planner_metrics_port = free_port_runs(1, 2, 2, 1, 1)
    serve = Serve(paged_micro_dir, tmp_path / "serve.log", "--workers", "2", "--port", str(port),
                  "--worker-port", str(worker_port), "--worker-metrics-port", str(metrics_port),
                  "--planner-port", str(planner_port), "--planner-metrics-port", str(planner_metrics_port),
                  "--memory-budget", "64MiB", "--served-model-name", MODEL, "--redis-url", REDIS_URL)
    code = None
    try:
        serve.wait_for(lambda: "PagedWeight is serving" in serve.log(), 180, "serving")
        assert "with 2 workers" in serve.log()
        # worker i: gRPC on the first port + i, /metrics on the first metrics port + i
        addresses = {f"worker-{i}": f"127.0.0.1:{worker_port + i}" for i in (0, 1)}
        metrics_ports = {f"worker-{i}": metrics_port + i for i in (0, 1)}
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)

        stream = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, stream=True,
                                        extra_body={"ignore_eos": True})
        received, victim = 0, None
        try:
            for _ in stream:
                received += 1
                if received == 3:  # mid-stream: kill the worker that runs it
                    (victim,) = [n for n, p in metrics_ports.items() if busy(p) == 1]
                    subprocess.run(["kill", "-9", str(serve.pids(victim)[-1])], check=True)
            ended = "completed"
        except openai.APIError as err:
            ended = str(err)
        assert received >= 3 and (ended == "completed" or addresses[victim] in ended), ended
        other = "worker-1" if victim == "worker-0" else "worker-0"

        # the other worker serves every new request, before and after serve restarts the victim
        before = served(metrics_ports[other])
        for _ in range(3):
            assert api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].finish_reason
        assert served(metrics_ports[other]) > before
        serve.wait_for(lambda: len(serve.pids(victim)) == 2, 60, f"{victim} restarted")

        # ... and the gateway routes to the restarted one again: with a stream held open on
        # one worker, the least-loaded pick sends the next request to the other
        def routed_back() -> bool:
            try:
                if served(metrics_ports[victim]) > 0:
                    return True
            except OSError:  # its metrics port is not up yet
                return False
            held = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, stream=True,
                                          extra_body={"ignore_eos": True})
            try:
                next(iter(held))
                assert api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].finish_reason
            finally:
                held.close()
            return False

        serve.wait_for(routed_back, 60, f"routing to the restarted {victim}")
    finally:
        code = serve.stop()
    gateway = "\n".join(line for line in serve.log().splitlines() if line.startswith("[gateway]"))
    assert code == 0, serve.log()
    assert "Traceback" not in gateway
    assert "Task was destroyed but it is pending" not in gateway
    assert "asynchronous generator is already running" not in gateway
