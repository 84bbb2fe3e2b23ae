"""Hostile gRPC calls against a real worker process and the planner service, both behind
an RPC token: every call ends OK or with a status that names the caller's fault
(INVALID_ARGUMENT, NOT_FOUND, ...), never UNKNOWN or INTERNAL (an exception in the
server, or a dead engine), and after each example both still serve a valid call.
Same modes as the rest of the fuzz suite (PAGEDWEIGHT_FUZZ=long for 300 examples)."""

from __future__ import annotations

import asyncio
import math
import threading

import grpc
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pagedweight.common.metrics import PlannerServiceMetrics
from pagedweight.common.rpc_security import RpcSecurity
from pagedweight.planner_service.server import PlannerServicer
from pagedweight.rpc import planner_pb2, planner_pb2_grpc, worker_pb2, worker_pb2_grpc
from service_procs import free_port
from tests.e2e.cluster import Service, wait_until
from tests.fuzz.harness import fuzz_settings
from tests.planner_service.test_planner_service import register_request, registration

TOKEN = "fuzz-" + "t" * 30
AUTH = (("authorization", f"Bearer {TOKEN}"),)
CLIENT_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
INT32 = st.integers(-(2 ** 31), 2 ** 31 - 1)
INT64 = st.integers(-(2 ** 63), 2 ** 63 - 1)
FLOATS = st.floats(width=32)  # NaN and infinities included
METADATA = st.one_of(st.just(AUTH), st.just(()), st.tuples(st.tuples(
    st.just("authorization"), st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40))))


def check_status(call) -> None:
    try:
        result = call()
        event("OK")
        return result
    except grpc.RpcError as err:
        event(err.code().name)
        assert err.code() in CLIENT_FAULTS, (err.code(), err.details())
        assert err.details(), err.code()


# ---- the worker ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(paged_micro_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz_grpc_logs")
    tokens = logs / "tokens"
    tokens.write_text(f"fuzz:{TOKEN}\n")
    port = free_port()
    service = Service("worker", ["-m", "pagedweight.cli.main", "worker", "--model", str(paged_micro_dir), "--port",
                                 str(port), "--memory-budget", "64MiB", "--rpc-token-file", str(tokens)], logs)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        wait_until(lambda: stub.GetStats(worker_pb2.GetStatsRequest(), metadata=AUTH, timeout=2).ready, service)
        yield stub, service
    finally:
        channel.close()
        service.stop()
    assert "Traceback" not in service.log_path.read_text()


SAMPLING = st.builds(
    worker_pb2.SamplingParams, max_tokens=st.one_of(st.integers(-2, 4), INT32), temperature=FLOATS,
    top_p=FLOATS, top_k=st.one_of(st.integers(-2, 50), INT32), seed=INT64, ignore_eos=st.booleans(),
    stop_token_ids=st.lists(INT32, max_size=3), min_tokens=st.one_of(st.integers(0, 3), INT32), min_p=FLOATS)
GENERATE = st.builds(
    worker_pb2.GenerateRequest, request_id=st.text(max_size=20),
    prompt_token_ids=st.lists(st.one_of(st.integers(0, 300), INT32), max_size=6), sampling=SAMPLING,
    session_id=st.text(max_size=8))


@fuzz_settings(ci_examples=60)
@given(request=GENERATE, metadata=METADATA)
def test_fuzz_worker_generate(worker, request, metadata):
    stub, service = worker
    # keep each example short (a huge max_tokens is legal and runs to the model's context)
    request.sampling.max_tokens = min(request.sampling.max_tokens, 4)
    request.sampling.min_tokens = min(request.sampling.min_tokens, 4)
    check_status(lambda: list(stub.Generate(request, metadata=metadata, timeout=60)))
    ok = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=worker_pb2.SamplingParams(max_tokens=1))
    assert list(stub.Generate(ok, metadata=AUTH, timeout=60))[-1].finished
    service.check_alive()


@fuzz_settings(ci_examples=25)
@given(request_id=st.text(max_size=30), metadata=METADATA)
def test_fuzz_worker_abort_and_stats(worker, request_id, metadata):
    stub, _ = worker
    reply = check_status(lambda: stub.Abort(worker_pb2.AbortRequest(request_id=request_id), metadata=metadata,
                                            timeout=10))
    assert reply is None or not reply.found  # nothing of this caller runs
    check_status(lambda: stub.GetStats(worker_pb2.GetStatsRequest(), metadata=metadata, timeout=10))


# ---- the planner ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planner():
    """The planner service on this process's loopback, in a thread with its own loop."""
    security = RpcSecurity(tokens={TOKEN: "fuzz"})
    port, ready, stop = free_port(), threading.Event(), None

    async def main():
        nonlocal stop
        stop = asyncio.Event()
        server = grpc.aio.server(interceptors=security.interceptors())
        servicer = PlannerServicer(PlannerServiceMetrics(CollectorRegistry()), security, max_workers=8)
        planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)
        security.add_port(server, "127.0.0.1", port)
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(None)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = planner_pb2_grpc.PlannerStub(channel)
    base = stub.Register(register_request("base", registration()), metadata=AUTH, timeout=10)
    yield stub, base
    channel.close()
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


@st.composite
def mutated_registration(draw):
    request = register_request(draw(st.sampled_from(["w-fuzz", "w-other", ""])), registration())
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["bytes", "sens", "drop", "dims", "scales", "cost", "policy", "key"]))
        block = request.blocks[draw(st.integers(0, len(request.blocks) - 1))] if request.blocks else None
        if what == "bytes" and block is not None:
            block.bytes_by_bits[:] = draw(st.lists(INT64, max_size=7))
        elif what == "sens" and block is not None:
            block.sensitivity[:] = draw(st.lists(st.floats(), max_size=7))
        elif what == "drop":
            del request.blocks[draw(st.integers(0, len(request.blocks))):]
        elif what == "dims":
            setattr(request, draw(st.sampled_from(["num_layers", "num_experts", "top_k"])), draw(INT32))
        elif what == "scales":
            request.loss_scales_json = draw(st.one_of(st.text(max_size=20), st.just('{"scales": {"x": 1e999}}')))
        elif what == "cost":
            request.move_cost = draw(st.floats())
        elif what == "policy":
            request.policy = draw(st.text(max_size=10))
        elif block is not None:
            block.block_id = draw(st.text(max_size=12))
    return request


@fuzz_settings(ci_examples=60)
@given(request=mutated_registration(), metadata=METADATA)
def test_fuzz_planner_register(planner, request, metadata):
    stub, _ = planner
    check_status(lambda: stub.Register(request, metadata=metadata, timeout=30))
    assert stub.Register(register_request("base-check", registration()), metadata=AUTH, timeout=10).num_blocks


@fuzz_settings(ci_examples=60)
@given(data=st.data(), metadata=METADATA)
def test_fuzz_planner_plan(planner, data, metadata):
    stub, base = planner
    keys = list(registration().block_keys)
    bits = data.draw(st.dictionaries(st.one_of(st.sampled_from(keys), st.text(max_size=8)),
                                     st.one_of(st.integers(2, 9), INT32), max_size=6))
    request = planner_pb2.PlanRequest(
        worker_id=data.draw(st.sampled_from(["base", "nobody", ""])),
        registration_id=data.draw(st.sampled_from([base.registration_id, "stale", ""])),
        direction=data.draw(st.sampled_from([0, 1, 2, 7])), num_bytes=data.draw(INT64), bits=bits,
        prompt_residual=data.draw(st.lists(st.floats(), max_size=4)),
        num_prompts=data.draw(INT32), prompt_tokens=data.draw(INT64))
    check_status(lambda: stub.Plan(request, metadata=metadata, timeout=30))
    full = planner_pb2.PlanRequest(worker_id="base", registration_id=base.registration_id,
                                   direction=planner_pb2.PlanRequest.FREE, bits={k: 8 for k in keys},
                                   num_bytes=1 << 40)
    reply = stub.Plan(full, metadata=AUTH, timeout=30)
    assert all(3 <= b <= 8 for b in reply.changes.values()) and not math.isnan(reply.expected_damage)
