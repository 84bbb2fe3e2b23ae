"""`pagedweight quantize` and `pagedweight eval ppl --model PAGED_DIR` as a user runs them.

The command runs in-process through `main(argv)` (the same code path as the console
script, minus a Python start per call): stdout, the one stderr line and the exit code.
"""

import json
import shutil
import subprocess

import pytest

from pagedweight.cli.main import main
from pagedweight.format.paged_model import APL_FILE, META_FILE, write_meta
from tests.cli.test_cli import assert_one_line_error
from tests.conftest import BUNDLED_MODEL


@pytest.fixture
def pagedweight(capsys):
    def run(*args: str) -> subprocess.CompletedProcess:
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)
    return run


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("And God said, Let there be light: and there was light. And God saw the light. " * 10)
    return path


@pytest.fixture
def broken_copy(paged_dir, tmp_path):
    copy = tmp_path / "paged"
    shutil.copytree(paged_dir, copy)
    return copy


@pytest.fixture
def eval_ppl(pagedweight, text_file):
    def run(model_dir, *extra):
        return pagedweight("eval", "ppl", "--model", str(model_dir), "--text", str(text_file),
                           "--seq-len", "64", "--max-tokens", "128", *extra)
    return run


@pytest.mark.slow
def test_quantize_writes_a_paged_model_that_eval_runs(tmp_path, calib_files, eval_ppl, pagedweight):
    out = tmp_path / "out"
    result = pagedweight("quantize", "--model", str(BUNDLED_MODEL), "--out", str(out), "--quiet",
                         "--calib", *map(str, calib_files), "--calib-tokens", "128", "--seq-len", "64", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["calibration"]["num_tokens"] == 2 * 128
    assert meta["calibration"]["text"]["name"] == "user"  # and each file's sha256 (test_calib_text.py)
    assert [f["name"] for f in meta["calibration"]["text"]["files"]] == [f.name for f in calib_files]
    plain = json.loads(eval_ppl(BUNDLED_MODEL).stdout)
    bf16 = json.loads(eval_ppl(out).stdout)
    assert bf16["ppl"] == pytest.approx(plain["ppl"], rel=1e-6)


def test_eval_paged_at_eight_bits_is_close_to_the_checkpoint(paged_dir, eval_ppl):
    plain = json.loads(eval_ppl(BUNDLED_MODEL).stdout)
    eight = json.loads(eval_ppl(paged_dir, "--bits", "8").stdout)
    # 2%: format 2's 8-bit values leave the out-of-cell weights at their cell's edge
    # (docs/apl_format.md; 1.0% on micro-mixtral, against ~0.1% with format 1's per-width LUTs)
    assert eight["bits"] == 8 and eight["ppl"] == pytest.approx(plain["ppl"], rel=0.02)


def test_bits_file_assigns_blocks_and_default(paged_dir, tmp_path, eval_ppl):
    bits = tmp_path / "bits.json"
    bits.write_text(json.dumps({"default": 8}))
    all8 = json.loads(eval_ppl(paged_dir, "--bits", "8").stdout)
    file8 = json.loads(eval_ppl(paged_dir, "--bits-file", str(bits)).stdout)
    assert file8["ppl"] == all8["ppl"]
    bits.write_text(json.dumps({"L0.E1.gate_up": 3, "L2.E7.down": 5}))
    mixed = eval_ppl(paged_dir, "--bits-file", str(bits), "--bits", "8")
    assert mixed.returncode == 0, mixed.stderr
    assert json.loads(mixed.stdout)["ppl"] != all8["ppl"]


@pytest.mark.parametrize("content, fragment", [
    ({"L0.E1.gate_up": 3}, "blocks have no bit-width"),
    ({"default": 4, "L9.E0.down": 3}, "does not exist"),
    ({"default": 4, "L0.E0.up": 3}, "not a block key"),
    ({"default": 9}, "3..8"),
])
def test_bad_bits_files_are_one_line_errors(paged_dir, tmp_path, content, fragment, eval_ppl):
    bits = tmp_path / "bits.json"
    bits.write_text(json.dumps(content))
    assert_one_line_error(eval_ppl(paged_dir, "--bits-file", str(bits)), fragment)


def test_bits_on_a_plain_checkpoint_is_an_error(eval_ppl):
    assert_one_line_error(eval_ppl(BUNDLED_MODEL, "--bits", "4"), "paged model")


def test_truncated_artifact(broken_copy, eval_ppl):
    file = broken_copy / APL_FILE
    file.write_bytes(file.read_bytes()[:-1000])
    assert_one_line_error(eval_ppl(broken_copy, "--bits", "4"), APL_FILE, "truncated")


def test_corrupted_artifact(broken_copy, eval_ppl):
    file = broken_copy / APL_FILE
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    assert_one_line_error(eval_ppl(broken_copy, "--bits", "4"), APL_FILE, "corrupt")


def test_unknown_format_version(broken_copy, eval_ppl):
    meta = json.loads((broken_copy / META_FILE).read_text())
    meta["format_version"] = 99
    write_meta(broken_copy, meta)
    assert_one_line_error(eval_ppl(broken_copy), "unknown paged model format version 99")


def test_corrupt_metadata(broken_copy, eval_ppl):
    (broken_copy / META_FILE).write_text('{"format": "pagedweight.paged_model", "form')
    assert_one_line_error(eval_ppl(broken_copy), META_FILE, "not valid JSON")


def test_quantize_bad_inputs(tmp_path, pagedweight):
    assert_one_line_error(pagedweight("quantize", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")),
                          "does not exist")
    assert_one_line_error(pagedweight("quantize", "--model", str(BUNDLED_MODEL), "--out", str(tmp_path / "o"),
                                      "--calib", str(tmp_path / "missing.txt")), "missing.txt")


def test_truncated_artifact_through_the_real_command(broken_copy, text_file):
    from tests.cli.test_cli import pagedweight as run_process

    file = broken_copy / APL_FILE
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    result = run_process("eval", "ppl", "--model", str(broken_copy), "--text", str(text_file))
    assert_one_line_error(result, "truncated")
