"""The per-component step profile (bench/step_components.py) and its docs table
(bench/tables.py): on the CPU every component of a tiny Qwen1.5-MoE-like model gets the
operators its module runs, the wrappers are taken out afterwards, and the table shows
each component's ms and kernels from a result file."""

from __future__ import annotations

import json

import torch

from bench import tables
from bench.step_components import COMPONENTS, component_profile
from pagedweight.engine.engine import Engine, EngineConfig
from pagedweight.engine.scheduler import SchedulerConfig
from pagedweight.format.model_config import ModelConfig
from pagedweight.memory.kv_cache import KVCacheConfig
from pagedweight.offline.real_shape_models import build_hf_model, ours_from_hf


def _engine():
    hf, raw = build_hf_model("tiny-qwen-moe", torch.device("cpu"), torch.float32, seed=0)
    model = ours_from_hf(hf, ModelConfig.from_dict(raw))
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
                          kv=KVCacheConfig(block_size=4), attention_impl="inplace", num_kv_blocks=256)
    return Engine(model, config=config)


def test_every_component_gets_its_operators_and_the_model_is_left_as_it_was():
    engine = _engine()
    model = engine.model
    before = {id(m): dict(vars(m)) for m in model.modules()}
    result = component_profile(engine, 4, 8, torch.device("cpu"), steps=2)
    parts = result["components"]
    assert set(parts) == set(COMPONENTS)
    for name in ("attention", "gating", "shared expert", "routed experts", "norms", "embed + lm head", "sampling"):
        assert parts[name]["kernels"] > 0, name
    # attention: 2 layers x (projection, RoPE, KV write, decode attention ...) per step
    assert parts["attention"]["kernels"] > parts["shared expert"]["kernels"]
    assert result["kernels_per_step"] == sum(p["kernels"] for p in parts.values())
    assert result["step_ms"] >= result["host_ms"] >= 0
    assert not engine.has_work and engine.runner.graphs is None  # the engine had none on the CPU
    assert all(dict(vars(m)) == before[id(m)] for m in model.modules())  # no wrapper left behind
    assert "sample" not in vars(engine.runner)


def test_the_prefill_profile_times_one_step_that_prefills_every_prompt():
    engine = _engine()
    one_prompt = component_profile(engine, 1, 8, torch.device("cpu"), prefill=True)
    four_prompts = component_profile(engine, 4, 8, torch.device("cpu"), prefill=True)
    assert four_prompts["steps"] == 1 and four_prompts["prefill_tokens"] == 32
    # a decode step's operators do not depend on the prompts' length; the prefill's attention
    # covers the prompt (its kernels are per step here, where a decode profile averages)
    decode = component_profile(engine, 4, 8, torch.device("cpu"), steps=1)
    assert "prefill_tokens" not in decode
    assert four_prompts["components"]["routed experts"]["kernels"] > 0
    assert four_prompts["step_ms"] > 0 and one_prompt["step_ms"] > 0
    assert not engine.has_work


def test_components_table_reads_the_result(tmp_path, monkeypatch):
    parts = {c: {"ms": 0.5, "kernels": 3.0} for c in COMPONENTS}
    profile = {"1": {"step_ms": 9.0, "host_ms": 5.0, "components": parts, "kernels_per_step": 24.0}}
    result = {"model": "tiny", "gpu": "cpu", "date": "2026-01-01",
              "engine_bf16_dense": {"graphs-inplace": {"loads": [], "components": profile}},
              "runtime_static": {"static-4": {"modes": {}, "components": profile,
                                              "prefill_components": {"64x32": {**profile["1"], "step_ms": 70.0}}}}}
    (tmp_path / "r.json").write_text(json.dumps(result))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    lines = tables.real_shape_components(["r.json", "missing.json"])
    assert lines[2].startswith("| tiny | bf16 | decode c1 | 9.0 | 5.0 | 0.5 (3) |") and lines[2].endswith("| 24.0 |")
    assert lines[3].startswith("| tiny | static-4 | decode c1 | 9.0 |")
    assert lines[4].startswith("| tiny | static-4 | prefill 64x32 | 70.0 |")
    assert tables.real_shape_components(["missing.json"])[0].startswith("No result yet")


def test_real_shape_table_marks_what_does_not_fit(tmp_path, monkeypatch):
    """A run built layer by layer: transformers and the bf16 engine "does not fit", the bf16
    floor marked beside its numbers; rows cut by the time limit are left blank."""
    skipped = {"skipped": "does not fit", "bf16_needs_bytes": 100, "device_bytes": 80}
    floor = {"1": {"floor_tokens_per_s": 160.0}, "does_not_fit": True}
    result = {"model": "big", "gpu": "H100", "date": "2026-01-01", "transformers_generate": skipped,
              "engine_bf16_dense": skipped,
              "runtime_static": {"static-4": {"modes": {"graphs-inplace": [
                  {"concurrency": 1, "output_tokens_per_s": 120.0}]}}},
              "hbm_floor": {"bf16": floor, "static-4": {"1": {"floor_tokens_per_s": 470.0}}}}
    (tmp_path / "big.json").write_text(json.dumps(result))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    lines = tables.real_shape(["big.json"])
    assert "| big | transformers generate: does not fit |  |  |  |  |" in lines
    assert "| big | engine bf16: does not fit |  |  |  |  |" in lines
    assert "| big | runtime static-4, graphs-inplace | 120.0 |  |  |  |" in lines
    assert "| big | HBM floor bf16 (does not fit) | 160.0 |  |  |  |" in lines
