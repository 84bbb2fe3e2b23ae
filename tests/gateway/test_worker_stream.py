"""The gateway's shared GenerateStream to a real worker process that is killed and restarted:
the running request fails with UNAVAILABLE, gRPC's task that feeds the call its requests
ends with it (none is left pending to be destroyed, nor its generator closed while it
runs), and the next request opens a new stream to the restarted worker."""

from __future__ import annotations

import asyncio
import gc
import logging

import grpc
import pytest

from pagedweight.gateway.workers import WorkerPool
from pagedweight.rpc import worker_pb2
from service_procs import Proc, free_port, wait_serving

pytestmark = pytest.mark.slow


class Collect:
    """A WorkerStream handler that keeps what it hears."""

    def __init__(self):
        self.num_outputs, self.error, self.finished = 0, None, asyncio.Event()

    def on_output(self, out: worker_pb2.GenerateResponse) -> None:
        self.num_outputs += 1
        if out.finished:
            self.finished.set()

    def on_error(self, code: grpc.StatusCode, details: str) -> None:
        self.error = code
        self.finished.set()


def request(request_id: str, max_tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                      sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def start_worker(model_dir, port: int, log_path) -> Proc:
    worker = Proc(["worker", "--model", str(model_dir), "--port", str(port), "--memory-budget", "64MiB"], log_path)
    wait_serving(worker, f"127.0.0.1:{port}", "pagedweight.v1.Worker")
    return worker


def request_feeders() -> list[asyncio.Task]:
    """gRPC's tasks that drain a stream call's request iterator, still running."""
    return [t for t in asyncio.all_tasks() if not t.done() and "_consume_request_iterator" in repr(t.get_coro())]


def test_a_killed_worker_leaves_no_pending_task_and_its_restart_is_served(paged_micro_dir, tmp_path, caplog):
    port = free_port()
    address = f"127.0.0.1:{port}"
    worker = start_worker(paged_micro_dir, port, tmp_path / "worker.log")

    async def run() -> None:
        pool = WorkerPool((address,), poll_interval_s=60.0)
        stream = pool.stream(address)
        try:
            running = Collect()
            stream.submit(request("long", 2000), running)
            while running.num_outputs < 3 and not running.finished.is_set():
                await asyncio.sleep(0.01)
            assert len(request_feeders()) == 1
            worker.popen.kill()
            worker.popen.wait()
            await asyncio.wait_for(running.finished.wait(), 30)
            assert running.error == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.1)  # one more turn of the loop for gRPC's task to finish
            assert request_feeders() == []
            gc.collect()  # what a pending task left behind is destroyed here, and logged
            await asyncio.sleep(0.1)

            restarted.append(start_worker(paged_micro_dir, port, tmp_path / "worker-restarted.log"))
            after = Collect()
            stream.submit(request("after", 4), after)
            await asyncio.wait_for(after.finished.wait(), 60)
            assert after.error is None and after.num_outputs >= 1
        finally:
            await pool.close()

    restarted: list[Proc] = []
    caplog.set_level(logging.ERROR, logger="asyncio")
    try:
        asyncio.run(run())
    finally:
        for proc in (worker, *restarted):
            proc.stop()
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "asyncio")
    assert "Task was destroyed but it is pending" not in logged
    assert "asynchronous generator is already running" not in logged
