"""The one place a model is built on the meta device and then given real storage.

Building on `meta` allocates nothing, so a model is never held twice (random init, then the
checkpoint); `to_empty` places the parameters on the target device uninitialised and `fill`
writes each one. Routed experts may be left out: the runtime and the dequantising reference
install their own experts operator over the APL blocks, so the dense expert tensors must
never reach the device.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight.format.paged_model import check_dense_state
from pagedweight.model.transformer import MoECausalLM


def materialize(config: ModelConfig, fill: Callable[[str, torch.Tensor], None], dtype: torch.dtype,
                device: str | torch.device = "cpu", with_dense_experts: bool = True,
                check: Callable[[dict[str, tuple[int, ...]]], None] | None = None) -> MoECausalLM:
    """`fill(name, param)` copies a parameter's values in (under no_grad); the model is then cast
    to `dtype` and set to eval. Without dense experts, each MoE block's experts operator is an
    `nn.Identity` placeholder for the caller to replace. `check(shapes)` (parameter name ->
    shape) runs before anything is allocated: the source's tensors must match them, so a
    config asking for more than its files hold fails here, not after allocating it."""
    with torch.device("meta"):
        model = MoECausalLM(config)
    if not with_dense_experts:
        for block in model.moe_blocks:
            block.experts = nn.Identity()
    if check is not None:
        check({name: tuple(p.shape) for name, p in model.named_parameters()})
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill(name, param)
    return model.to(dtype=dtype).eval()


def materialize_dense(paged, dtype: torch.dtype, device: str | torch.device = "cpu") -> MoECausalLM:
    """A paged model's non-expert weights (`paged.dense_state`) in a model without routed experts."""

    def fill(name: str, param: torch.Tensor) -> None:
        param.copy_(paged.dense_state[name].to(param.dtype))

    return materialize(paged.config, fill, dtype, device, with_dense_experts=False,
                       check=lambda shapes: check_dense_state(paged, shapes))
