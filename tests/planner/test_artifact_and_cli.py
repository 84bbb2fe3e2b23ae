"""The paged-artifact adapter, prompt routing context, loss scales and `pagedweight plan`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedweight.cli.main import main
from pagedweight.common.errors import CheckpointError, UserError
from pagedweight.offline.group_scales import measure_group_scales
from pagedweight.offline.prompt_routing import record_prompt_routing
from pagedweight.planner.artifact import PagedPlannerInputs, table_from_meta
from pagedweight.planner.loss_scale import GroupScales, apply_group_scales
from pagedweight.planner.prompt_context import prompt_context
from pagedweight.planner.residual_predictor import ResidualPredictor
from pagedweight.model import load_model
from pagedweight.format.apl_format import BIT_WIDTHS, MODULES, BlockId, block_bytes
from pagedweight.format.paged_model import FORMAT_NAME, FORMAT_VERSION, APL_FORMAT_VERSION, META_FILE, write_meta
from tests.conftest import BUNDLED_MODEL

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 64, 96


def synthetic_meta(seed: int = 0) -> dict:
    """paged_model.json as `pagedweight quantize` writes it, with made-up numbers."""
    rng = np.random.default_rng(seed)
    blocks, sensitivity = [], {}
    for layer in range(LAYERS):
        for expert in range(EXPERTS):
            for module in MODULES:
                rows, cols = (2 * INTER, HIDDEN) if module == "gate_up" else (HIDDEN, INTER)
                key = BlockId(layer, expert, module).key()
                blocks.append({"key": key, "layer": layer, "expert": expert, "module": module,
                               "rows": rows, "cols": cols,
                               "bytes": {str(b): block_bytes(rows, cols, b) for b in BIT_WIDTHS}})
                scale = rng.lognormal()
                sensitivity[key] = {str(b): scale * 4.0 ** -b for b in BIT_WIDTHS}
    counts = rng.integers(1, 500, size=(LAYERS, EXPERTS))
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "apl_format_version": APL_FORMAT_VERSION,
            "model_config": {"num_experts_per_tok": 2}, "num_layers": LAYERS, "num_experts": EXPERTS,
            "blocks": blocks, "sensitivity": sensitivity, "files": {},
            "routing": {"num_tokens": 1000, "token_counts": counts.tolist(),
                        "routing_mass": (counts * 0.5).tolist()}}


@pytest.fixture
def paged_dir(tmp_path):
    write_meta(tmp_path, synthetic_meta())
    return tmp_path


def test_table_from_meta_reads_bytes_sensitivity_and_routing(tmp_path):
    meta = synthetic_meta()
    table = table_from_meta(meta, tmp_path)
    assert table.num_blocks == LAYERS * EXPERTS * 2
    first = meta["blocks"][0]
    assert table.nbytes[0].tolist() == [first["bytes"][str(b)] for b in BIT_WIDTHS]
    assert table.sensitivity[0, 0] == pytest.approx(meta["sensitivity"][first["key"]]["3"])
    assert table.calib_mass[0, 0] == pytest.approx(meta["routing"]["routing_mass"][0][0] / 1000)


def test_table_from_meta_reads_the_gauss_newton_table_when_asked(tmp_path):
    meta = synthetic_meta()
    with pytest.raises(CheckpointError, match="sensitivity_gn"):
        table_from_meta(meta, tmp_path, "sensitivity_gn")
    meta["sensitivity_gn"] = {k: {b: 2 * v for b, v in row.items()} for k, row in meta["sensitivity"].items()}
    plain, gn = table_from_meta(meta, tmp_path), table_from_meta(meta, tmp_path, "sensitivity_gn")
    assert np.allclose(gn.sensitivity, 2 * plain.sensitivity)


def test_table_from_meta_rejects_bytes_that_disagree_with_the_format(tmp_path):
    meta = synthetic_meta()
    meta["blocks"][3]["bytes"]["5"] += 1
    with pytest.raises(CheckpointError, match="disagree"):
        table_from_meta(meta, tmp_path)
    del meta["sensitivity"][meta["blocks"][0]["key"]]
    with pytest.raises(CheckpointError, match="lacks"):
        table_from_meta(meta, tmp_path)


@pytest.mark.parametrize("policy", ["pagedweight", "uniform", "mxmoe", "dpllm"])
def test_plan_cli_writes_a_bits_file_within_budget(paged_dir, tmp_path, capsys, policy):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(paged_dir), "--avg-bits", "4.5", "--policy", policy, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    bits = json.loads(out.read_text())
    meta = synthetic_meta()
    assert set(bits) == {b["key"] for b in meta["blocks"]}
    total = sum(b["bytes"][str(bits[b["key"]])] for b in meta["blocks"])
    assert total == summary["plan_bytes"] <= summary["budget_bytes"]
    assert summary["budget_bytes"] == round((summary["uniform_bytes"]["4"] + summary["uniform_bytes"]["5"]) / 2)


def test_plan_cli_expert_bytes_and_bad_input(paged_dir, tmp_path, capsys):
    out = tmp_path / "plan.json"
    table = table_from_meta(synthetic_meta(), paged_dir)
    budget = table.uniform_bytes(3) + 12345
    assert main(["plan", "--model", str(paged_dir), "--expert-bytes", str(budget), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["plan_bytes"] <= budget
    written = out.read_bytes()
    # an existing --out is refused before any work, and left as it was
    assert main(["plan", "--model", str(paged_dir), "--expert-bytes", str(budget), "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == written
    assert main(["plan", "--model", str(paged_dir), "--expert-bytes", "10", "--out", str(out), "--force"]) == 2
    assert "below the smallest plan" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "nope"), "--avg-bits", "4", "--out", str(out)]) == 2
    with pytest.raises(SystemExit):  # argparse: exactly one of the budget flags
        main(["plan", "--model", str(paged_dir), "--out", str(out)])


def test_plan_cli_refuses_scales_measured_for_another_table(paged_dir, tmp_path, capsys):
    scales = tmp_path / "scales.json"
    groups = {f"L{l}.{m}": 1.0 for l in range(LAYERS) for m in MODULES}
    scales.write_text(json.dumps({"scales": groups, "sensitivity": "sensitivity_gn"}))
    args = ["plan", "--model", str(paged_dir), "--avg-bits", "4", "--scales", str(scales),
            "--out", str(tmp_path / "plan.json")]
    assert main(args) == 2
    assert "sensitivity_gn" in capsys.readouterr().err
    scales.write_text(json.dumps({"scales": groups}))  # no table named: the default one
    assert main(args) == 0


def test_loss_scales_multiply_each_group_and_must_cover_every_group(tmp_path):
    table = table_from_meta(synthetic_meta(), tmp_path)
    scales = {f"L{l}.{m}": float(10 * l + (m == "down") + 1) for l in range(LAYERS) for m in MODULES}
    scaled = apply_group_scales(table, GroupScales(scales, {}, 0))
    for i, b in enumerate(table.block_ids):
        assert np.allclose(scaled.sensitivity[i], table.sensitivity[i] * scales[f"L{b.layer}.{b.module}"])
    del scales["L1.down"]
    with pytest.raises(UserError, match="L1.down"):
        apply_group_scales(table, GroupScales(scales, {}, 0))


@pytest.fixture(scope="module")
def micro_model():
    return load_model(BUNDLED_MODEL, dtype=torch.float32)


def micro_table(model):
    cfg = model.config
    meta = synthetic_meta()
    ids = [BlockId(l, e, m) for l in range(cfg.num_layers) for e in range(cfg.num_experts) for m in MODULES]
    shapes = {"gate_up": (2 * cfg.expert_intermediate_size, cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.expert_intermediate_size)}
    meta.update(num_layers=cfg.num_layers, num_experts=cfg.num_experts, blocks=[
        {"key": b.key(), "rows": shapes[b.module][0], "cols": shapes[b.module][1],
         "bytes": {str(w): block_bytes(*shapes[b.module], w) for w in BIT_WIDTHS}} for b in ids])
    meta["sensitivity"] = {b.key(): {str(w): 4.0 ** -w for w in BIT_WIDTHS} for b in ids}
    counts = np.ones((cfg.num_layers, cfg.num_experts))
    meta["routing"] = {"num_tokens": 1, "token_counts": counts.tolist(), "routing_mass": counts.tolist()}
    return table_from_meta(meta, BUNDLED_MODEL)


def test_prompt_context_counts_routing_and_applies_heads(micro_model):
    table = micro_table(micro_model)
    cfg = micro_model.config
    ids = list(range(5, 45))
    recorder = record_prompt_routing(micro_model, ids, cfg.num_experts, window=16)
    assert recorder.counts.sum(axis=1).tolist() == [len(ids) * cfg.num_experts_per_tok] * cfg.num_layers
    assert recorder.mass.sum(axis=1) == pytest.approx(np.full(cfg.num_layers, len(ids)), rel=1e-4)
    assert all(block.observer is None for block in micro_model.moe_blocks)
    num_features = cfg.num_layers * cfg.num_experts
    heads = ResidualPredictor(np.zeros((table.num_blocks, num_features)),
                              np.linspace(-1, 1, table.num_blocks)[::-1],
                              np.zeros(num_features), np.ones(num_features))
    keys = [b.key() for b in table.block_ids][::-1]  # heads in another order: mapped by key
    inputs = PagedPlannerInputs(table, cfg.num_experts_per_tok, heads, keys, BUNDLED_MODEL)
    context = prompt_context(recorder, inputs)
    assert np.allclose(context.residual, np.linspace(-1, 1, table.num_blocks))
    assert context.relative_mass.shape == (cfg.num_layers, cfg.num_experts)
    assert context.relative_mass.mean(axis=1) == pytest.approx(np.ones(cfg.num_layers))
    # the prompt moved the moving average off the flat calibration prior
    assert context.relative_mass.std() > 0


def test_measured_loss_scales_cover_every_group_and_are_positive(micro_model):
    table = micro_table(micro_model)
    noise = {}

    def set_bits(bits):
        # a stand-in for paged experts: perturb each expert's weights by 4^-bits noise
        for layer, block in enumerate(micro_model.moe_blocks):
            for module in MODULES:
                weights = getattr(block.experts, module)
                key = (layer, module)
                if key not in noise:
                    noise[key] = (weights.detach().clone(), torch.randn_like(weights))
                clean, direction = noise[key]
                per_expert = torch.tensor([float(bits[i]) for i, b in enumerate(table.block_ids)
                                           if b.layer == layer and b.module == module])
                with torch.no_grad():
                    weights.copy_(clean + 4.0 ** -per_expert[:, None, None] * direction)

    scales = measure_group_scales(micro_model, table, [list(range(3, 40))], set_bits)
    set_bits(np.full(table.num_blocks, 8))
    for layer, block in enumerate(micro_model.moe_blocks):  # restore the shared fixture
        for module in MODULES:
            with torch.no_grad():
                getattr(block.experts, module).copy_(noise[(layer, module)][0])
    assert set(scales.scales) == {f"L{l}.{m}" for l in range(micro_model.config.num_layers) for m in MODULES}
    assert all(v > 0 for v in scales.kl.values())
    assert all(v > 0 for v in scales.scales.values())


def test_a_rounding_error_below_zero_is_recorded_as_a_zero_kl_the_loader_accepts():
    """A group whose lowering changes nothing can measure KL = -4e-7 (a float sum); the
    scales written from it must load again (GroupScales.from_json refuses negatives)."""
    from pagedweight.offline.group_scales import scales_from_kls
    from pagedweight.planner.loss_scale import GroupScales
    from tests.planner.strategies import random_table

    table = random_table(2, 4, 0)
    modules = sorted({b.module for b in table.block_ids})
    kls = {f"L{layer}.{module}": 0.01 * (layer + 1) for layer in range(table.num_layers) for module in modules}
    kls[f"L0.{modules[-1]}"] = -4.4e-7
    scales = scales_from_kls(table, kls, 1024)
    loaded = GroupScales.from_json(json.loads(json.dumps(scales.to_json())))
    assert loaded.kl[f"L0.{modules[-1]}"] == 0.0
    assert all(v >= 0 for v in loaded.scales.values()) and min(loaded.scales.values()) > 0
