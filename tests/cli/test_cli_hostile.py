"""The command line against a careless operator: numbers that are not finite or not in
range, and outputs or work directories pointed at what the command did not create. One
`error:` line, exit code 2, and nothing on disk changed."""

from __future__ import annotations

import shutil

import pytest

from pagedweight.cli.main import main
from pagedweight.cli.gateway_cmd import main as gateway_main
from tests.conftest import BUNDLED_MODEL
from tests.fuzz.harness import tree_digest


def exit_code(call, argv) -> int:
    try:
        return call(argv)
    except SystemExit as exit_:  # argparse's own refusals
        return exit_.code


@pytest.mark.parametrize("flag", ["--session-ttl", "--stats-interval", "--header-timeout", "--body-timeout",
                                  "--template-timeout", "--worker-timeout", "--rate-limit"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_gateway_durations_and_rates_must_be_finite_and_positive(capsys, flag, value):
    code = exit_code(gateway_main, ["--model", str(BUNDLED_MODEL), "--workers", "127.0.0.1:1", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "error:" in err.strip().splitlines()[-1] and (flag in err or "finite" in err), err


@pytest.mark.parametrize("flag, value", [("--planner-deadline", "nan"), ("--planner-deadline", "-1"),
                                         ("--planner-deadline", "inf"), ("--shutdown-timeout", "nan"),
                                         ("--shutdown-timeout", "-5"), ("--shutdown-timeout", "1e300"),
                                         ("--port", "70000"), ("--port", "-1")])
def test_worker_numbers_are_refused_before_anything_starts(capsys, paged_micro_dir, flag, value):
    code = exit_code(main, ["worker", "--model", str(paged_micro_dir), flag, value])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "error:" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("value", ["nan", "-1", "0"])
def test_planner_registration_ttl_must_be_positive(capsys, value):
    assert exit_code(main, ["planner", "--registration-ttl", value]) == 2
    assert "--registration-ttl" in capsys.readouterr().err


def test_a_work_dir_that_contains_the_model_is_refused_and_the_model_kept(capsys, tmp_path):
    parent = tmp_path / "models"
    model = parent / "micro"
    shutil.copytree(BUNDLED_MODEL, model)
    before = tree_digest(parent)
    for work in (parent, model, model / "sub", tmp_path):
        code = main(["quantize", "--model", str(model), "--out", str(tmp_path / "out"), "--work-dir", str(work),
                     "--restart", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and "--work-dir" in err and "overlaps" in err, err
    assert tree_digest(parent) == before


def test_a_work_dir_holding_other_files_is_never_emptied(capsys, tmp_path):
    from pagedweight.offline.work_dir import WorkDir

    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    (work / "layer0.safetensors").write_bytes(b"old run")  # a name a run writes: removed by --restart
    with pytest.raises(Exception, match="holds files no quantize run wrote"):
        with WorkDir(work, {"run": 1}, restart=True):
            pass
    assert (work / "notes.txt").read_text() == "mine" and not (work / "layer0.safetensors").exists()


def test_plan_scales_out_refuses_an_existing_file_before_any_work(capsys, paged_micro_dir, tmp_path):
    out = tmp_path / "model-copy"
    shutil.copytree(paged_micro_dir, out)
    target = out / "paged_model.json"
    before = target.read_bytes()
    code = main(["plan-scales", "--model", str(out), "--out", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and "--force" in err and target.read_bytes() == before
