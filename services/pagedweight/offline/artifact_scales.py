"""The planner's loss scales, measured as the last phase of `pagedweight quantize` and
recorded in the artifact, so `plan`, `eval` and the runtime rank blocks in loss units by
default (loss_scale.py says why raw S ranks them wrongly across (layer, module) groups).

One KL measurement per group (group_scales.measure_group_kls) calibrates every
sensitivity table the artifact has (the KL does not depend on the table, only the
denominator does), so `sensitivity` and `sensitivity_gn` both get their scales.
Recorded in paged_model.json as
    "planner_scales": {"sensitivity": {scales, kl_at_3_bits, num_tokens, method},
                       "sensitivity_gn": {...}, "calib_files": [...], "tokens_per_file": N}
The metadata file is rewritten whole through a temporary file and a rename.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedweight.common.errors import UserError
from pagedweight.format.paged_meta import read_meta, write_meta
from pagedweight.format.paged_model import load_paged_model
from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.offline.group_scales import measure_group_kls, scales_from_kls
from pagedweight.planner.artifact import SCALES_KEY, SENSITIVITY_TABLES, load_planner_inputs

DEFAULT_TOKENS_PER_FILE = 256  # calibration tokens per file for the KL measurement


def scale_windows(model_dir: str | Path, calib_files: list[Path], tokens: int) -> list[list[int]]:
    tokenizer = Tokenizer(str(model_dir))
    windows = [tokenizer.encode(Path(f).read_text(encoding="utf-8"))[:tokens] for f in calib_files]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise UserError("the calibration files have no text to measure the planner's loss scales on")
    return windows


def add_planner_scales(paged_dir: str | Path, calib_files: list[Path],
                       tokens: int = DEFAULT_TOKENS_PER_FILE, device: str = "cpu") -> dict:
    """Measure the group KLs on calibration text with the whole model in fp32 on `device`
    and record every table's scales (the whole-model quantiser's phase; `quantize` streams
    the same measurement, stream_scales.py, and records it with `record_planner_scales`)."""
    paged_dir = Path(paged_dir)
    base = load_planner_inputs(paged_dir, with_heads=False, sensitivity="sensitivity").table
    model = build_paged_lm(load_paged_model(paged_dir, with_bf16=False), dtype=torch.float32,
                           device=device)

    def set_bits(bits):
        set_model_bits(model, {b: int(v) for b, v in zip(base.block_ids, bits)})

    kls, num_tokens = measure_group_kls(model, base, scale_windows(paged_dir, calib_files, tokens), set_bits)
    return record_planner_scales(paged_dir, calib_files, tokens, kls, num_tokens)


def record_planner_scales(paged_dir: str | Path, calib_files: list[Path], tokens: int,
                          kls: dict[str, float], num_tokens: int) -> dict:
    """Every sensitivity table's scales from the group KLs, into paged_model.json."""
    paged_dir = Path(paged_dir)
    meta = read_meta(paged_dir)
    tables = [name for name in SENSITIVITY_TABLES if meta.get(name) is not None]
    record = {"calib_files": [str(f) for f in calib_files], "tokens_per_file": tokens}
    for name in tables:
        table = load_planner_inputs(paged_dir, False, name).table
        scales = scales_from_kls(table, kls, num_tokens, name)
        record[name] = {**scales.to_json(), "sensitivity": name}
    meta[SCALES_KEY] = record
    write_meta(paged_dir, meta)
    return record
