"""`quantize --out` appears whole or not at all."""

from __future__ import annotations

import hashlib

import pytest
import torch

from pagedweight.cli.main import main
from pagedweight.common.errors import UserError
from pagedweight.format.paged_model import load_paged_model
from pagedweight.offline.atomic_output import atomic_output_dir
from pagedweight.offline.quantize import quantize_layer, quantize_model
from tests.conftest import BUNDLED_MODEL
from tests.offline.conftest import quick_config


def tree_digest(folder) -> dict[str, str]:
    """relative path -> sha256 of every file under folder (and the folder's own siblings)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def test_a_non_empty_out_is_refused_without_force_and_left_alone(tmp_path, capsys, calib_files):
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "model.safetensors").write_bytes(b"precious")
    before = tree_digest(tmp_path)
    code, err = run_cli(capsys, "quantize", "--model", str(BUNDLED_MODEL), "--out", str(out),
                        "--calib", *map(str, calib_files), "--quiet")
    assert code == 2 and "not empty" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("args, fragment", [
    (["--device", "meta"], "--device"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "cuda"),
    (["--calib", "/nonexistent/calib.txt"], "does not exist"),
])
def test_flags_are_checked_before_any_work(tmp_path, capsys, calib_files, args, fragment):
    out = tmp_path / "out"
    argv = ["quantize", "--model", str(BUNDLED_MODEL), "--out", str(out), "--quiet"]
    if "--calib" not in args:
        argv += ["--calib", *map(str, calib_files)]
    code, err = run_cli(capsys, *argv, *args)
    assert code == 2 and fragment in err
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary


def test_out_inside_model_or_containing_it_is_refused(tmp_path, capsys, calib_files):
    for out in (BUNDLED_MODEL / "paged", BUNDLED_MODEL.parent):
        code, err = run_cli(capsys, "quantize", "--model", str(BUNDLED_MODEL), "--out", str(out), "--force",
                            "--calib", *map(str, calib_files), "--quiet")
        assert code == 2 and "outside --model" in err
    assert not (BUNDLED_MODEL / "paged").exists()


def test_an_interrupted_requantise_keeps_the_previous_artifact(paged_dir, tmp_path, calib_files):
    import shutil

    out = tmp_path / "artifact"
    shutil.copytree(paged_dir, out)
    before = tree_digest(tmp_path)

    def interrupt(message: str) -> None:
        if message.startswith("calibrating"):  # the same path as any later interrupt: out is untouched
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(out, force=True) as tmp:
            quantize_model(BUNDLED_MODEL, tmp, calib_files, quick_config(), interrupt)
    assert tree_digest(tmp_path) == before  # same files, no temporary left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]
    load_paged_model(out)


def test_force_replaces_only_once_the_new_artifact_is_complete(paged_dir, tmp_path):
    import shutil

    out = tmp_path / "artifact"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OSError):  # a writer that fails half-way (disk full) changes nothing
        with atomic_output_dir(out, force=True) as tmp:
            shutil.copyfile(paged_dir / "paged_model.json", tmp / "paged_model.json")
            raise OSError(28, "No space left on device")
    assert tree_digest(tmp_path) == {"artifact/old.txt": tree_digest(out)["old.txt"]}
    with atomic_output_dir(out, force=True) as tmp:
        shutil.copytree(paged_dir, tmp, dirs_exist_ok=True)
        assert (out / "old.txt").exists()  # the old artifact stands while the new one is written
    assert not (out / "old.txt").exists()
    assert load_paged_model(out).config.num_layers == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def test_a_second_writer_of_the_same_out_fails_at_once(tmp_path, capsys, calib_files):
    out = tmp_path / "artifact"
    with atomic_output_dir(out) as tmp:
        (tmp / "partial").write_text("first writer at work")
        code, err = run_cli(capsys, "quantize", "--model", str(BUNDLED_MODEL), "--out", str(out),
                            "--calib", *map(str, calib_files), "--quiet")
        assert code == 2 and "another process is writing it" in err
    assert (out / "partial").read_text() == "first writer at work"


@pytest.mark.parametrize("which", ["w", "h", "g"])
def test_quantiser_inputs_must_be_finite(which):
    import dataclasses

    from pagedweight.offline.apl_quantizer import KMEANS_ONLY

    w, h, g = torch.randn(2, 8, 32), torch.rand(2, 32), torch.rand(2, 8)
    {"w": w, "h": h, "g": g}[which].view(-1)[5] = float("nan")
    with pytest.raises(UserError, match="NaN or infinite"):
        quantize_layer(w, h, dataclasses.replace(KMEANS_ONLY, seed_iters=2, split_iters=1), "cpu", g)
