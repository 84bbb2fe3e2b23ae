"""The served logit error of the real-shape pressure rows (bench/logit_probe.py) on a tiny
Qwen1.5-MoE-like model on the CPU: nothing against bf16 when the model served is the bf16 model,
more for perturbed experts and for fewer bits, the pager's lowest bits probed during a replay
under pressure, the routing the planner sees left as the load made it; and its docs table."""

from __future__ import annotations

import copy
import json

import torch

from bench import tables
from bench.logit_probe import LogitProbe, replay_with_probes
from pagedweight.cli.load_bench import LoadSpec, mean_committed_bits
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.apl_format import block_bytes
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig, kv_block_bytes
from pagedweight.offline.real_shape_models import build_hf_model, ours_from_hf, paged_in_memory
from pagedweight.runtime import RuntimeConfig, build_runtime_from_paged, workspace_bytes
from pagedweight.weights.routing_feed import RoutingFeed

DTYPE = torch.bfloat16  # as the benchmark serves: dense weights equal in the bf16 and the runtime model
ENGINE = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                      kv=KVCacheConfig(block_size=4), attention_impl="inplace", num_kv_blocks=512)


def _bf16_model():
    hf, raw = build_hf_model("tiny-qwen-moe", torch.device("cpu"), DTYPE, seed=0)
    return ours_from_hf(hf, ModelConfig.from_dict(raw)), raw


def _runtime(model, raw, policy: str, kv_bytes: int | None = None):
    """A runtime over the model's quantised experts; its budget holds the 8-bit experts and
    `kv_bytes` of KV (None: ample room)."""
    paged = paged_in_memory(model, model.config, raw)
    dense = sum(v.numel() * v.element_size() for v in paged.dense_state.values())
    experts8 = sum(block_bytes(b["rows"], b["cols"], 8) for b in paged.meta["blocks"])
    kv = 64 << 20 if kv_bytes is None else kv_bytes
    budget = dense + workspace_bytes(model.config, ENGINE, DTYPE) + experts8 + kv
    return build_runtime_from_paged(paged, RuntimeConfig(budget, policy, dtype=DTYPE, engine=ENGINE))


def test_the_bf16_model_served_is_its_own_reference_and_the_probe_is_not_routing_traffic():
    model, _ = _bf16_model()
    probe = LogitProbe.of(model)
    feed = RoutingFeed(model.config.num_layers, model.config.num_experts)
    feed.install(model)
    engine = Engine(model, config=ENGINE)
    spec = LoadSpec(num_requests=4, concurrency=4, prompt_len=16, max_tokens=8)
    result = replay_with_probes(engine, spec, probe, lambda: 16.0, every=4)
    assert [s["step"] for s in result["steps"]] == list(range(0, result["replay"]["steps"] + 1, 4))
    assert result["relative_error_worst"] == 0.0 and result["argmax_agree"] == 1.0
    assert not engine.has_work
    # the feed counted the load's tokens only: every prompt token and each fed-back output token
    assert all(block.observer is feed for block in model.moe_blocks)
    assert feed.num_tokens.tolist() == [4 * (16 + 8 - 1)] * model.config.num_layers


def test_perturbed_experts_and_fewer_bits_lie_further_from_bf16():
    model, raw = _bf16_model()
    probe = LogitProbe.of(model)
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for block in perturbed.moe_blocks:
            w = block.experts.gate_up
            w.add_(0.3 * w.std() * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(w.dtype))
    noisy = probe.measure(perturbed)
    errors = {}
    for bits in (8, 3):
        rt = _runtime(model, raw, f"static-{bits}")
        errors[bits] = probe.measure(rt.engine.model)
        rt.close()
    assert probe.measure(model)["relative_error_max"] == 0.0
    assert noisy["relative_error_mean"] > 1e-3
    assert 0 < errors[8]["relative_error_mean"] < errors[3]["relative_error_mean"]
    assert errors[8]["relative_error_max"] < errors[3]["relative_error_max"]
    assert errors[8]["argmax_agree"] >= errors[3]["argmax_agree"]


def test_a_replay_under_pressure_probes_the_lowest_bits_the_pager_holds():
    model, raw = _bf16_model()
    probe = LogitProbe.of(model)
    # 3 waves of 8 requests, KV room for 5/8 of what one wave wants: the pager lowers, raises
    # between waves and lowers again, to fewer bits than the first time
    spec = LoadSpec(num_requests=24, concurrency=8, prompt_len=64, max_tokens=32)
    wanted = spec.concurrency * (spec.prompt_len + spec.max_tokens) * kv_block_bytes(model.config, 1, DTYPE)
    rt = _runtime(model, raw, "pagedweight", kv_bytes=wanted * 5 // 8)
    bits = []
    result = replay_with_probes(rt.engine, spec, probe, lambda: (bits.append(mean_committed_bits(rt)), bits[-1])[1],
                                every=8)
    rt.close()
    steps = result["steps"]
    first, low = steps[0], result["at_lowest_bits"]
    assert result["replay"] == {"steps": len(bits) - 1, "bits_mean_min": round(min(bits[1:]), 4)}
    # the lowest bits come after the first ones the load lowered to, off the every-8 grid
    assert low["bits_mean"] == result["replay"]["bits_mean_min"] < min(bits[1:9]) and low["step"] % 8
    assert low["relative_error_mean"] > first["relative_error_mean"] > 0 and first["bits_mean"] > 7
    assert result["relative_error_worst"] == max(s["relative_error_max"] for s in steps)
    assert len({s["bits_mean"] for s in steps}) > 2


def test_pressure_table_shows_the_served_error_and_a_dash_where_a_result_has_none(tmp_path, monkeypatch):
    load = {"output_tokens_per_s": 100.0, "steps": 10, "preemptions": 0, "page_moves": 0,
            "bits_mean_start": 8.0, "bits_mean_min": 7.0, "bits_mean_end": 8.0}
    served = {"relative_error_mean": 0.0123, "relative_error_worst": 0.05, "argmax_agree": 0.9,
              "at_lowest_bits": {"bits_mean": 7.0, "relative_error_mean": 0.02}}
    policies = {"static-4": load, "pagedweight": {**load, "served_logit_error": served},
                "static-8": {**load, "served_logit_error": {"skipped": "no bf16 reference: does not fit"}}}
    result = {"model": "tiny", "gpu": "cpu", "date": "2026-01-01",
              "pressure": {"budget_bytes": 2e9, "policies": policies}}
    (tmp_path / "r.json").write_text(json.dumps(result))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    lines = tables.real_shape_pressure(["r.json"])
    assert lines[2].endswith("| – | – | – |")
    assert lines[3].endswith("| 0.0123 / 0.0500 | 0.900 | 7.00, 0.0200 |")
    assert lines[4].endswith("| no bf16 reference: does not fit |  |  |")
