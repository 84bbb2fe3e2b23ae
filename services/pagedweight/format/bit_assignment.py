"""Bit assignments from the user: `--bits B` and `--bits-file FILE` (docs/paged_model.md).

A bits file is a JSON object mapping block keys to widths, optionally with a "default"
for every block not named:
    {"default": 4, "L0.E3.gate_up": 8, "L5.E1.down": 3}
Every block must end up with a width (3..8); unknown keys and bad widths are errors. Keys
are accepted only in their canonical spelling (`BlockId.parse`): 'L00.E3.gate_up' is an
error, not a second name for block L0.E3.gate_up.
"""

from __future__ import annotations

from pathlib import Path

from pagedweight.common.errors import UserError
from pagedweight.common.json_files import read_json_object
from pagedweight.format.model_config import ModelConfig
from pagedweight.format.blocks import MAX_BITS, MIN_BITS, BlockId
from pagedweight.format.paged_model import all_block_ids


def check_width(bits, where: str) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise UserError(f"{where}: bit-width must be an integer in {MIN_BITS}..{MAX_BITS}, got {repr(bits)[:40]}")
    return bits


def read_bits_file(path: str | Path, config: ModelConfig, default: int | None = None) -> dict[BlockId, int]:
    """# block_id -> bits for every expert block; `default` (from --bits) fills unnamed blocks."""
    path = Path(path)
    raw = read_json_object(path, "bits file")
    if "default" in raw:
        default = check_width(raw.pop("default"), f"{path}: key 'default'")
    valid = set(all_block_ids(config))
    named = {}
    for key, bits in raw.items():
        try:
            block_id = BlockId.parse(key)
        except ValueError as err:
            raise UserError(f"{path}: {err}") from None
        if block_id not in valid:
            raise UserError(f"{path}: block {key!r} does not exist in this model "
                            f"({config.num_layers} layers, {config.num_experts} experts)")
        named[block_id] = check_width(bits, f"{path}: key {key!r}")
    missing = [b for b in all_block_ids(config) if b not in named]
    if missing and default is None:
        raise UserError(f"{path}: {len(missing)} blocks have no bit-width (first: {missing[0].key()}); "
                        f"name them, add \"default\", or pass --bits B")
    return {b: named.get(b, default) for b in all_block_ids(config)}
