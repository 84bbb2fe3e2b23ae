"""The streaming quantiser (the default `quantize`) against the whole-model one it replaced
(tests/offline/quantize_reference.py, unchanged): same planes and LUTs bit for bit, the same Hessians,
output Fisher, sensitivity tables and residual heads within float tolerance, on every
shared model and on the Qwen3-MoE and OLMoE families; and a run interrupted mid-way
resumes from its work directory to the same artifact, refusing a directory from another
run or one whose files changed. The loss-scale phase streams too (stream_scales.py): its
group KLs and every table's scales equal add_planner_scales' on the whole model."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys

import pytest
import torch

from pagedweight.common.errors import UserError
from pagedweight.format.paged_model import load_paged_model
from pagedweight.offline.quantize import quantize_model
from tests.conftest import BUNDLED_MODEL, REPO_ROOT, shared_model_dirs
from tests.model.families import PIPELINE_FAMILIES, reference_model, write_checkpoint
from tests.offline.conftest import quick_config
from tests.offline.quantize_reference import quantize_model_in_memory

RTOL = 1e-5
SCALE_TOKENS = 48  # per calibration file for the loss scales: two windows


def config(scale_tokens: int = 0):
    # few k-means iterations keep the tiny models' runs short (the same code runs either
    # way); the loss scales are measured where a test compares them (scale_tokens)
    quick = quick_config()
    return dataclasses.replace(quick, scale_tokens=scale_tokens,
                               quantizer=dataclasses.replace(quick.quantizer, seed_iters=6, split_iters=2))


def assert_same_scales(a_dir, b_dir) -> None:
    """The planner_scales sections: the same group KLs and scales per table within RTOL."""
    a = json.loads((a_dir / "paged_model.json").read_text())["planner_scales"]
    b = json.loads((b_dir / "paged_model.json").read_text())["planner_scales"]
    assert a.keys() == b.keys() and {"sensitivity", "sensitivity_gn"} <= a.keys()
    assert a["tokens_per_file"] == b["tokens_per_file"] and a["calib_files"] == b["calib_files"]
    for table in ("sensitivity", "sensitivity_gn"):
        assert a[table]["num_tokens"] == b[table]["num_tokens"] > 0
        for field in ("scales", "kl_at_3_bits"):
            assert a[table][field].keys() == b[table][field].keys() and len(a[table][field]) > 1
            assert any(v > 0 for v in a[table][field].values())
            for group, value in a[table][field].items():
                assert b[table][field][group] == pytest.approx(value, rel=RTOL, abs=1e-30), (table, field, group)
        rest = lambda r: {k: v for k, v in r.items() if k not in ("scales", "kl_at_3_bits")}  # noqa: E731
        assert rest(a[table]) == rest(b[table])


def assert_same_artifact(a_dir, b_dir) -> None:
    a, b = load_paged_model(a_dir, with_bf16=False), load_paged_model(b_dir, with_bf16=False)
    assert a.apl.keys() == b.apl.keys()
    for key in a.apl:
        assert torch.equal(a.apl[key].planes, b.apl[key].planes), key
        for bits in a.apl[key].luts:
            assert torch.equal(a.apl[key].luts[bits], b.apl[key].luts[bits]), (key, bits)
    assert a.hessians.keys() == b.hessians.keys() and any(m.endswith(".grad_sq") for _, m in a.hessians)
    for key in a.hessians:
        torch.testing.assert_close(b.hessians[key], a.hessians[key], rtol=RTOL, atol=0, msg=str(key))
    for table in ("sensitivity", "sensitivity_gn"):
        assert a.meta[table].keys() == b.meta[table].keys()
        for block, row in a.meta[table].items():
            for bits, value in row.items():
                assert b.meta[table][block][bits] == pytest.approx(value, rel=RTOL, abs=1e-30), (table, block, bits)
    for name, tensor in a.residual_heads.items():
        torch.testing.assert_close(b.residual_heads[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    assert a.dense_state.keys() == b.dense_state.keys()
    for name, tensor in a.dense_state.items():
        assert torch.equal(b.dense_state[name], tensor), name
    for section in ("routing", "calibration", "sensitivity_non_monotone"):
        assert a.meta[section] == b.meta[section], section
    assert a.meta["residual_heads"]["ridge_lambda"] == b.meta["residual_heads"]["ridge_lambda"]


def checkpoints():
    return [pytest.param(path, id=path.name) for path in shared_model_dirs()] + \
        [pytest.param(family, id=family) for family in PIPELINE_FAMILIES]


@pytest.mark.slow
@pytest.mark.parametrize("source", checkpoints())
def test_streaming_equals_the_whole_model_quantiser(source, tmp_path, calib_files):
    if isinstance(source, str):  # a family: transformers' model with random weights, in bf16
        source = write_checkpoint(reference_model(source).to(torch.bfloat16), tmp_path / "ckpt", "per_expert")
    whole = quantize_model_in_memory(source, tmp_path / "whole", calib_files, config(SCALE_TOKENS))
    streamed = quantize_model(source, tmp_path / "streamed", calib_files, config(SCALE_TOKENS))
    assert_same_artifact(whole, streamed)
    assert_same_scales(whole, streamed)
    record = json.loads((streamed / "paged_model.json").read_text())["quantizer"]
    assert record["streaming"]["compute_dtype"] == "float32" and record["peak_host_bytes"] > 0
    # the anonymous figure leaves the checkpoint's mapped pages out: never above the resident peak
    assert 0 < record["peak_host_anonymous_bytes"] <= record["peak_host_bytes"]
    assert record["streaming"]["seconds"]["loss_scales"] > 0


class StopAfter(io.StringIO):
    """A progress stream that interrupts the run after `steps` completed steps."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps

    def write(self, text: str) -> int:
        if " steps | " in text:
            self.steps -= 1
            if self.steps < 0:
                raise KeyboardInterrupt
        return super().write(text)


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_same_artifact(tmp_path, calib_files):
    reference = quantize_model(BUNDLED_MODEL, tmp_path / "reference", calib_files, config())
    work = tmp_path / "work"
    # micro-mixtral has 4 layers: embed, forward x4, loss, backward x4; stop inside the backward
    with pytest.raises(KeyboardInterrupt):
        quantize_model(BUNDLED_MODEL, tmp_path / "first", calib_files, config(), work_dir=work,
                       progress=StopAfter(7))
    manifest = json.loads((work / "manifest.json").read_text())
    assert manifest["steps"][:7] == ["embed", "forward0", "forward1", "forward2", "forward3", "loss", "backward3"]

    # another run's settings: refused, the work directory left as it was
    other = dataclasses.replace(config(), quantizer=dataclasses.replace(config().quantizer, seed_iters=3))
    with pytest.raises(UserError, match="settings"):
        quantize_model(BUNDLED_MODEL, tmp_path / "other", calib_files, other, work_dir=work)

    progress = io.StringIO()
    resumed = quantize_model(BUNDLED_MODEL, tmp_path / "second", calib_files, config(), work_dir=work,
                             progress=progress)
    assert_same_artifact(reference, resumed)
    record = json.loads((resumed / "paged_model.json").read_text())["quantizer"]["streaming"]
    assert record["steps_resumed"] == len(manifest["steps"]) >= 7
    assert progress.getvalue().count(" steps | ") == 10 - record["steps_resumed"]
    assert "ETA" in progress.getvalue() and "blocks 64/64" in progress.getvalue()
    assert not work.exists()  # removed once the artifact is written


@pytest.mark.slow
def test_a_run_interrupted_in_the_loss_scales_resumes_to_the_same_scales(tmp_path, calib_files):
    """The scale phase's steps are in the work directory like the others: stopped after its
    second layer, the next run writes the artifact again and goes on from the third."""
    reference = quantize_model(BUNDLED_MODEL, tmp_path / "reference", calib_files, config(SCALE_TOKENS))
    work = tmp_path / "work"
    # 10 calibration steps, then scalex, scale0, scale1 | scale2, scale3, scalekl
    with pytest.raises(KeyboardInterrupt):
        quantize_model(BUNDLED_MODEL, tmp_path / "first", calib_files, config(SCALE_TOKENS), work_dir=work,
                       progress=StopAfter(12))
    manifest = json.loads((work / "manifest.json").read_text())
    assert manifest["steps"][10:] == ["scalex", "scale0", "scale1"]
    assert sorted(f for f in manifest["files"] if f.startswith("sx")) == ["sx2"]  # consumed ones dropped

    progress = io.StringIO()
    resumed = quantize_model(BUNDLED_MODEL, tmp_path / "second", calib_files, config(SCALE_TOKENS),
                             work_dir=work, progress=progress)
    assert progress.getvalue().count(" steps | ") == 3 and "loss scales layer 4/4" in progress.getvalue()
    assert_same_artifact(reference, resumed)
    planner = lambda d: json.loads((d / "paged_model.json").read_text())["planner_scales"]  # noqa: E731
    assert planner(resumed) == planner(reference)
    assert not work.exists()


@pytest.mark.slow
def test_other_scale_tokens_redo_only_the_loss_scale_steps(tmp_path, calib_files):
    """Interrupted in the scale phase, a run with another --scale-tokens keeps the
    calibration steps and measures the scales again on its own windows."""
    reference = quantize_model(BUNDLED_MODEL, tmp_path / "reference", calib_files, config(SCALE_TOKENS + 8))
    work = tmp_path / "work"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(BUNDLED_MODEL, tmp_path / "first", calib_files, config(SCALE_TOKENS), work_dir=work,
                       progress=StopAfter(12))
    progress = io.StringIO()
    resumed = quantize_model(BUNDLED_MODEL, tmp_path / "second", calib_files, config(SCALE_TOKENS + 8),
                             work_dir=work, progress=progress)
    assert progress.getvalue().count(" steps | ") == 6  # scalex, scale0..3, scalekl
    planner = lambda d: json.loads((d / "paged_model.json").read_text())["planner_scales"]  # noqa: E731
    assert planner(resumed) == planner(reference) and planner(resumed)["tokens_per_file"] == SCALE_TOKENS + 8


@pytest.mark.slow
def test_a_changed_work_file_is_refused_and_restart_discards_it(tmp_path, calib_files):
    work = tmp_path / "work"
    with pytest.raises(KeyboardInterrupt):
        quantize_model(BUNDLED_MODEL, tmp_path / "first", calib_files, config(), work_dir=work,
                       progress=StopAfter(3))
    layer = work / "layer0.safetensors"
    layer.write_bytes(layer.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(UserError, match="layer0.safetensors: missing, truncated or changed"):
        quantize_model(BUNDLED_MODEL, tmp_path / "second", calib_files, config(), work_dir=work)
    out = quantize_model(BUNDLED_MODEL, tmp_path / "third", calib_files, config(), work_dir=work, restart=True)
    assert json.loads((out / "paged_model.json").read_text())["quantizer"]["streaming"]["steps_resumed"] == 0


def test_cli_refuses_a_foreign_work_dir_in_one_line(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "manifest.json").write_text("{not json")
    result = subprocess.run(
        [sys.executable, "-m", "pagedweight.cli.main", "quantize", "--model", str(BUNDLED_MODEL),
         "--out", str(tmp_path / "out"), "--work-dir", str(work), "--calib-tokens", "256", "--seq-len", "64",
         "--scale-tokens", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreadable work manifest" in lines[0] and "--restart" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tile_elements", [64 * 32, 3 * 64 * 32, 16 * 32])  # groups, uneven groups, row ranges
def test_tiled_quantisation_equals_one_pass(tile_elements):
    """Tiles of whole experts, or row ranges of one expert (Mixtral-8x7B's experts exceed a
    tile), give the planes and LUTs of quantising every row at once, and the same column
    errors, plain and Gauss-Newton (from the stored planes)."""
    from pagedweight.format.apl_format import LUT_WIDTHS
    from pagedweight.offline.layer_quantize import gn_col_errors, quantize_experts, quantize_layer
    from tests.offline.conftest import quick_config as qc

    gen = torch.Generator().manual_seed(0)
    E, R, C = 5, 64, 32
    w = torch.randn(E, R, C, generator=gen)
    x = torch.randn(E, 256, C, generator=gen) * (torch.rand(E, 1, C, generator=gen) + 0.3)
    h_full = x.transpose(1, 2) @ x / 256  # the default quantiser's feedback and refit need them
    h = h_full.diagonal(dim1=1, dim2=2).contiguous()
    g = torch.rand(E, R, generator=gen)
    whole = quantize_layer(w, h, qc().quantizer, "cpu", g, h_full)
    tiled = quantize_experts(w, h, qc().quantizer, "cpu", tile_elements, h_full)
    gn = gn_col_errors(w, tiled.planes, g, "cpu", tile_elements)
    assert torch.equal(tiled.planes.planes, whole.planes.planes)
    for b in LUT_WIDTHS:  # the stored LUTs (5..8 bits derive from LUT_4)
        assert torch.equal(tiled.planes.luts[b], whole.planes.luts[b])
        torch.testing.assert_close(tiled.col_errors[b], whole.col_errors[b], rtol=1e-5, atol=0)
        torch.testing.assert_close(gn[b], whole.col_errors_gn[b], rtol=1e-5, atol=0)


def test_anonymous_host_memory_counts_what_the_process_holds_not_what_it_maps(tmp_path):
    """RssAnon grows with a tensor the process fills and not with a file it maps and reads
    (the checkpoint's case), where the resident set grows with both. In a fresh process: in
    this one the allocator may hand the tensor pages an earlier test already made resident."""
    import subprocess
    import sys

    from pagedweight.offline.host_memory import anonymous_bytes

    if anonymous_bytes() is None:
        pytest.skip("no RssAnon in /proc/self/status (not Linux)")
    path = tmp_path / "mapped.bin"
    path.write_bytes(b"\x01" * (64 << 20))
    script = f"""
import mmap, torch
from pagedweight.offline.host_memory import AnonymousPeak, anonymous_bytes
peak = AnonymousPeak()
peak.sample()
before = anonymous_bytes()
with open({str(path)!r}, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
    assert sum(mapped[i] for i in range(0, len(mapped), 4096)) == len(mapped) // 4096  # every page read
    mapped_delta = anonymous_bytes() - before
held = torch.ones(64 << 18)  # 64 MiB of float32 the process writes
peak.sample()
print(mapped_delta, anonymous_bytes() - before, peak.peak - before)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    mapped_delta, held_delta, peak_delta = map(int, done.stdout.split())
    assert mapped_delta < 16 << 20 and held_delta > 48 << 20, (mapped_delta, held_delta)
    assert peak_delta >= 48 << 20
