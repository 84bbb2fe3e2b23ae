"""SIGTERM drain of a real worker process; token parity of the service with the engine."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedweight.rpc import worker_pb2, worker_pb2_grpc
from service_procs import Proc, free_port, health_status, wait_serving
from worker.conftest import generate

BUDGET = "40MiB"  # every expert at 8 bits plus room for KV

pytestmark = pytest.mark.slow


def test_sigterm_drains_finishes_short_requests_and_aborts_long_ones(micro_paged, tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    worker = Proc(["worker", "--model", str(micro_paged), "--port", str(port), "--memory-budget", BUDGET,
                   "--policy", "static-8", "--shutdown-timeout", "2"], tmp_path / "worker.log")
    try:
        wait_serving(worker, address, "pagedweight.v1.Worker")

        async def scenario():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)

                async def run(request_id, max_tokens):
                    messages = []
                    async for m in stub.Generate(worker_pb2.GenerateRequest(
                            request_id=request_id, prompt_token_ids=[9, 8, 7],
                            sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))):
                        messages.append(m)
                    return messages

                long = asyncio.create_task(run("long", 1800))
                await asyncio.sleep(0.5)  # both are running when SIGTERM comes
                short = asyncio.create_task(run("short", 40))
                await asyncio.sleep(0.2)
                sent = time.monotonic()
                worker.signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                readiness = await asyncio.to_thread(health_status, address, "pagedweight.v1.Worker")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await run("late", 4)
                return await long, await short, readiness, refused.value, time.monotonic() - sent

        long, short, readiness, refused, waited = asyncio.run(scenario())
        assert readiness == health_pb2.HealthCheckResponse.NOT_SERVING
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.details()
        assert short[-1].finish_reason == "length" and short[-1].usage.completion_tokens == 40
        assert long[-1].finished and long[-1].finish_reason == "abort"  # ended, not dropped
        assert 0 < long[-1].usage.completion_tokens < 1800
        assert 1.5 < waited < 10  # the drain waited for --shutdown-timeout, then aborted
        assert worker.wait(30) == 0
        assert "drain timeout: aborted 1 running requests" in worker.log()
    finally:
        worker.stop()


def test_service_tokens_match_the_in_process_engine(micro_paged, tmp_path):
    """Greedy tokens through gRPC equal those of the same runtime driven in process."""
    import torch

    from pagedweight.engine.async_engine import AsyncEngine
    from pagedweight.engine.sampler import SamplingParams
    from pagedweight.memory.pool import parse_memory_budget
    from pagedweight.runtime import RuntimeConfig, build_runtime

    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(1, 40))]
    runtime = build_runtime(micro_paged, RuntimeConfig(parse_memory_budget(BUDGET), "static-8", "cpu",
                                                       torch.float32))

    async def in_process():
        engine = AsyncEngine(runtime.engine)
        outs = []
        for p in prompts:
            tokens = []
            async for out in engine.add_request(p, SamplingParams(max_tokens=12)):
                tokens += out.new_token_ids
            outs.append(tokens)
        await engine.close()
        return outs

    expected = asyncio.run(in_process())
    runtime.close()
    port = free_port()
    worker = Proc(["worker", "--model", str(micro_paged), "--port", str(port), "--memory-budget", BUDGET,
                   "--policy", "static-8"], tmp_path / "worker.log")
    try:
        wait_serving(worker, f"127.0.0.1:{port}", "pagedweight.v1.Worker")
        got = [[t for m in generate(f"127.0.0.1:{port}", p, max_tokens=12) for t in m.token_ids] for p in prompts]
        finals = [generate(f"127.0.0.1:{port}", p, max_tokens=12)[-1] for p in prompts[:1]]
        stop_id = expected[0][3]  # a stop token id ends the request before it, and says so
        stopped = generate(f"127.0.0.1:{port}", prompts[0], max_tokens=12, stop_token_ids=[stop_id])
    finally:
        worker.stop()
    assert got == expected
    assert finals[0].mean_expert_bits == 8.0  # static-8: every expert at 8 bits
    first = expected[0].index(stop_id)
    assert [t for m in stopped for t in m.token_ids] == expected[0][:first]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop_id
    assert not finals[0].HasField("stop_reason")  # "length": no stop token
