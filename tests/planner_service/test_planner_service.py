"""The planner service over real gRPC on loopback (in this process), and the worker's
client of it: plans keep the contract, bad input is refused clearly, a slow or lying
service is replaced by the in-process planner."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from pagedweight.common.metrics import PlannerServiceMetrics, WorkerMetrics
from pagedweight.format.blocks import BIT_WIDTHS, BlockId
from pagedweight.planner.loss_scale import GroupScales, group_key
from pagedweight.planner.messages import KVPressure, PlannerRegistration, PlanRequest, PromptMix
from pagedweight.planner_service.server import PlannerServicer
from pagedweight.rpc import planner_messages, planner_pb2, planner_pb2_grpc
from pagedweight.planner.in_process_planner import InProcessPlanner
from pagedweight.worker.remote_planner import RemotePlanner
from service_procs import free_port

L, E = 2, 4


def registration(seed: int = 0) -> PlannerRegistration:
    rng = np.random.default_rng(seed)
    blocks = [BlockId(layer, e, m) for layer in range(L) for e in range(E) for m in ("gate_up", "down")]
    nbytes = np.array([[1000 * b + 64 for b in BIT_WIDTHS] for _ in blocks], dtype=np.int64)
    sens = np.sort(rng.uniform(0.1, 5.0, size=(len(blocks), len(BIT_WIDTHS))), axis=1)[:, ::-1].copy()
    return PlannerRegistration(tuple(b.key() for b in blocks), nbytes, sens, L, E, 2,
                               calib_mass=np.full((L, E), 0.5))


def register_request(worker_id: str, reg: PlannerRegistration) -> planner_pb2.RegisterRequest:
    return planner_messages.registration_to_proto(reg, worker_id, "m", "pagedweight")


def with_server(servicer, body):
    """Run `body(port)` in a thread while a grpc.aio server with `servicer` serves on this
    event loop (so the test drives it with plain blocking clients)."""

    async def main():
        port = free_port()
        server = grpc.aio.server()
        planner_pb2_grpc.add_PlannerServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            return await asyncio.to_thread(body, port)
        finally:
            await server.stop(None)

    return asyncio.run(main())


def new_service():
    metrics = PlannerServiceMetrics(CollectorRegistry())
    return PlannerServicer(metrics), metrics


def stub_for(port):
    return planner_pb2_grpc.PlannerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def test_register_then_plans_keep_the_contract():
    servicer, metrics = new_service()
    with_server(servicer, lambda port: _register_then_plan(port, metrics))


def _register_then_plan(port, metrics):
    stub, reg = stub_for(port), registration()
    reply = stub.Register(register_request("w1", reg))
    assert reply.num_blocks == 2 * L * E and reply.registration_id
    bits = {key: 8 for key in reg.block_keys}
    free = stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=reply.registration_id,
                                             direction=planner_pb2.PlanRequest.FREE, num_bytes=5000, bits=bits))
    assert free.changes and all(v < 8 for v in free.changes.values())
    assert free.expected_bytes_delta <= -5000
    low = {k: free.changes.get(k, v) for k, v in bits.items()}
    spend = stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=reply.registration_id,
                                              direction=planner_pb2.PlanRequest.SPEND, num_bytes=3000, bits=low))
    assert all(v >= low[k] for k, v in spend.changes.items())
    assert 0 <= spend.expected_bytes_delta <= 3000
    assert spend.plan_id == free.plan_id + 1
    assert metrics.workers_registered._value.get() == 1


def test_routing_windows_change_what_the_service_keeps():
    """Hot experts keep more bits: the window reaches the plan."""
    servicer, _ = new_service()
    with_server(servicer, lambda port: _routing(port, servicer))


def _routing(port, servicer):
    stub, reg = stub_for(port), registration()
    reply = stub.Register(register_request("w1", reg))
    counts = np.zeros((L, E))
    counts[:, 0] = 100.0  # every token routed to expert 0
    window = planner_pb2.RoutingWindow(counts=counts.ravel().tolist(), mass=(counts * 0.5).ravel().tolist(),
                                       num_tokens=[100000] * L)
    bits = {key: 8 for key in reg.block_keys}
    plan = stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=reply.registration_id,
                                             direction=planner_pb2.PlanRequest.FREE, num_bytes=20000,
                                             bits=bits, routing=window))
    state = servicer.workers["w1"]
    assert state.planner.stats.num_tokens_seen.tolist() == [100000] * L
    new = {k: plan.changes.get(k, v) for k, v in bits.items()}
    hot = np.mean([v for k, v in new.items() if ".E0." in k])
    cold = np.mean([v for k, v in new.items() if ".E0." not in k])
    assert hot > cold


def test_prompt_residuals_reach_the_services_plan():
    """The prompts in flight say expert 1's blocks are far more sensitive: they keep more
    bits than in the same plan without prompts, and a request without prompts clears it."""
    servicer, _ = new_service()
    with_server(servicer, lambda port: _prompts(port, servicer))


def _prompts(port, servicer):
    stub, reg = stub_for(port), registration()
    reply = stub.Register(register_request("w1", reg))
    bits = np.full(len(reg.block_keys), 8)
    residual = np.array([2.0 if ".E1." in key else 0.0 for key in reg.block_keys])
    routing = np.full((L, E), 1.0 / E)

    def plan(prompts):
        request = PlanRequest(1, KVPressure(bytes_needed=20000), bits, None, prompts)
        message = planner_messages.request_to_proto(request, reg, "w1", reply.registration_id)
        return {**dict(zip(reg.block_keys, bits.tolist())), **stub.Plan(message).changes}

    with_prompts = plan(PromptMix(routing, residual, 3, 120))
    np.testing.assert_array_equal(servicer.workers["w1"].planner.context.residual, residual)
    without = plan(None)
    assert servicer.workers["w1"].planner.context.residual is None  # the prompts left
    mean = lambda plan_bits, hot: np.mean([v for k, v in plan_bits.items() if (".E1." in k) == hot])  # noqa: E731
    assert mean(with_prompts, True) - mean(with_prompts, False) > mean(without, True) - mean(without, False)


def test_prompt_mix_round_trips_and_bad_mixes_are_refused():
    reg = registration()
    residual = np.linspace(-1, 1, len(reg.block_keys))
    routing = np.full((L, E), 1.0 / E)
    request = PlanRequest(7, KVPressure(bytes_free=10), np.full(len(reg.block_keys), 4), None,
                          PromptMix(routing, residual, 2, 50))
    message = planner_messages.request_to_proto(request, reg, "w", "r")
    back = planner_messages.request_from_proto(message, reg, 7).prompts
    np.testing.assert_array_equal(back.residual, residual)
    np.testing.assert_array_equal(back.routing, routing)
    assert (back.num_prompts, back.num_tokens) == (2, 50)
    assert planner_messages.request_from_proto(
        planner_messages.request_to_proto(PlanRequest(8, KVPressure(bytes_free=10), request.bits), reg, "w", "r"),
        reg, 8).prompts is None
    for change, words in ((lambda m: m.prompt_residual.pop(), "one per block"),
                          (lambda m: setattr(m, "num_prompts", 0), "num_prompts 0"),
                          (lambda m: m.prompt_residual.__setitem__(0, float("nan")), "finite"),
                          (lambda m: m.prompt_routing.values.__setitem__(0, -1.0), "non-negative"),
                          (lambda m: m.prompt_routing.values.pop(), "prompt_routing")):
        bad = planner_pb2.PlanRequest()
        bad.CopyFrom(message)
        change(bad)
        with pytest.raises(ValueError, match=words):
            planner_messages.request_from_proto(bad, reg, 9)


def test_bad_requests_are_refused_with_clear_codes():
    servicer, metrics = new_service()
    with_server(servicer, lambda port: _bad_requests(port, metrics))


def _bad_requests(port, metrics):
    stub, reg = stub_for(port), registration()
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(planner_pb2.RegisterRequest(worker_id="w1", num_layers=L, num_experts=E, top_k=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least one block" in err.value.details()
    bad = register_request("w1", reg)
    bad.blocks[0].bytes_by_bits[:] = [5, 4, 3, 2, 1, 0]
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grow" in err.value.details()
    reply = stub.Register(register_request("w1", reg))
    with pytest.raises(grpc.RpcError) as err:  # stale registration (the service restarted)
        stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id="old",
                                          direction=planner_pb2.PlanRequest.FREE, num_bytes=1))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    bits = {key: 8 for key in reg.block_keys}
    bits["L9.E0.down"] = 8
    with pytest.raises(grpc.RpcError) as err:
        stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=reply.registration_id,
                                          direction=planner_pb2.PlanRequest.FREE, num_bytes=1, bits=bits))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "L9.E0.down" in err.value.details()
    assert metrics.refused.labels(code="INVALID_ARGUMENT")._value.get() == 3


def test_registrations_too_large_or_nested_too_deep_are_refused_at_once():
    servicer, metrics = new_service()
    with_server(servicer, lambda port: _hostile_registrations(port, metrics))


def _hostile_registrations(port, metrics):
    stub = stub_for(port)
    huge = register_request("w1", registration())
    huge.num_layers = huge.num_experts = 40000  # 1.6e9 cells: gigabytes of per-expert arrays
    nested = register_request("w1", registration())
    nested.loss_scales_json = "[" * 200_000 + "]" * 200_000
    for request, fragment in ((huge, "at most"), (nested, "nested too deeply")):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()
        assert time.monotonic() - started < 2
    assert metrics.refused.labels(code="INVALID_ARGUMENT")._value.get() == 2
    assert stub.Register(register_request("w1", registration())).registration_id


class SlowServicer(PlannerServicer):
    """The real service, made slow (an overloaded planner)."""

    delay_s = 3.0  # far above the worker's 0.3 s deadline, so the bounds below hold on a loaded machine

    async def Plan(self, request, context):
        await asyncio.sleep(self.delay_s)
        return await super().Plan(request, context)


class LyingServicer(PlannerServicer):
    """The real service, answering raises to a request to free (a broken planner)."""

    async def Plan(self, request, context):
        reply = await super().Plan(request, context)
        reply.changes["L0.E0.down"] = 8
        reply.changes["L0.E0.gate_up"] = 8
        return reply


@pytest.mark.parametrize("servicer_cls,reason", [(SlowServicer, "deadline"), (LyingServicer, "garbage")])
def test_slow_or_lying_service_falls_back_to_the_local_planner(servicer_cls, reason):
    with_server(servicer_cls(PlannerServiceMetrics(CollectorRegistry())), lambda port: _fallback(port, reason))


def _fallback(port, reason):
    reg = registration()
    local, reference = InProcessPlanner("pagedweight"), InProcessPlanner("pagedweight")
    local.register(reg)
    reference.register(reg)
    metrics = WorkerMetrics(CollectorRegistry(), "m")
    remote = RemotePlanner(f"127.0.0.1:{port}", local, "w1", "m", "pagedweight", deadline_s=0.3, metrics=metrics)
    remote.register(reg)
    try:
        deadline = time.monotonic() + 10
        while not remote.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert remote.connected
        request = PlanRequest(1, KVPressure(bytes_needed=4000), np.full(len(reg.block_keys), 6))
        started = time.monotonic()
        remote.submit(request)
        assert time.monotonic() - started < SlowServicer.delay_s / 2  # submit never waits for the service
        response = None
        while response is None and time.monotonic() - started < 5:
            response = remote.poll()
            time.sleep(0.01)
        assert time.monotonic() - started < SlowServicer.delay_s * 0.8  # did not wait for the slow answer
        reference.submit(request)
        expected = reference.poll()
        assert response.changes() == expected.changes()  # the in-process planner's answer
        assert response.request_id == 1
        assert (remote.num_service_plans, remote.num_local_plans) == (0, 1)
        deadline = time.monotonic() + 10  # the service still answers health: it re-registers
        while remote.num_reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert remote.connected and remote.num_reconnects == 1
        assert metrics.planner_errors.labels(reason=reason, model_name="m", engine="0")._value.get() == 1
        assert metrics.plans["local"]._value.get() == 1
    finally:
        remote.close()


def test_the_service_plans_with_the_workers_loss_scales_and_move_cost():
    """The worker registers its planner's loss scales and move cost: the service's plan is
    the one the worker's own planner makes (not the raw-sensitivity plan, which differs),
    and malformed scales are refused at registration."""
    servicer, _ = new_service()
    with_server(servicer, _scaled_registration)


def _scaled_registration(port):
    reg = registration(seed=3)
    # layer 1's down blocks count 50x: the scaled plan spares them, the raw one need not
    scales = GroupScales({group_key(layer, m): (50.0 if (layer, m) == (1, "down") else 1.0)
                          for layer in range(L) for m in ("gate_up", "down")}, {}, 128)
    stub = stub_for(port)
    bits = {key: 8 for key in reg.block_keys}
    plans = {}
    for name, sent_scales, move_cost in (("scaled", scales, 4.0), ("raw", None, 0.0)):
        reply = stub.Register(planner_messages.registration_to_proto(reg, name, "m", "pagedweight",
                                                                     scales=sent_scales, move_cost=move_cost))
        plan = stub.Plan(planner_pb2.PlanRequest(worker_id=name, registration_id=reply.registration_id,
                                                 direction=planner_pb2.PlanRequest.FREE, num_bytes=12000, bits=bits))
        plans[name] = dict(plan.changes)
        local = InProcessPlanner("pagedweight", sent_scales, move_cost=move_cost)
        local.register(reg)
        local.submit(PlanRequest(1, KVPressure(bytes_needed=12000), np.full(len(reg.block_keys), 8)))
        expected = local.poll()
        assert plans[name] == {reg.block_keys[i]: b for i, b in expected.changes().items()}, name
    assert plans["scaled"] != plans["raw"]
    assert not any(".L1." in f".{k}" and k.endswith("down") for k in plans["scaled"])  # spared
    bad = planner_messages.registration_to_proto(reg, "w9", "m", "pagedweight")
    for text in ('{"scales": {"L0.down": -1}}', "not json", '{"kl_at_3_bits": {}}'):
        bad.loss_scales_json = text
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_planner_service_is_torch_free():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pagedweight.planner_service.server, pagedweight.common.metrics\n"
            "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
