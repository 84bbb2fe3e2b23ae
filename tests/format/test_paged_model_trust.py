"""A paged model directory is untrusted: every file it names stays inside it, every file
read is listed and verified, and the metadata agrees with its own model_config."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedweight.common.errors import CheckpointError
from pagedweight.format.paged_meta import SEAL_KEY, meta_digest
from pagedweight.format.paged_model import APL_FILE, DENSE_FILE, META_FILE, load_paged_model, write_meta


@pytest.fixture
def paged_copy(paged_micro_dir, tmp_path):
    target = tmp_path / "paged"
    shutil.copytree(paged_micro_dir, target)
    return target


def edit_meta(path, edit):
    meta = json.loads((path / META_FILE).read_text())
    edit(meta)
    write_meta(path, meta)


def rewrite_tensors(path, name, edit):
    """Change a tensor file and record its new size and hash, as a careful attacker would."""
    tensors = load_file(path / name)
    edit(tensors)
    save_file(tensors, path / name)
    data = (path / name).read_bytes()
    edit_meta(path, lambda m: m["files"].__setitem__(name, {"bytes": len(data),
                                                            "sha256": hashlib.sha256(data).hexdigest()}))


@pytest.mark.parametrize("name", ["../dense.safetensors", "/etc/passwd", "sub/../../x"])
def test_manifest_names_must_stay_inside(paged_copy, name):
    edit_meta(paged_copy, lambda m: m["files"].__setitem__(name, {"bytes": 1, "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match="outside the model directory") as err:
        load_paged_model(paged_copy)
    assert "bytes" not in str(err.value).split(":", 2)[-1]  # no size of a file elsewhere


def test_a_file_read_but_not_listed_is_refused(paged_copy):
    edit_meta(paged_copy, lambda m: m["files"].pop(DENSE_FILE))
    with pytest.raises(CheckpointError, match="dense.safetensors is not listed"):
        load_paged_model(paged_copy)


def test_an_unknown_listed_file_is_refused(paged_copy):
    edit_meta(paged_copy, lambda m: m["files"].__setitem__("run.sh", {"bytes": 1, "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match="'run.sh', which is not a file of a paged model"):
        load_paged_model(paged_copy)


def test_a_listed_file_that_is_a_symlink_is_refused(paged_copy, tmp_path):
    os.replace(paged_copy / DENSE_FILE, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", paged_copy / DENSE_FILE)
    with pytest.raises(CheckpointError, match="outside the model directory"):
        load_paged_model(paged_copy)


def test_model_config_that_disagrees_with_the_block_list(paged_copy):
    edit_meta(paged_copy, lambda m: m["model_config"].__setitem__("num_hidden_layers", 2))
    with pytest.raises(CheckpointError, match="disagree"):
        load_paged_model(paged_copy)


@pytest.mark.parametrize("literal, match", [("-1.0", "finite number >= 0"), ("1e999", "non-finite number"),
                                            ("null", "finite number >= 0"), ('"3"', "finite number >= 0"),
                                            ("NaN", "not valid JSON")])
def test_sensitivity_must_be_finite_and_non_negative(paged_copy, literal, match):
    def mark(meta):
        meta["sensitivity"][next(iter(meta["sensitivity"]))]["4"] = 12345.678
    edit_meta(paged_copy, mark)
    text = (paged_copy / META_FILE).read_text()
    edited = text.replace("12345.678", literal)  # 1e999 parses as inf
    try:  # sealed again, as a writer with this bug would: the value itself must be refused
        meta = json.loads(edited)
        meta[SEAL_KEY] = meta_digest(meta)
        edited = json.dumps(meta)
    except ValueError:  # NaN (not JSON) and inf (not sealable): refused as they are
        pass
    (paged_copy / META_FILE).write_text(edited)
    with pytest.raises(CheckpointError, match=match):
        load_paged_model(paged_copy)


@pytest.mark.parametrize("edit", [
    lambda m: m["model_config"].__setitem__("num_experts_per_tok", 1),  # top-k, served silently before
    lambda m: m["blocks"][0].__setitem__("rows", m["blocks"][0]["rows"]),  # a no-op: still sealed
    lambda m: m.__setitem__("architecture", "Other"),
    lambda m: m["files"].pop(next(iter(m["files"]))),
])
def test_every_field_of_the_metadata_is_inside_the_checksum(paged_copy, edit):
    meta = json.loads((paged_copy / META_FILE).read_text())
    before = json.dumps(meta, sort_keys=True)
    edit(meta)
    (paged_copy / META_FILE).write_text(json.dumps(meta, indent=2))  # re-indented: same fields
    if json.dumps(meta, sort_keys=True) == before:
        load_paged_model(paged_copy)  # formatting alone changes nothing
        return
    with pytest.raises(CheckpointError, match="changed since it was written"):
        load_paged_model(paged_copy)


def test_an_unsealed_or_older_artifact_is_refused_clearly(paged_copy):
    meta = json.loads((paged_copy / META_FILE).read_text())
    del meta[SEAL_KEY]
    (paged_copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not sealed"):
        load_paged_model(paged_copy)
    meta["format_version"] = 2
    (paged_copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="version 2 has no checksum.*re-run `pagedweight quantize`"):
        load_paged_model(paged_copy)


def test_nan_in_a_lut_is_refused_even_with_a_matching_hash(paged_copy):
    def poison(tensors):
        tensors["layers.1.down.lut4"][0, 0, 0] = float("nan")
    rewrite_tensors(paged_copy, APL_FILE, poison)
    with pytest.raises(CheckpointError, match="lut4.*NaN or infinite"):
        load_paged_model(paged_copy)


def test_a_tensor_the_config_does_not_account_for_is_refused(paged_copy):
    rewrite_tensors(paged_copy, APL_FILE, lambda t: t.__setitem__("layers.9.down.planes", torch.zeros(1, dtype=torch.uint8)))
    with pytest.raises(CheckpointError, match="layers.9.down.planes"):
        load_paged_model(paged_copy)


def test_an_extra_dense_tensor_is_refused_when_the_model_is_built(paged_copy):
    from pagedweight.model.dequantized_experts import build_paged_lm

    rewrite_tensors(paged_copy, DENSE_FILE, lambda t: t.__setitem__("layers.7.attn.q.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="layers.7.attn.q.weight"):
        build_paged_lm(load_paged_model(paged_copy, with_bf16=False))


def test_copied_files_are_listed_and_verified(paged_copy):
    meta = json.loads((paged_copy / META_FILE).read_text())
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(meta["files"])
    (paged_copy / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_paged_model(paged_copy)


def test_an_artifact_of_apl_format_1_is_refused_naming_the_version(paged_copy):
    # format 1 stored a LUT per row and width (512 bytes a row at 8 bits); it must not be half-read
    edit_meta(paged_copy, lambda m: m.__setitem__("apl_format_version", 1))
    with pytest.raises(CheckpointError, match="APL format version 1.*re-run `pagedweight quantize`"):
        load_paged_model(paged_copy)
