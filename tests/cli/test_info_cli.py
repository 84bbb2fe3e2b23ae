"""`pagedweight info` as a user runs it: text by default, JSON for scripts, one error line."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from pagedweight.cli.main import main
from tests.conftest import BUNDLED_MODEL


def info(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["info", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_by_default_json_with_the_flag_and_the_same_numbers(capsys):
    args = (str(BUNDLED_MODEL), "--memory-budget", "32MiB", "--context", "256", "--concurrency", "4")
    code, text, _ = info(capsys, *args)
    assert code == 0 and text.startswith("architecture   MixtralForCausalLM (checkpoint)")
    code, out, _ = info(capsys, *args, "--json")
    report = json.loads(out)
    assert code == 0 and report["budget"]["memory_budget"] == 32 << 20
    widest = report["budget"]["requests"]["widest_uniform_bits"]
    assert "4 x 256 tokens" in text and f"widest uniform width: {widest} bits" in text
    for bits, row in report["budget"]["uniform"].items():
        assert f"{bits} bits       experts" in text and f"KV {row['kv_tokens']} tokens" in text


def test_a_concurrency_the_memory_cannot_hold_is_reported_as_not_fitting(capsys):
    args = (str(BUNDLED_MODEL), "--memory-budget", "32MiB", "--context", "256", "--json")
    small = json.loads(info(capsys, *args, "--concurrency", "1")[1])["budget"]["requests"]
    assert small["fits"] and small["max_concurrency"] >= 1
    most = small["max_concurrency"]
    at_most = json.loads(info(capsys, *args, "--concurrency", str(most))[1])["budget"]["requests"]
    too_many = json.loads(info(capsys, *args, "--concurrency", str(most + 1))[1])["budget"]["requests"]
    assert at_most["fits"] and not too_many["fits"] and too_many["widest_uniform_bits"] is None
    code, text, _ = info(capsys, *args[:-1], "--concurrency", "1000")
    assert code == 0 and f"does not fit: at most {most} requests of 256 tokens" in text


def test_without_a_budget_only_the_model(capsys):
    code, out, _ = info(capsys, str(BUNDLED_MODEL), "--json")
    assert code == 0 and "budget" not in json.loads(out)


@pytest.mark.parametrize("args, fragment", [
    (("nope",), "does not exist"),
    ((str(BUNDLED_MODEL), "--memory-budget", "lots"), "--memory-budget"),
    ((str(BUNDLED_MODEL), "--memory-budget", "1GiB", "--context", "64"), "go together"),
    ((str(BUNDLED_MODEL), "--context", "64", "--concurrency", "2"), "need --memory-budget"),
    ((str(BUNDLED_MODEL), "--memory-budget", "1GiB", "--context", "0", "--concurrency", "2"), ">= 1"),
    ((str(BUNDLED_MODEL), "--memory-budget", "1GiB", "--context", str(10 ** 7), "--concurrency", "2"),
     "beyond the model's context"),
])
def test_bad_input_is_one_error_line_and_exit_2(capsys, args, fragment):
    code, out, err = info(capsys, *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("pagedweight info: error:") and fragment in err


@pytest.mark.parametrize("damage", ["truncated", "not json", "missing"])
def test_a_broken_checkpoint_is_one_error_line(capsys, tmp_path, damage):
    model = tmp_path / "m"
    shutil.copytree(BUNDLED_MODEL, model)
    weights = model / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(b"\x10\x00")
    elif damage == "not json":
        weights.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    else:
        weights.unlink()
    code, out, err = info(capsys, str(model))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "safetensors" in err


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cuda", "bfloat16")])
def test_the_default_dtype_is_the_workers_on_that_device(capsys, device, dtype):
    """A CPU worker runs float32 weights and KV: info must not report bf16 for it."""
    report = json.loads(info(capsys, str(BUNDLED_MODEL), "--device", device, "--json")[1])
    explicit = json.loads(info(capsys, str(BUNDLED_MODEL), "--device", device, "--dtype", dtype, "--json")[1])
    assert report == explicit and dtype in json.dumps(report)
    other = "bfloat16" if dtype == "float32" else "float32"
    assert report != json.loads(info(capsys, str(BUNDLED_MODEL), "--dtype", other, "--json")[1])
