"""The unquantised reference experts of a paged model, read from its source checkpoint.

Since format version 2 a paged model directory stores no bf16 copy of the routed experts
by default: the checkpoint it was quantised from has them, and a second copy doubled the
artifact (a full-depth Qwen1.5-MoE-shaped artifact did not fit a 64 GB disk beside its
checkpoint). Whoever needs the reference (`eval` / `generate` without bits, the quality
benchmark) calls `attach_source_experts`, which reads them from `source.path` as recorded
by `quantize`, cast to bf16 exactly as the stored copy was.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedweight.common.errors import CheckpointError
from pagedweight.format.apl_format import MODULES
from pagedweight.format.paged_model import PagedModel
from pagedweight.format.model_config import ModelConfig
from pagedweight.model.loader import load_model


def attach_source_experts(paged: PagedModel, source_dir: str | Path | None = None) -> PagedModel:
    """Fill `paged.bf16_experts` from the source checkpoint (no-op if already present)."""
    if paged.bf16_experts is not None:
        return paged
    source = Path(source_dir or paged.meta.get("source", {}).get("path", ""))
    if not source_dir and not paged.meta.get("source", {}).get("path"):
        raise CheckpointError(f"{paged.path}: stores no bf16 experts and records no source checkpoint")
    if not (source / "config.json").is_file():
        raise CheckpointError(
            f"{paged.path}: stores no bf16 experts (quantised without --keep-bf16) and its source "
            f"checkpoint {source} is not there; the unquantised reference needs one of them")
    if ModelConfig.from_dir(source) != paged.config:
        raise CheckpointError(f"{source}: its config differs from the paged model's {paged.path}")
    model = load_model(source, dtype=torch.float32)
    paged.bf16_experts = {(l, m): getattr(b.experts, m).detach().to(torch.bfloat16)
                          for l, b in enumerate(model.moe_blocks) for m in MODULES}
    return paged
