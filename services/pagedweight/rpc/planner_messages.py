"""The planner's messages (planner/messages.py) <-> their proto form (planner.proto).

Hand-written, beside the generated stubs: the one place that knows both. Block order is
the registration's; on the wire bits travel keyed by block id ("L3.E5.gate_up") so a
plan can never be applied to the wrong block. Raises ValueError on a message that does
not fit the registration (the service answers INVALID_ARGUMENT, the worker treats it as
a broken plan).
"""

from __future__ import annotations

import math

import json

import numpy as np

from pagedweight.format.blocks import BIT_WIDTHS, BlockId
from pagedweight.planner.loss_scale import GroupScales
from pagedweight.planner.messages import (
    FREE, KVPressure, PlannerRegistration, PlanRequest, PlanResponse, PromptMix, RoutingSnapshot,
)
from pagedweight.rpc import planner_pb2


# Layers x experts a registration may declare: the per-expert arrays the planner keeps are
# this many doubles each. Real MoE models have tens of thousands (61 x 256); a bound keeps
# one registration from asking the service for gigabytes.
MAX_EXPERT_CELLS = 1 << 20


def _array(values) -> planner_pb2.ExpertArray:
    return planner_pb2.ExpertArray(values=[] if values is None else np.asarray(values, dtype=np.float64).ravel().tolist())


def _matrix(msg: planner_pb2.ExpertArray, num_layers: int, num_experts: int, name: str) -> np.ndarray | None:
    if not msg.values:
        return None
    if len(msg.values) != num_layers * num_experts:
        raise ValueError(f"{name}: expected {num_layers}x{num_experts} values, got {len(msg.values)}")
    return np.asarray(msg.values, dtype=np.float64).reshape(num_layers, num_experts)


# ---- registration -----------------------------------------------------------------------
def registration_to_proto(reg: PlannerRegistration, worker_id: str, model_name: str,
                          policy: str, scales: GroupScales | None = None,
                          move_cost: float = 0.0) -> planner_pb2.RegisterRequest:
    blocks = [planner_pb2.BlockInfo(block_id=key, bytes_by_bits=[int(x) for x in reg.nbytes[i]],
                                    sensitivity=[float(x) for x in reg.sensitivity[i]])
              for i, key in enumerate(reg.block_keys)]
    return planner_pb2.RegisterRequest(
        worker_id=worker_id, model_name=model_name, policy=policy, blocks=blocks, num_layers=reg.num_layers,
        num_experts=reg.num_experts, top_k=reg.top_k, calib_mass=_array(reg.calib_mass),
        calib_share=_array(reg.calib_share), move_cost=move_cost,
        loss_scales_json="" if scales is None else json.dumps(scales.to_json() | {"sensitivity": scales.sensitivity}))


def scales_from_proto(msg: planner_pb2.RegisterRequest) -> GroupScales | None:
    """The registration's loss scales, None when it sent none; ValueError if malformed."""
    if not msg.loss_scales_json:
        return None
    try:
        return GroupScales.from_json(json.loads(msg.loss_scales_json), "loss_scales_json")
    except RecursionError:  # nested deeper than the JSON parser's stack
        raise ValueError("malformed loss_scales_json (nested too deeply)") from None
    except (KeyError, TypeError, AttributeError, OverflowError, json.JSONDecodeError) as err:
        raise ValueError(f"malformed loss_scales_json ({err!r})"[:300]) from None


def registration_from_proto(msg: planner_pb2.RegisterRequest) -> PlannerRegistration:
    L, E = msg.num_layers, msg.num_experts
    if L < 1 or E < 1:
        raise ValueError(f"num_layers and num_experts must be >= 1, got {L} and {E}")
    if L * E > MAX_EXPERT_CELLS:
        raise ValueError(f"num_layers x num_experts must be at most {MAX_EXPERT_CELLS}, got {L} x {E}")
    keys = tuple(b.block_id for b in msg.blocks)
    for key in keys:
        BlockId.parse(key)  # ValueError names a bad key
    if len(set(keys)) != len(keys):
        raise ValueError("a block id appears twice")
    if any(len(b.bytes_by_bits) != len(BIT_WIDTHS) or len(b.sensitivity) != len(BIT_WIDTHS) for b in msg.blocks):
        raise ValueError(f"every block needs {len(BIT_WIDTHS)} bytes_by_bits and sensitivity values (3..8 bits)")
    nbytes = np.array([list(b.bytes_by_bits) for b in msg.blocks], dtype=np.int64).reshape(len(keys), len(BIT_WIDTHS))
    sens = np.array([list(b.sensitivity) for b in msg.blocks], dtype=np.float64).reshape(len(keys), len(BIT_WIDTHS))
    return PlannerRegistration(keys, nbytes, sens, L, E, msg.top_k, _matrix(msg.calib_mass, L, E, "calib_mass"),
                               _matrix(msg.calib_share, L, E, "calib_share"))


# ---- plan request -----------------------------------------------------------------------
def request_to_proto(request: PlanRequest, reg: PlannerRegistration, worker_id: str,
                     registration_id: str) -> planner_pb2.PlanRequest:
    p = request.pressure
    free = p.direction == FREE
    msg = planner_pb2.PlanRequest(
        worker_id=worker_id, registration_id=registration_id,
        direction=planner_pb2.PlanRequest.FREE if free else planner_pb2.PlanRequest.SPEND,
        num_bytes=int(p.bytes_needed if free else p.bytes_free),
        bits={key: int(b) for key, b in zip(reg.block_keys, request.bits)},
        kv=planner_pb2.KvPressure(bytes_needed=int(p.bytes_needed), bytes_free=int(p.bytes_free)),
        inter_token_s=float(request.inter_token_s))
    if request.routing is not None:
        r = request.routing
        msg.routing.CopyFrom(planner_pb2.RoutingWindow(counts=np.ravel(r.counts).tolist(),
                                                       mass=np.ravel(r.mass).tolist(),
                                                       num_tokens=[int(x) for x in r.num_tokens]))
    mix = request.prompts
    if mix is not None:
        msg.prompt_routing.CopyFrom(_array(mix.routing))
        msg.num_prompts, msg.prompt_tokens = mix.num_prompts, mix.num_tokens
        if mix.residual is not None:
            msg.prompt_residual.extend(np.asarray(mix.residual, dtype=np.float64).tolist())
    return msg


def request_from_proto(msg: planner_pb2.PlanRequest, reg: PlannerRegistration, request_id: int) -> PlanRequest:
    if msg.direction not in (planner_pb2.PlanRequest.FREE, planner_pb2.PlanRequest.SPEND):
        raise ValueError("direction must be FREE or SPEND")
    if msg.num_bytes <= 0:
        raise ValueError(f"num_bytes must be > 0, got {msg.num_bytes}")
    unknown = set(msg.bits) - set(reg.block_keys)
    if unknown:
        raise ValueError(f"unknown block {sorted(unknown)[0]!r} (not in the registered table)")
    if len(msg.bits) != len(reg.block_keys):
        raise ValueError(f"bits must name every registered block ({len(reg.block_keys)}), got {len(msg.bits)}")
    bits = np.array([msg.bits[key] for key in reg.block_keys], dtype=np.int64)
    bad = [int(b) for b in bits if b not in BIT_WIDTHS]
    if bad:
        raise ValueError(f"bits {bad[0]} not in {BIT_WIDTHS}")
    free = msg.direction == planner_pb2.PlanRequest.FREE
    pressure = KVPressure(bytes_needed=msg.num_bytes) if free else KVPressure(bytes_free=msg.num_bytes)
    L, E = reg.num_layers, reg.num_experts
    routing = None
    w = msg.routing
    if w.num_tokens:
        if len(w.counts) != L * E or len(w.mass) != L * E or len(w.num_tokens) != L:
            raise ValueError(f"routing window must be [{L}x{E}] counts and mass and [{L}] tokens")
        routing = RoutingSnapshot(np.asarray(w.counts, dtype=np.float64).reshape(L, E),
                                  np.asarray(w.mass, dtype=np.float64).reshape(L, E),
                                  np.asarray(w.num_tokens, dtype=np.int64))
    if not (math.isfinite(msg.inter_token_s) and msg.inter_token_s >= 0):
        raise ValueError(f"inter_token_s must be finite and >= 0, got {msg.inter_token_s}")
    return PlanRequest(request_id, pressure, bits, routing, _prompt_mix(msg, reg), msg.inter_token_s)


def _prompt_mix(msg: planner_pb2.PlanRequest, reg: PlannerRegistration) -> PromptMix | None:
    """The request's prompts in flight; ValueError for a mix that does not fit the table."""
    routing = _matrix(msg.prompt_routing, reg.num_layers, reg.num_experts, "prompt_routing")
    if msg.num_prompts == 0:
        if routing is not None or msg.prompt_residual:
            raise ValueError("prompt_routing / prompt_residual sent with num_prompts 0")
        return None
    if routing is None:
        raise ValueError(f"num_prompts {msg.num_prompts} without prompt_routing")
    residual = None
    if msg.prompt_residual:
        if len(msg.prompt_residual) != len(reg.block_keys):
            raise ValueError(f"prompt_residual: expected {len(reg.block_keys)} values (one per block), "
                             f"got {len(msg.prompt_residual)}")
        residual = np.asarray(msg.prompt_residual, dtype=np.float64)
    return PromptMix(routing, residual, msg.num_prompts, msg.prompt_tokens)


# ---- plan response ----------------------------------------------------------------------
def response_to_proto(response: PlanResponse, reg: PlannerRegistration) -> planner_pb2.PlanResponse:
    return planner_pb2.PlanResponse(
        plan_id=response.plan_id,
        changes={reg.block_keys[int(i)]: int(b) for i, b in zip(response.block_indices, response.bits)},
        expected_bytes_delta=int(response.bytes_delta), expected_damage=float(response.damage))


def response_from_proto(msg: planner_pb2.PlanResponse, request: PlanRequest,
                        reg: PlannerRegistration) -> PlanResponse:
    """Checks the plan contract: known blocks, bits 3..8, a free never raises, a spend never
    lowers nor takes more than offered (bytes from the worker's own table)."""
    row = {key: i for i, key in enumerate(reg.block_keys)}  # block id -> registration row
    free = request.pressure.direction == FREE
    indices, new_bits, delta = [], [], 0
    for key, new in sorted(msg.changes.items(), key=lambda kv: row.get(kv[0], -1)):
        if key not in row or new not in BIT_WIDTHS:
            raise ValueError(f"plan {msg.plan_id}: block {key} -> {new} bits is not a valid change")
        i = row[key]
        old = int(request.bits[i])
        if (free and new > old) or (not free and new < old):
            raise ValueError(f"plan {msg.plan_id}: block {key} {old} -> {new} goes the wrong way")
        delta += int(reg.nbytes[i, new - BIT_WIDTHS[0]] - reg.nbytes[i, old - BIT_WIDTHS[0]])
        indices.append(i)
        new_bits.append(int(new))
    if not free and delta > request.pressure.bytes_free:
        raise ValueError(f"plan {msg.plan_id}: spends {delta} bytes, {request.pressure.bytes_free} offered")
    return PlanResponse(request.request_id, int(msg.plan_id), np.array(indices, dtype=np.int64),
                        np.array(new_bits, dtype=np.int64), delta, float(msg.expected_damage))
