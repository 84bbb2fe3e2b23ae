"""The operator's dial over real gRPC on loopback: a quality floor the planner never frees
below, a latency target that holds raises, set at run time, refused when out of range, and
exported as metrics."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pagedweight.common.metrics import PlannerServiceMetrics
from pagedweight.planner.dial import OperatorDial
from pagedweight.planner.tables import BlockTable
from pagedweight.planner_service.server import PlannerServicer
from pagedweight.rpc import planner_pb2
from tests.planner_service.test_planner_service import register_request, registration, stub_for, with_server

FREE, SPEND = planner_pb2.PlanRequest.FREE, planner_pb2.PlanRequest.SPEND


def mean_bits_bytes(reg, bits: dict[str, int]) -> int:
    rows = [reg.block_keys.index(k) for k in bits]
    return int(sum(reg.nbytes[r, bits[k] - 3] for r, k in zip(rows, bits)))


def table_of(reg) -> BlockTable:
    return BlockTable(reg.block_ids(), reg.nbytes, reg.sensitivity, reg.num_layers, reg.num_experts)


def test_the_floor_cuts_frees_and_set_dial_moves_it_at_run_time():
    registry = CollectorRegistry()
    servicer = PlannerServicer(PlannerServiceMetrics(registry), dial=OperatorDial(min_mean_bits=6.0))
    with_server(servicer, lambda port: _floor(port, registry))


def _floor(port, registry):
    stub, reg = stub_for(port), registration()
    rid = stub.Register(register_request("w1", reg)).registration_id
    bits = {key: 8 for key in reg.block_keys}
    floor6 = table_of(reg).uniform_bytes(6.0)
    # asked for everything down to 3 bits: the plan stops at the 6-bit floor's bytes
    ask = mean_bits_bytes(reg, bits) - table_of(reg).uniform_bytes(3)
    plan = stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=rid, direction=FREE,
                                             num_bytes=ask, bits=bits))
    after = {k: plan.changes.get(k, v) for k, v in bits.items()}
    assert plan.changes and mean_bits_bytes(reg, after) >= floor6
    assert -plan.expected_bytes_delta < ask
    # at the floor a further free changes nothing
    again = stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=rid, direction=FREE,
                                              num_bytes=1000, bits=after))
    assert not again.changes
    # the operator lowers the floor while the service runs: the same request now frees
    dial = stub.SetDial(planner_pb2.Dial(min_mean_bits=4.0))
    assert dial.min_mean_bits == 4.0 and dial.target_itl_s == 0.0
    lower = stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=rid, direction=FREE,
                                              num_bytes=1000, bits=after))
    assert lower.changes and lower.expected_bytes_delta <= -1000
    text = generate_latest(registry).decode()
    assert "pagedweight:planner_dial_min_mean_bits 4.0" in text
    assert 'pagedweight:planner_dial_limited_total{reason="floor"} 2.0' in text


def test_the_latency_target_holds_raises_only_while_the_worker_is_slow():
    registry = CollectorRegistry()
    servicer = PlannerServicer(PlannerServiceMetrics(registry))
    with_server(servicer, lambda port: _latency(port, registry))


def _latency(port, registry):
    stub, reg = stub_for(port), registration()
    rid = stub.Register(register_request("w1", reg)).registration_id
    stub.SetDial(planner_pb2.Dial(target_itl_s=0.05))
    low = {key: 4 for key in reg.block_keys}

    def spend(itl):
        return stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=rid, direction=SPEND,
                                                 num_bytes=5000, bits=low, inter_token_s=itl))

    assert not spend(0.08).changes  # slower than the target: held
    assert spend(0.03).changes  # within it: the bytes are spent
    assert spend(0.0).changes  # no latency reported: not held
    # a free is never held by the latency target
    free = stub.Plan(planner_pb2.PlanRequest(worker_id="w1", registration_id=rid, direction=FREE,
                                             num_bytes=1000, bits=low, inter_token_s=0.5))
    assert free.changes
    text = generate_latest(registry).decode()
    assert "pagedweight:planner_dial_target_itl_seconds 0.05" in text
    assert 'pagedweight:planner_dial_limited_total{reason="latency"} 1.0' in text


def test_set_dial_refuses_out_of_range_values_and_keeps_the_old_dial():
    servicer = PlannerServicer(PlannerServiceMetrics(CollectorRegistry()), dial=OperatorDial(5.0, 0.1))

    def body(port):
        stub = stub_for(port)
        for bad in (planner_pb2.Dial(min_mean_bits=2.0), planner_pb2.Dial(min_mean_bits=9.0),
                    planner_pb2.Dial(target_itl_s=-1.0), planner_pb2.Dial(target_itl_s=float("inf"))):
            with pytest.raises(grpc.RpcError) as err:
                stub.SetDial(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert servicer.dial == OperatorDial(5.0, 0.1)

    with_server(servicer, body)


def test_floor_bytes_interpolate_between_widths():
    reg = registration()
    table = table_of(reg)
    assert OperatorDial().floor_bytes(table) == 0
    assert OperatorDial(5.0).floor_bytes(table) == int(reg.nbytes[:, 2].sum())
    half = OperatorDial(5.5).floor_bytes(table)
    assert int(reg.nbytes[:, 2].sum()) < half < int(reg.nbytes[:, 3].sum())
    assert not OperatorDial(target_itl_s=0.05).holds_spend(0.0)
    assert OperatorDial(target_itl_s=0.05).holds_spend(0.051)
    assert np.isclose(OperatorDial(target_itl_s=0.05).target_itl_s, 0.05)
