"""Torch-free part of the paged-model directory format: file names and the metadata reader.

The planner reads only paged_model.json (block shapes and bytes, sensitivity tables,
calibration routing), so it gets the reader here without torch; paged_model.py
re-exports these beside the tensor files' loading and saving.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedweight.common.errors import CheckpointError

FORMAT_NAME = "pagedweight.paged_model"
FORMAT_VERSION = 1
APL_FORMAT_VERSION = 1  # docs/apl_format.md
META_FILE = "paged_model.json"
DENSE_FILE = "dense.safetensors"
APL_FILE = "experts_apl.safetensors"
BF16_FILE = "experts_bf16.safetensors"
HEADS_FILE = "residual_heads.safetensors"
HESSIAN_FILE = "hessians.safetensors"
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def is_paged_model_dir(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a paged model directory (no {META_FILE})")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_path}: corrupt metadata, not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{meta_path}: not a PagedWeight paged model (format {meta.get('format')!r})"
                              if isinstance(meta, dict) else f"{meta_path}: not a JSON object")
    version = meta.get("format_version")
    if version != FORMAT_VERSION or meta.get("apl_format_version") != APL_FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: unknown paged model format version {version!r} (APL "
            f"{meta.get('apl_format_version')!r}); this PagedWeight reads version {FORMAT_VERSION} "
            f"(APL {APL_FORMAT_VERSION}): re-run `pagedweight quantize`")
    for key in ("model_config", "files", "blocks", "sensitivity", "routing"):
        if key not in meta:
            raise CheckpointError(f"{meta_path}: metadata has no {key!r} section")
    return meta
