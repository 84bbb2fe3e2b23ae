"""Torch-free part of the paged-model directory format: file names and the metadata reader.

The planner reads only paged_model.json (block shapes and bytes, sensitivity tables,
calibration routing), so it gets the reader here without torch; paged_model.py
re-exports these beside the tensor files' loading and saving.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pagedweight.common.errors import CheckpointError
from pagedweight.common.json_files import read_json_object
from pagedweight.format.paged_model_checks import block_keys, check_routing, check_sections, check_sensitivity

FORMAT_NAME = "pagedweight.paged_model"
# 2: the bf16 copy of the routed experts is optional (`quantize --keep-bf16`); without it
# the unquantised reference is read from the source checkpoint recorded in `source.path`.
# 3: paged_model.json carries `meta_sha256`, the digest of every other field of it, so an
# edited model_config (top-k, say) or block table is refused instead of served. Versions
# 1 and 2 have no such digest: they are refused with a message to re-quantise.
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (3,)
UNSEALED_FORMAT_VERSIONS = (1, 2)
SEAL_KEY = "meta_sha256"
APL_FORMAT_VERSION = 2  # docs/apl_format.md (2: LUT_3 and LUT_4 stored, 5-8 bits derived from LUT_4)
META_FILE = "paged_model.json"
DENSE_FILE = "dense.safetensors"
APL_FILE = "experts_apl.safetensors"
BF16_FILE = "experts_bf16.safetensors"
HEADS_FILE = "residual_heads.safetensors"
HESSIAN_FILE = "hessians.safetensors"
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
KNOWN_FILES = (DENSE_FILE, APL_FILE, BF16_FILE, HEADS_FILE, HESSIAN_FILE, *COPIED_FILES)  # all `files` may list


def is_paged_model_dir(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path: Path) -> dict:
    """paged_model.json, checked as far as the planner reads it (paged_model_checks.py)."""
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a paged model directory (no {META_FILE})")
    meta = read_json_object(meta_path, "paged model metadata", CheckpointError)
    if meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{meta_path}: not a PagedWeight paged model "
                              f"(format {repr(meta.get('format'))[:60]})")
    version = meta.get("format_version")
    apl_version = meta.get("apl_format_version")
    if apl_version == 1:
        raise CheckpointError(
            f"{meta_path}: APL format version 1 (a LUT per row and width, up to 512 bytes a row at 8 bits) "
            f"is no longer read; this PagedWeight reads APL format {APL_FORMAT_VERSION} (LUT_3 and LUT_4, "
            f"wider widths derived): re-run `pagedweight quantize` on the checkpoint")
    if version in UNSEALED_FORMAT_VERSIONS and apl_version == APL_FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: paged model format version {version} has no checksum over its metadata "
            f"(model_config, blocks, tables), so edits to it cannot be detected; re-run "
            f"`pagedweight quantize` to write version {FORMAT_VERSION}")
    if version not in READABLE_FORMAT_VERSIONS or apl_version != APL_FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: unknown paged model format version {repr(version)[:20]} (APL "
            f"{repr(apl_version)[:20]}); this PagedWeight reads versions "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))} (APL {APL_FORMAT_VERSION}): "
            f"re-run `pagedweight quantize`")
    sealed = meta.get(SEAL_KEY)
    try:
        digest = meta_digest(meta)
    except ValueError:  # a number JSON cannot hold (1e999 parses as inf): nothing we wrote
        raise CheckpointError(f"{meta_path}: holds a non-finite number; re-run `pagedweight quantize`") from None
    if not isinstance(sealed, str) or sealed != digest:
        raise CheckpointError(f"{meta_path}: {'changed since it was written' if isinstance(sealed, str) else 'not sealed'}"
                              f": its {SEAL_KEY} does not match its contents (every field of it is checked; "
                              f"re-run `pagedweight quantize` rather than editing it)")
    for key in ("model_config", "files", "blocks", "sensitivity", "routing"):
        if key not in meta:
            raise CheckpointError(f"{meta_path}: metadata has no {key!r} section")
    # what the planner reads from here alone (it never loads tensors): finite, well-formed
    check_sections(meta, meta_path)
    keys = block_keys(meta, meta_path)
    for table in ("sensitivity", "sensitivity_gn"):
        check_sensitivity(meta, table, keys, meta_path)
    check_routing(meta, meta_path)
    return meta


def meta_digest(meta: dict) -> str:
    """sha256 of every field but the seal itself, over a canonical JSON form (sorted keys,
    no whitespace), so re-indenting the file keeps it valid and any edit of a value does not."""
    body = {k: v for k, v in meta.items() if k != SEAL_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
                          .encode("utf-8")).hexdigest()


def write_meta(path: Path, meta: dict) -> None:
    """paged_model.json sealed (SEAL_KEY) and replaced atomically (write, fsync, rename)."""
    meta = {**{k: v for k, v in meta.items() if k != SEAL_KEY}, SEAL_KEY: meta_digest(meta)}
    target = Path(path) / META_FILE
    tmp = Path(path) / (META_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(meta, indent=1))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, target)
