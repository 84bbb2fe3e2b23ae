"""Checks of a paged model's metadata (paged_model.json) against its own model config.

The metadata is untrusted input: a hand-edited or hostile file could name files outside
the directory, list blocks of a different model than its `model_config`, or carry NaN
sensitivities that every plan would then trust. Everything the loader and the planner
read from it is checked here, once, before any tensor is loaded:
- sensitivity tables: one finite, non-negative row of every bit-width per block;
- routing statistics: [layers][experts] finite, non-negative numbers
(these two whenever the metadata is read: the planner reads nothing else), and before
tensors are loaded:
- `files`: known file names only (each resolving inside the directory), each with an
  integer size and a sha256; the files the loader needs must be listed;
- `blocks`, `num_layers`, `num_experts`: exactly what `model_config` implies.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from pagedweight.common.errors import CheckpointError
from pagedweight.common.safe_paths import inside_dir
from pagedweight.format.blocks import BIT_WIDTHS
from pagedweight.format.model_config import ModelConfig

_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_files_section(path: Path, files, known: tuple[str, ...], required: tuple[str, ...]) -> None:
    """`files`: {name: {"bytes": int, "sha256": hex}} over `known` names, `required` present."""
    where = path / "paged_model.json"
    if not isinstance(files, dict):
        raise CheckpointError(f"{where}: 'files' must be an object of file records")
    for name, record in files.items():
        inside_dir(path, name)  # no ../, absolute paths or symlinks out, whatever the name
        if name not in known:
            raise CheckpointError(f"{where}: 'files' lists {name[:80]!r}, which is not a file of a "
                                  f"paged model ({', '.join(known)})")
        if (not isinstance(record, dict) or isinstance(record.get("bytes"), bool)
                or not isinstance(record.get("bytes"), int) or record["bytes"] < 0
                or not isinstance(record.get("sha256"), str) or not _SHA256.fullmatch(record["sha256"])):
            raise CheckpointError(f"{where}: file record of {name!r} must be "
                                  f"{{\"bytes\": size, \"sha256\": 64 hex digits}}")
    for name in required:
        if name not in files:
            raise CheckpointError(f"{where}: {name} is not listed in 'files', so its size and "
                                  f"hash cannot be checked")


def check_block_list(meta: dict, config: ModelConfig, expected_blocks: list[dict], where: Path) -> None:
    if meta.get("num_layers") != config.num_layers or meta.get("num_experts") != config.num_experts:
        raise CheckpointError(f"{where}: num_layers/num_experts ({meta.get('num_layers')!r}, "
                              f"{meta.get('num_experts')!r}) disagree with model_config "
                              f"({config.num_layers}, {config.num_experts})")
    if meta.get("blocks") != expected_blocks:
        raise CheckpointError(f"{where}: the block list disagrees with model_config (blocks, shapes "
                              f"or bytes are not those of this model)")


def check_sensitivity(meta: dict, table_name: str, block_keys: list[str], where: Path) -> None:
    """A table of S_i(b): every block, every bit-width, finite and >= 0."""
    table = meta.get(table_name)
    if table is None and table_name != "sensitivity":
        return  # optional tables (sensitivity_gn)
    if not isinstance(table, dict) or set(table) != set(block_keys):
        raise CheckpointError(f"{where}: {table_name!r} must have one row per expert block")
    widths = {str(b) for b in BIT_WIDTHS}
    for key, row in table.items():
        if not isinstance(row, dict) or set(row) != widths or not all(_non_negative(v) for v in row.values()):
            raise CheckpointError(f"{where}: {table_name}[{key!r}] must map each of "
                                  f"{sorted(widths)} to a finite number >= 0")


def check_sections(meta: dict, where: Path) -> None:
    """Each section has its type, and the top-k the planner reads is a count it can use."""
    for key, kind in (("model_config", dict), ("files", dict), ("blocks", list), ("sensitivity", dict),
                      ("routing", dict)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{where}: metadata section {key!r} must be a JSON {kind.__name__}")
    top_k = meta["model_config"].get("num_experts_per_tok", 2)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 4096:
        raise CheckpointError(f"{where}: model_config num_experts_per_tok must be an integer in 1..4096")


def block_keys(meta: dict, where: Path) -> list[str]:
    """The blocks' keys, once every record has an int layout the planner can read."""
    blocks = meta.get("blocks")
    widths = {str(b) for b in BIT_WIDTHS}
    for b in blocks if isinstance(blocks, list) else [None]:
        if (not isinstance(b, dict) or not isinstance(b.get("key"), str)
                or not all(_count(b.get(k)) for k in ("rows", "cols", "layer", "expert"))
                or not isinstance(b.get("bytes"), dict) or set(b["bytes"]) != widths
                or not all(_count(v) for v in b["bytes"].values())):
            raise CheckpointError(f"{where}: 'blocks' must be a list of block records (key, layer, expert, "
                                  f"rows, cols: integers; bytes: one integer per bit-width)")
    return [b["key"] for b in blocks]


def _count(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < 2**48


def check_routing(meta: dict, where: Path) -> None:
    """[num_layers][num_experts] token counts and routing mass, finite and >= 0."""
    routing, L, E = meta.get("routing"), meta.get("num_layers"), meta.get("num_experts")
    if not isinstance(routing, dict) or not _non_negative(routing.get("num_tokens")):
        raise CheckpointError(f"{where}: 'routing' must have a finite num_tokens >= 0")
    if isinstance(L, bool) or isinstance(E, bool) or not isinstance(L, int) or not isinstance(E, int):
        raise CheckpointError(f"{where}: num_layers and num_experts must be integers")
    for name in ("token_counts", "routing_mass"):
        grid = routing.get(name)
        if (not isinstance(grid, list) or len(grid) != L
                or not all(isinstance(row, list) and len(row) == E
                           and all(_non_negative(v) for v in row) for row in grid)):
            raise CheckpointError(f"{where}: routing {name!r} must be [{L} layers][{E} experts] "
                                  f"of finite numbers >= 0")


def _non_negative(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:
        return False
