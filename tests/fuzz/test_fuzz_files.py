"""Fuzz the files a model directory or a user hands us: config.json, paged_model.json
and bits files. Each mutated file goes through the real command (harness.py says which
outcomes are allowed); bits files are also checked for a correct result directly."""

from __future__ import annotations

import json
import os
import shutil
import uuid

from hypothesis import event, given
from hypothesis import strategies as st

from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import BIT_WIDTHS, BlockId
from pagedweight.format.bit_assignment import read_bits_file
from pagedweight.format.model_config import ModelConfig
from pagedweight.format.paged_meta import SEAL_KEY, meta_digest
from pagedweight.format.paged_model import META_FILE, all_block_ids
from tests.conftest import BUNDLED_MODEL
from tests.fuzz.harness import assert_clean_outcome, fuzz_settings, run_cli, tree_digest
from tests.fuzz.strategies import json_file_bytes, json_values, mutated_json

BASE_CONFIG = json.loads((BUNDLED_MODEL / "config.json").read_text())
CONFIG = ModelConfig.from_dict(BASE_CONFIG)
EVAL = ["--seq-len", "8", "--max-tokens", "8"]


def linked_copy(source, target, replace: dict[str, bytes]):
    """A copy of a model directory: files hard-linked (cheap; the digests catch any write),
    the files in `replace` written fresh."""
    target.mkdir()
    for path in source.iterdir():
        if path.name not in replace:
            os.link(path, target / path.name)
    for name, data in replace.items():
        (target / name).write_bytes(data)
    return target


@fuzz_settings(ci_examples=12)
@given(data=json_file_bytes(mutated_json(BASE_CONFIG)))
def test_fuzz_config_json(tmp_path_factory, fuzz_text, data):
    model = linked_copy(BUNDLED_MODEL, tmp_path_factory.mktemp("cfg") / "m", {"config.json": data})
    before = tree_digest(model, fuzz_text)
    result = run_cli(["eval", "ppl", "--model", str(model), "--text", str(fuzz_text / "valid.txt"), *EVAL])
    assert_clean_outcome(*result)
    assert tree_digest(model, fuzz_text) == before


@fuzz_settings(ci_examples=12)
@given(data=st.data())
def test_fuzz_paged_manifest(tmp_path_factory, paged_micro_dir, fuzz_text, data):
    base = json.loads((paged_micro_dir / META_FILE).read_text())
    meta = data.draw(json_file_bytes(mutated_json(base)), label="paged_model.json")
    model = linked_copy(paged_micro_dir, tmp_path_factory.mktemp("meta") / "m", {META_FILE: meta})
    out = tmp_path_factory.mktemp("out") / "plan.json"
    before = tree_digest(model, fuzz_text, paged_micro_dir)
    command = data.draw(st.sampled_from([
        ["plan", "--model", str(model), "--avg-bits", "4", "--out", str(out)],
        ["eval", "ppl", "--model", str(model), "--bits", "4", "--text", str(fuzz_text / "valid.txt"), *EVAL],
    ]), label="command")
    assert_clean_outcome(*run_cli(command))
    assert tree_digest(model, fuzz_text, paged_micro_dir) == before


@fuzz_settings(ci_examples=20)
@given(data=st.data())
def test_fuzz_sealed_paged_manifest(tmp_path_factory, paged_micro_dir, fuzz_text, data):
    """paged_model.json mutated and sealed again (as a buggy writer would): the checksum
    no longer protects it, so the field checks behind it must refuse it or serve it right."""
    base = json.loads((paged_micro_dir / META_FILE).read_text())
    meta = data.draw(mutated_json(base), label="paged_model.json")
    try:
        meta = {**meta, SEAL_KEY: meta_digest(meta)}
    except ValueError:  # a non-finite number: written unsealed, refused as such
        event("unsealable")
    text = json.dumps(meta).encode("utf-8", "surrogatepass")
    model = linked_copy(paged_micro_dir, tmp_path_factory.mktemp("sealed") / "m", {META_FILE: text})
    out = tmp_path_factory.mktemp("out") / "plan.json"
    before = tree_digest(model, fuzz_text, paged_micro_dir)
    command = data.draw(st.sampled_from([
        ["plan", "--model", str(model), "--avg-bits", "4", "--out", str(out)],
        ["info", str(model), "--memory-budget", "64MiB", "--context", "64", "--concurrency", "2"],
    ]), label="command")
    assert_clean_outcome(*run_cli(command))
    assert tree_digest(model, fuzz_text, paged_micro_dir) == before


block_keys = st.one_of(st.sampled_from([b.key() for b in all_block_ids(CONFIG)]),
                       st.builds(lambda b, s: s.join(b.key().split(".")) if s else b.key(),
                                 st.sampled_from(all_block_ids(CONFIG)), st.sampled_from(["", ".", "..", ". "])),
                       st.sampled_from(["default", "L00.E0.down", "L+1.E0.down", "L 2.E1.gate_up",
                                        "L\u0661.E0.down", "L4.E0.down", "L0.E8.down", "L0.E0.up"]),
                       st.text(max_size=14))
bits_values = st.one_of(st.integers(0, 10), st.sampled_from([3.0, 4.5, "4", None, True, [4], 2**70]), json_values)
bits_docs = st.one_of(st.dictionaries(block_keys, bits_values, max_size=8), json_values)


@fuzz_settings(ci_examples=150)
@given(data=json_file_bytes(bits_docs), cli_bits=st.one_of(st.none(), st.integers(3, 8)))
def test_fuzz_bits_file_result_is_correct_or_an_error(tmp_path_factory, data, cli_bits):
    path = tmp_path_factory.getbasetemp() / f"bits-{uuid.uuid4().hex}.json"
    path.write_bytes(data)
    try:
        bits = read_bits_file(path, CONFIG, default=cli_bits)
    except UserError as err:
        event("refused")
        assert "\n" not in str(err) and len(str(err)) < 1000
        return
    finally:
        path.unlink()
    event("accepted")
    raw = json.loads(data)  # accepted, so it parsed as an object
    default = raw.get("default", cli_bits)
    assert set(bits) == set(all_block_ids(CONFIG))
    for block, width in bits.items():
        assert width in BIT_WIDTHS
        assert width == raw.get(block.key(), default)  # named blocks as named, the rest the default
    assert all(key == "default" or BlockId.parse(key).key() == key for key in raw)  # canonical keys only


@fuzz_settings(ci_examples=6)
@given(data=json_file_bytes(bits_docs))
def test_fuzz_bits_file_through_eval(tmp_path_factory, paged_micro_dir, fuzz_text, data):
    folder = tmp_path_factory.mktemp("bits")
    (folder / "bits.json").write_bytes(data)
    before = tree_digest(folder, fuzz_text, paged_micro_dir)
    result = run_cli(["eval", "ppl", "--model", str(paged_micro_dir), "--bits-file", str(folder / "bits.json"),
                      "--bits", "4", "--text", str(fuzz_text / "valid.txt"), *EVAL])
    assert_clean_outcome(*result)
    assert tree_digest(folder, fuzz_text, paged_micro_dir) == before
    shutil.rmtree(folder)
