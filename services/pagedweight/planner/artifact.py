"""Adapter: a paged model directory -> the planner's inputs.

The planner needs only the artifact's metadata (paged_model.json: blocks with shapes
and bytes, sensitivity tables, calibration routing) and its residual heads; it never
loads planes. Bytes are recomputed from the shapes through apl_format.block_bytes and
checked against the metadata, so a plan's byte count is the format's, not a copy's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedweight.common.errors import CheckpointError
from pagedweight.format.blocks import BIT_WIDTHS, BlockId
from pagedweight.format.paged_meta import HEADS_FILE, META_FILE, read_meta
from pagedweight.planner.loss_scale import GroupScales
from pagedweight.planner.residual_predictor import ResidualPredictor
from pagedweight.planner.tables import BlockTable


@dataclass
class PagedPlannerInputs:
    table: BlockTable
    top_k: int  # experts per token (for routing statistics)
    heads: ResidualPredictor | None  # the artifact's prompt-residual heads, or None
    head_block_keys: list[str]  # block order of the heads' outputs
    meta_path: Path
    # the loss scales `quantize` measured for this table (loss_scale.py), None in artifacts
    # made before quantize measured them: the planner then ranks by raw S
    scales: GroupScales | None = None


SENSITIVITY_TABLES = ("sensitivity", "sensitivity_gn")  # output-space S (default), Gauss-Newton S


def load_planner_inputs(model_dir: str | Path, with_heads: bool = True,
                        sensitivity: str = "sensitivity") -> PagedPlannerInputs:
    """`sensitivity`: which of the artifact's tables is S (SENSITIVITY_TABLES)."""
    path = Path(model_dir)
    meta = read_meta(path)  # raises CheckpointError for a missing/unknown/corrupt directory
    table = table_from_meta(meta, path / META_FILE, sensitivity)
    heads = load_heads(path, meta) if with_heads else None
    top_k = int(meta["model_config"].get("num_experts_per_tok", 2))
    keys = [b["key"] for b in meta["blocks"]]
    return PagedPlannerInputs(table, top_k, heads, keys, path / META_FILE,
                              artifact_scales(meta, path / META_FILE, sensitivity))


SCALES_KEY = "planner_scales"  # written by offline/artifact_scales.py at the end of quantize


def artifact_scales(meta: dict, where: Path, sensitivity: str) -> GroupScales | None:
    """The artifact's loss scales for one sensitivity table, or None if it has none."""
    try:
        entry = (meta.get(SCALES_KEY) or {}).get(sensitivity)
        return None if entry is None else GroupScales.from_json(entry, f"{where}: {SCALES_KEY}")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:
        raise CheckpointError(f"{where}: malformed {SCALES_KEY}.{sensitivity} ({err!r})") from None


def choose_scales(stored: GroupScales | None, scales_arg: str | None, sensitivity: str):
    """`--scales`: None -> the artifact's (`stored`, the default), "raw" -> none, else a
    scales file. Returns (GroupScales or None, a label for reports)."""
    if scales_arg is None:
        return stored, ("artifact" if stored is not None else "raw (the artifact has no scales)")
    if scales_arg == "raw":
        return None, "raw"
    scales = GroupScales.read(scales_arg)
    if scales.sensitivity != sensitivity:
        from pagedweight.common.errors import UserError

        raise UserError(f"{scales_arg}: scales were measured for the {scales.sensitivity!r} table, "
                        f"not --sensitivity {sensitivity}")
    return scales, scales_arg


def table_from_meta(meta: dict, where: Path, sensitivity_key: str = "sensitivity") -> BlockTable:
    if sensitivity_key not in SENSITIVITY_TABLES:
        raise ValueError(f"sensitivity table must be one of {SENSITIVITY_TABLES}, got {sensitivity_key!r}")
    if meta.get(sensitivity_key) is None:
        raise CheckpointError(f"{where}: the artifact has no {sensitivity_key!r} table "
                              f"(re-run `pagedweight quantize` to add it)")
    try:
        blocks = meta["blocks"]
        block_ids = [BlockId.parse(b["key"]) for b in blocks]
        shapes = [(int(b["rows"]), int(b["cols"])) for b in blocks]
        sensitivity = np.array([[float(meta[sensitivity_key][b["key"]][str(w)]) for w in BIT_WIDTHS]
                                for b in blocks], dtype=np.float64)
        num_layers, num_experts = int(meta["num_layers"]), int(meta["num_experts"])
        routing = meta["routing"]
        num_tokens = max(float(routing["num_tokens"]), 1.0)
        mass = np.array(routing["routing_mass"], dtype=np.float64) / num_tokens
        share = np.array(routing["token_counts"], dtype=np.float64) / num_tokens
    except (KeyError, ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: metadata lacks what the planner needs ({err!r})") from None
    try:
        table = BlockTable.from_shapes(block_ids, shapes, sensitivity, num_layers, num_experts, mass, share)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    for i, block in enumerate(blocks):
        stored = [int(block["bytes"][str(w)]) for w in BIT_WIDTHS]
        if stored != table.nbytes[i].tolist():
            raise CheckpointError(f"{where}: block {block['key']} bytes {stored} disagree with the "
                                  f"APL format's {table.nbytes[i].tolist()}")
    return table


def load_heads(path: Path, meta: dict) -> ResidualPredictor | None:
    if HEADS_FILE not in meta.get("files", {}):
        return None
    try:
        return ResidualPredictor.load(path / HEADS_FILE)
    except Exception as err:  # noqa: BLE001 - any unreadable heads file is one clear line
        raise CheckpointError(f"{path / HEADS_FILE}: unreadable residual heads ({err})") from None
