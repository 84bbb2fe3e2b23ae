"""The `pagedweight` command as a user runs it: stdout, stderr and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import BUNDLED_MODEL, REPO_ROOT


def pagedweight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedweight.cli.main", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""


def test_generate_prints_only_the_completion():
    from pagedweight.engine.generate import generate
    from pagedweight.engine.sampler import SamplingParams
    from pagedweight.model import load_model
    from pagedweight.frontend.tokenizer import Tokenizer

    result = pagedweight("generate", "--model", str(BUNDLED_MODEL), "--prompt", "And God said",
                         "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer(BUNDLED_MODEL)
    expected = generate(load_model(BUNDLED_MODEL, dtype=__import__("torch").float32),
                        tokenizer.encode("And God said"), SamplingParams(max_tokens=12),
                        tokenizer.eos_token_ids)
    assert result.stdout == tokenizer.decode(expected.token_ids) + "\n"


@pytest.mark.slow  # generates with the whole CLI in a process: `make test`, not the inner loop
def test_generate_stop_string_cuts_the_printed_text():
    full = pagedweight("generate", "--model", str(BUNDLED_MODEL), "--prompt", "And God said",
                       "--max-tokens", "16")
    assert full.returncode == 0, full.stderr
    text = full.stdout[:-1]
    stop = text[6:9]
    cut = pagedweight("generate", "--model", str(BUNDLED_MODEL), "--prompt", "And God said",
                      "--max-tokens", "16", "--stop", "zzzz", "--stop", stop)
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout == text[: text.find(stop)] + "\n"


@pytest.mark.slow  # generates with the whole CLI in a process: `make test`, not the inner loop
def test_sampled_generation_is_reproducible_with_a_seed():
    args = ("generate", "--model", str(BUNDLED_MODEL), "--prompt", "The", "--max-tokens", "16",
            "--temperature", "1.0", "--top-p", "0.9", "--seed", "7")
    first, second = pagedweight(*args), pagedweight(*args)
    assert first.returncode == 0 and first.stdout == second.stdout


def test_eval_ppl_prints_one_json_object(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("In the beginning God created the heaven and the earth. " * 40)
    result = pagedweight("eval", "ppl", "--model", str(BUNDLED_MODEL), "--text", str(text),
                         "--seq-len", "64", "--max-tokens", "200")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tokens"] == 200 and report["windows"] == 4
    assert 1.0 < report["ppl"] < 50.0  # repeated text is easy for a trained model


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("generate", "--model", "/no/such/dir", "--prompt", "x"), ("/no/such/dir",)),
        (("eval", "ppl", "--model", str(BUNDLED_MODEL), "--text", "/no/such.txt"), ("/no/such.txt",)),
        (("generate", "--model", str(BUNDLED_MODEL), "--prompt", "x", "--max-tokens", "5000"),
         ("context of 2048",)),
        (("generate", "--model", str(BUNDLED_MODEL), "--prompt", "x", "--top-p", "0"), ("top_p",)),
    ],
)
def test_bad_input_is_one_error_line_with_exit_code_2(args, fragments):
    assert_one_line_error(pagedweight(*args), *fragments)


def test_prompt_longer_than_context():
    long_prompt = "word " * 2100
    assert_one_line_error(
        pagedweight("generate", "--model", str(BUNDLED_MODEL), "--prompt", long_prompt,
                    "--max-tokens", "1"),
        "context of 2048",
    )



def test_the_services_that_need_no_torch_start_without_it():
    # a command line that names planner, gateway or serve builds that parser alone: none imports torch
    probe = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from pagedweight.cli.main import build_parser
for argv in (["planner"], ["gateway", "--model", "m", "--workers", "127.0.0.1:1"], ["serve", "--model", "m"]):
    assert build_parser(argv[0]).parse_args(argv).command == argv[0]
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
