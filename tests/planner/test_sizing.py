"""The sizing report (`pagedweight info`, the worker's start-up log) against the real parts.

Byte counts are checked against what the format writes (the tensors of a paged model) and
what the worker builds (its arena's KV capacity); the planner's choice against its budget.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open

from pagedweight.format.apl_format import BIT_WIDTHS
from pagedweight.format.model_config import ModelConfig
from pagedweight.format.paged_model import APL_FILE, load_paged_model
from pagedweight.memory.pool import WORKSPACE
from pagedweight.memory.kv_cache import kv_block_bytes
from pagedweight.planner.sizing import model_sizes, sizing_report
from pagedweight.runtime import RuntimeConfig, build_runtime, startup_sizing
from tests.conftest import BUNDLED_MODEL


def sizes_of(path, **kw):
    return model_sizes(path, "bfloat16", 2, workspace_bytes=kw.pop("workspace", 1 << 20), page_bytes=1024,
                       kv_block_size=16, **kw)


def test_checkpoint_parameters_are_the_tensors_in_its_files():
    with safe_open(str(BUNDLED_MODEL / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: int(torch.Size(s).numel()) for k, s in shapes.items()}
    report = sizing_report(sizes_of(BUNDLED_MODEL))
    assert report["num_params"] == sum(numel.values())
    assert report["num_expert_params"] == sum(n for k, n in numel.items() if ".experts." in k)
    assert report["dense_bytes"] == 2 * report["num_dense_params"]
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)
    assert report["kv_bytes_per_token"] == kv_block_bytes(cfg, 1, torch.bfloat16)


def test_expert_bytes_at_each_width_are_the_planes_and_luts_a_paged_model_stores(paged_micro_dir):
    stored = {b: 0 for b in BIT_WIDTHS}
    with safe_open(str(paged_micro_dir / APL_FILE), "pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            if key.endswith(".planes"):  # [E, 8, rows, cols/8]: b bits read planes 0..b-1
                for b in BIT_WIDTHS:
                    stored[b] += t[:, :b].numel()
            else:  # the stored LUT a width reads: LUT_3 at 3 bits, LUT_4 from 4 bits up
                width = int(key.rsplit("lut", 1)[1])
                for b in BIT_WIDTHS:
                    if min(b, 4) == width:
                        stored[b] += t.numel() * t.element_size()
    report = sizing_report(sizes_of(paged_micro_dir))
    assert report["source"] == "paged model"
    assert report["expert_bytes"] == {str(b): n for b, n in stored.items()}
    assert report["num_params"] == sizing_report(sizes_of(BUNDLED_MODEL))["num_params"]


@pytest.mark.parametrize("bits", [3, 8])
def test_kv_tokens_at_a_uniform_width_are_what_the_worker_gets(paged_micro_dir, bits):
    budget = 24 << 20
    runtime = build_runtime(paged_micro_dir, RuntimeConfig(budget, f"static-{bits}", dtype=torch.bfloat16))
    try:
        params = list(runtime.engine.model.parameters())
        dense = sum(p.numel() * p.element_size() for p in params)
        report = startup_sizing(load_paged_model(paged_micro_dir, with_bf16=False),
                                RuntimeConfig(budget, f"static-{bits}", dtype=torch.bfloat16),
                                sum(p.numel() for p in params), dense, runtime.pool.bytes_of(WORKSPACE))
        uniform = report["budget"]["uniform"][str(bits)]
        assert uniform["kv_tokens"] == runtime.engine.max_kv_blocks * runtime.engine.kv.block_size
        assert uniform["expert_bytes"] == runtime.table.resident_expert_bytes()
    finally:
        runtime.close()


def test_widest_uniform_width_is_the_last_that_holds_the_requests(paged_micro_dir):
    sizes = sizes_of(paged_micro_dir)
    full = sizing_report(sizes, 8 << 20)["budget"]
    # pick a request load that 8 bits cannot hold but 3 bits can
    kv3, kv8 = full["uniform"]["3"]["kv_tokens"], full["uniform"]["8"]["kv_tokens"]
    context, concurrency = 64, (kv8 + kv3) // 2 // 64
    requests = sizing_report(sizes, 8 << 20, context, concurrency)["budget"]["requests"]
    widest, need = requests["widest_uniform_bits"], concurrency * context
    assert widest is not None and widest < 8
    assert full["uniform"][str(widest)]["kv_tokens"] >= need
    assert full["uniform"][str(widest + 1)]["kv_tokens"] < need
    plan = requests["planner"]
    assert plan["fits"] and plan["expert_bytes"] <= plan["weight_budget"]
    assert widest <= plan["mean_bits"] < 8  # the planner uses bytes a uniform width leaves unused
    assert plan["sensitivity"] == "artifact"
    assert sum(plan["bits_histogram"].values()) == sizing_report(sizes)["num_expert_blocks"]


def test_a_budget_too_small_for_three_bits_says_so(paged_micro_dir):
    sizes = sizes_of(paged_micro_dir, workspace=0)
    floor = sizing_report(sizes)["dense_bytes"] + int(sizing_report(sizes, 1 << 30)["budget"]["uniform"]["3"]["expert_bytes"])
    requests = sizing_report(sizes, floor - 4096, 16, 1)["budget"]["requests"]
    assert requests["widest_uniform_bits"] is None
    assert not requests["planner"]["fits"] and requests["planner"]["shortfall_bytes"] > 0


def test_the_worker_logs_the_report_at_start_up(paged_micro_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagedweight.runtime"):
        runtime = build_runtime(paged_micro_dir, RuntimeConfig(32 << 20, "static-8"))
        runtime.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "KV cache" in text and "8 bits       experts" in text


def test_fitting_uniform_bits_is_the_widest_width_whose_experts_fit_beside_the_kv():
    from pagedweight.format.blocks import block_bytes
    from pagedweight.planner.sizing import fitting_uniform_bits

    experts = {b: 40 * block_bytes(256, 128, b) for b in BIT_WIDTHS}
    fixed, kv = 1000, 5000
    for b in BIT_WIDTHS:
        exact = fixed + kv + experts[b]
        assert fitting_uniform_bits(experts, fixed, kv, exact) == b
        assert fitting_uniform_bits(experts, fixed, kv, exact - 1) == (b - 1 if b > BIT_WIDTHS[0] else None)
    assert fitting_uniform_bits(experts, fixed, kv, 10**12) == BIT_WIDTHS[-1]
    # more KV demand in the same budget never allows a wider width
    widths = [fitting_uniform_bits(experts, fixed, k, fixed + experts[6]) or 0 for k in range(0, experts[6], 997)]
    assert widths[0] == 6 and widths[-1] == 0 and all(a >= b for a, b in zip(widths, widths[1:]))
    with pytest.raises(ValueError):
        fitting_uniform_bits({8: 1}, 0, 0, 10)
