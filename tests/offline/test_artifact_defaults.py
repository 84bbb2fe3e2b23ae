"""What `quantize` now records by default: the planner's loss scales (so `plan`, `eval` and
the runtime rank in loss units without flags), and no bf16 copy of the experts (the
source checkpoint has them); older artifacts that carry the copy still load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedweight.cli.main import main
from pagedweight.common.errors import CheckpointError
from pagedweight.format.apl_format import MODULES
from pagedweight.format.paged_model import BF16_FILE, FORMAT_VERSION, META_FILE, load_paged_model, write_meta
from pagedweight.model import load_model
from pagedweight.model.source_experts import attach_source_experts
from pagedweight.offline.quantize import quantize_model
from pagedweight.planner.artifact import load_planner_inputs
from pagedweight.planner.loss_scale import GroupScales
from pagedweight.planner.policies import make_policy
from tests.conftest import BUNDLED_MODEL
from tests.offline.conftest import quick_config


@pytest.fixture(scope="module")
def source_experts():
    model = load_model(BUNDLED_MODEL, dtype=torch.float32)
    return {(l, m): getattr(b.experts, m).detach().to(torch.bfloat16)
            for l, b in enumerate(model.moe_blocks) for m in MODULES}


@pytest.fixture(scope="module")
def kept_dir(tmp_path_factory, calib_files):
    """The same quantisation with --keep-bf16 (and no loss scales, to stay quick)."""
    from dataclasses import replace

    config = replace(quick_config(), keep_bf16=True, scale_tokens=0)
    return quantize_model(BUNDLED_MODEL, tmp_path_factory.mktemp("kept") / "micro", calib_files, config)


def test_no_bf16_copy_is_stored_by_default(paged_dir):
    meta = json.loads((paged_dir / META_FILE).read_text())
    assert BF16_FILE not in meta["files"] and not (paged_dir / BF16_FILE).exists()
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["source"] == {"path": str(BUNDLED_MODEL.resolve()), "bf16_experts": "source checkpoint"}
    assert load_paged_model(paged_dir, with_bf16=True).bf16_experts is None


def test_the_reference_experts_come_from_the_source_checkpoint(paged_dir, kept_dir, source_experts):
    attached = attach_source_experts(load_paged_model(paged_dir)).bf16_experts
    stored = load_paged_model(kept_dir, with_bf16=True).bf16_experts
    for key, expected in source_experts.items():
        assert torch.equal(attached[key], expected)
        assert torch.equal(stored[key], expected)


def test_a_version_1_artifact_is_refused_with_a_clear_error(kept_dir, tmp_path):
    # versions 1 and 2 carry no checksum over paged_model.json: an edit could not be told
    old = tmp_path / "v1"
    shutil.copytree(kept_dir, old)
    meta = json.loads((old / META_FILE).read_text())
    meta["format_version"] = 1
    del meta["source"]["bf16_experts"]
    (old / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="version 1 has no checksum"):
        load_paged_model(old, with_bf16=True)


def test_a_missing_source_checkpoint_is_one_clear_error(paged_dir, tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(paged_dir, moved)
    meta = json.loads((moved / META_FILE).read_text())
    meta["source"]["path"] = str(tmp_path / "gone")
    write_meta(moved, meta)
    with pytest.raises(CheckpointError, match="source checkpoint .*gone is not there"):
        attach_source_experts(load_paged_model(moved))
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 20)
    # with bits the source is not needed; without, the unquantised reference is
    assert main(["eval", "ppl", "--model", str(moved), "--text", str(text), "--bits", "4",
                 "--seq-len", "32", "--max-tokens", "64"]) == 0
    capsys.readouterr()
    assert main(["eval", "ppl", "--model", str(moved), "--text", str(text), "--seq-len", "32",
                 "--max-tokens", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--keep-bf16" in err[0]


def test_quantize_records_loss_scales_for_both_tables(paged_dir, calib_files, tmp_path, capsys):
    meta = json.loads((paged_dir / META_FILE).read_text())
    record = meta["planner_scales"]
    assert record["calib_files"] == [str(f) for f in calib_files]
    s, gn = GroupScales.from_json(record["sensitivity"]), GroupScales.from_json(record["sensitivity_gn"])
    groups = {f"L{l}.{m}" for l in range(meta["num_layers"]) for m in MODULES}
    assert set(s.scales) == set(gn.scales) == groups
    assert s.kl == gn.kl and all(v > 0 for v in s.kl.values())  # one measurement, two tables
    assert s.scales != gn.scales  # different denominators
    assert load_planner_inputs(paged_dir).scales.scales == s.scales
    assert load_planner_inputs(paged_dir, sensitivity="sensitivity_gn").scales.scales == gn.scales
    # the same numbers as the stand-alone command measures on the same text
    out = tmp_path / "scales.json"
    assert main(["plan-scales", "--model", str(paged_dir), "--out", str(out), "--tokens", "256",
                 "--calib", *map(str, calib_files)]) == 0
    alone = GroupScales.read(out)
    assert alone.scales == pytest.approx(s.scales, rel=1e-5)


def test_plan_uses_the_artifact_scales_by_default_and_raw_on_request(paged_dir, tmp_path, capsys):
    inputs = load_planner_inputs(paged_dir)
    budget = inputs.table.uniform_bytes(3.6)
    runs = {}
    for label, extra in (("artifact", []), ("raw", ["--scales", "raw"])):
        out = tmp_path / f"{label}.json"
        assert main(["plan", "--model", str(paged_dir), "--expert-bytes", str(budget), "--out", str(out), *extra]) == 0
        assert json.loads(capsys.readouterr().out)["scales"] == label
        runs[label] = inputs.table.bits_from_map(json.loads(out.read_text())).tolist()
    assert runs["artifact"] == make_policy("pagedweight", inputs.table, scales=inputs.scales).plan(budget).bits.tolist()
    assert runs["raw"] == make_policy("pagedweight", inputs.table).plan(budget).bits.tolist()
