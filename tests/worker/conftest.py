"""Fixtures for the worker service's e2e tests: real planner and worker processes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedweight.rpc import worker_pb2, worker_pb2_grpc

BUDGET = "17MiB"  # small enough that 16 requests of 200+64 tokens make the bits move


def generate(address: str, prompt: list[int], request_id: str = "", **sampling) -> list:
    """All messages of one Generate stream (blocking client)."""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                             sampling=worker_pb2.SamplingParams(**sampling))
        return list(stub.Generate(request, timeout=120))


def get_stats(address: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10)


def load(address: str, num_requests: int, prompt_len: int = 200, max_tokens: int = 64) -> list:
    """num_requests concurrent greedy requests; returns each one's final message."""

    async def one(stub, i):
        prompt = [(i * 7 + j) % 4000 + 1 for j in range(prompt_len)]
        last, num_tokens = None, 0
        async for message in stub.Generate(worker_pb2.GenerateRequest(
                request_id=f"load-{i}", prompt_token_ids=prompt,
                sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), timeout=120):
            num_tokens += len(message.token_ids)
            last = message
        assert last.usage.completion_tokens == num_tokens
        return last

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            return await asyncio.gather(*[one(stub, i) for i in range(num_requests)])

    return asyncio.run(main())


@pytest.fixture(scope="session")
def micro_paged(paged_micro_dir):
    return paged_micro_dir
