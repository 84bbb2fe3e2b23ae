"""Bad input on the command line is one `error:` line and exit 2, never a traceback.
In-process through `main(argv)`: the console script's code path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.cli.main import main
from tests.conftest import BUNDLED_MODEL


@pytest.fixture
def run(capsys):
    def call(*args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
        out, err = capsys.readouterr()
        return code, out, err
    return call


def assert_error(result, *fragments):
    code, out, err = result
    assert code == 2 and out == "", err
    errors = [line for line in err.strip().splitlines() if ": error: " in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == errors[0]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture
def scales_file(tmp_path):
    def write(text: str):
        path = tmp_path / "scales.json"
        path.write_text(text)
        return str(path)
    return write


@pytest.mark.parametrize("flags, fragment", [
    (["--policy", "bogus"], "--policy 'bogus'"),
    (["--memory-budget", "20TiB"], "exceeds"),
    (["--memory-budget", "9" * 40], "--memory-budget"),
    (["--memory-budget", "9" * 5000], "--memory-budget"),
    (["--memory-budget", "nan%"], "--memory-budget"),
    (["--memory-budget", "12.5MiB"], "--memory-budget"),
    (["--memory-budget", str(int(12.5 * 2**20))], "need at least"),
    (["--seed", str(2**64)], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--device", "meta"], "--device"),
    (["--device", "foo"], "--device"),
    (["--threads", "0"], "--threads"),
])
def test_bench_engine_bad_flags(run, paged_micro_dir, flags, fragment):
    args = {"--memory-budget": "20MiB", "--requests": "1", "--max-tokens": "1", "--prompt-len": "4"}
    for flag, value in zip(flags[::2], flags[1::2]):
        args[flag] = value
    assert_error(run("bench", "engine", "--model", str(paged_micro_dir), *[x for kv in args.items() for x in kv]),
                 fragment)


@pytest.mark.parametrize("text, fragment", [('{"scales": {"L0.gate_up": NaN}}', "NaN"),
                                            ('{"scales": {"L0.gate_up": -1.0}}', ">= 0"),
                                            ('{"scales": [1]}', "not a planner scales file")])
def test_bad_planner_scales(run, paged_micro_dir, scales_file, tmp_path, text, fragment):
    assert_error(run("plan", "--model", str(paged_micro_dir), "--avg-bits", "4", "--out", str(tmp_path / "p.json"),
                     "--scales", scales_file(text)), fragment)


@pytest.mark.parametrize("flags, fragment", [
    (["--prompt", "caf\udcc3"], "not UTF-8"),
    (["--seed", str(2**64)], "seed"),
    (["--temperature", "nan"], "temperature"),
    (["--device", "meta"], "--device"),
    (["--device", "cpu:3"], "--device"),
])
def test_generate_bad_flags(run, flags, fragment):
    args = {"--prompt": "And God said", "--max-tokens": "2"}
    for flag, value in zip(flags[::2], flags[1::2]):
        args[flag] = value
    assert_error(run("generate", "--model", str(BUNDLED_MODEL), *[x for kv in args.items() for x in kv]), fragment)


@pytest.mark.parametrize("flags, fragment", [
    (["--lut-ridge", "inf"], "--lut-ridge"),  # passed a >= 0 check, then NaN LUTs after the whole run
    (["--lut-ridge", "nan"], "--lut-ridge"),
    (["--lut-ridge", "-1"], "--lut-ridge"),
    (["--feedback-damp", "inf"], "--feedback-damp"),
    (["--feedback-damp", "0"], "--feedback-damp"),
    (["--lut-refit-bits", "9"], "--lut-refit-bits"),
])
def test_quantize_bad_quantiser_flags_fail_before_any_work(run, tmp_path, flags, fragment):
    out = tmp_path / "paged"
    assert_error(run("quantize", "--model", str(BUNDLED_MODEL), "--out", str(out), "--calib-tokens", "256", *flags),
                 fragment)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written, no work dir left


def test_tiny_temperature_and_top_p_are_greedy_not_nan(run):
    base = ("generate", "--model", str(BUNDLED_MODEL), "--prompt", "And God said", "--max-tokens", "6")
    greedy = run(*base)
    assert greedy[0] == 0
    for flags in (["--temperature", "1e-300", "--seed", "1"], ["--temperature", "1", "--top-p", "1e-300", "--seed", "1"]):
        assert run(*base, *flags) == greedy  # one token is left: the most likely one


def test_eval_of_a_model_that_overflows_is_an_error_not_nan(run, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model)
    tensors = load_file(model / "model.safetensors")
    tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], 3e38)  # finite in bf16
    save_file(tensors, model / "model.safetensors")
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 4)
    assert_error(run("eval", "ppl", "--model", str(model), "--text", str(text), "--seq-len", "16"),
                 "not a finite number")


def test_a_config_that_is_not_utf8_json(run, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model)
    (model / "config.json").write_bytes(b"\xff\xfe\x00{")
    assert_error(run("generate", "--model", str(model), "--prompt", "x"), "not UTF-8")
    (model / "config.json").write_text(json.dumps([1, 2]))
    assert_error(run("generate", "--model", str(model), "--prompt", "x"), "expected a JSON object")


def test_a_plan_prompt_longer_than_the_context_is_an_error(run, paged_micro_dir, tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("In the beginning God created the heaven and the earth. " * 600)  # > 2048 tokens
    assert_error(run("plan", "--model", str(paged_micro_dir), "--avg-bits", "4", "--out", str(tmp_path / "p.json"),
                     "--prompt-file", str(prompt), "--prompt-tokens", str(10**20)), "context of 2048")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("data, fragment", [(b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                                            (b"\xff\xfe", "not UTF-8"), (b'{"a": NaN}', "NaN")])
def test_a_hostile_tokenizer_config(run, tmp_path, data, fragment):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model)
    (model / "tokenizer_config.json").write_bytes(data)
    assert_error(run("generate", "--model", str(model), "--prompt", "x", "--max-tokens", "1"), fragment)


def test_bare_command_prints_the_usage_and_version_prints_the_version(run):
    from importlib import metadata

    code, out, err = run()
    assert code == 2 and out == "" and err.startswith("usage: pagedweight") and "serve" in err
    code, out, _ = run("--version")
    assert code == 0 and out.strip() == f"pagedweight {metadata.version('pagedweight')}"


def test_serve_help_shows_every_default(run):
    code, out, _ = run("serve", "--help")
    assert code == 0
    text = " ".join(out.split())
    for default in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 256MiB)", "(default: cpu)",
                    "(default: 50051)", "50052 with one worker", "(default: 30.0)", "(default: 600.0)"):
        assert default in text, default
