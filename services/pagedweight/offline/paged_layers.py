"""One layer of a written paged model at a time, in fp32 on a device: what the streamed
loss-scale phase (stream_scales.py) runs instead of the whole dequantised model.

It builds exactly what `build_paged_lm(load_paged_model(dir, with_bf16=False), fp32)`
builds, one piece at a time: the bf16 dense weights cast to fp32, the routed experts as
`DequantizedExperts` over the layer's planes and LUTs (at 8 bits until told otherwise).
Tensors are read one at a time (safetensors' memory map), so host and device hold one
layer. The directory is input like any other: each file's size and sha256 are checked
against paged_model.json first, and every tensor read for shape, dtype and finiteness.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pagedweight.common.errors import CheckpointError
from pagedweight.format.apl_format import LUT_WIDTHS, MODULES, lut_entries
from pagedweight.format.model_config import ModelConfig
from pagedweight.format.paged_meta import META_FILE, read_meta
from pagedweight.format.paged_model import (
    APL_FILE, DENSE_FILE, LayerPlanes, block_shape, check_file, check_meta_against_config,
)
from pagedweight.model.dequantized_experts import DequantizedExperts
from pagedweight.model.layers import RMSNorm, norm_for
from pagedweight.model.transformer import (
    MoECausalLM, decoder_layer_class, embed_scale_for, rope_tables, rotaries_for, scale_embeddings,
)

DTYPE = torch.float32  # what add_planner_scales builds the whole model in


class PagedLayers:
    def __init__(self, paged_dir: str | Path, device: str | torch.device):
        self.path = Path(paged_dir)
        meta = read_meta(self.path)
        self.config = ModelConfig.from_dict(meta["model_config"], source=str(self.path / META_FILE))
        check_meta_against_config(self.path, meta, self.config, with_bf16=False)
        for name in (DENSE_FILE, APL_FILE):
            check_file(self.path / name, meta["files"][name])
        with torch.device("meta"):
            skeleton = MoECausalLM(self.config)  # names and shapes only
        self.shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters() if ".experts." not in n}
        self.device = torch.device(device)
        self.rotaries = rotaries_for(self.config)

    def _read(self, file: str, key: str, shape: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
        path = self.path / file
        with safe_open(str(path), framework="pt") as f:
            if key not in f.keys():
                raise CheckpointError(f"{path}: tensor {key!r} is missing")
            tensor = f.get_tensor(key)
        if tuple(tensor.shape) != tuple(shape) or (dtype is not None and tensor.dtype != dtype) \
                or (dtype is None and not tensor.dtype.is_floating_point):
            raise CheckpointError(f"{path}: tensor {key!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                                  f"expected {dtype or 'floating point'} {tuple(shape)}")
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: tensor {key!r} holds NaN or infinite values")
        return tensor

    def _dense(self, name: str) -> torch.Tensor:
        return self._read(DENSE_FILE, name, self.shapes[name])

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, T] (CPU) -> hidden states [B, T, H] fp32 on the CPU."""
        weight = self._dense("embed_tokens.weight").to(DTYPE)
        return scale_embeddings(F.embedding(token_ids, weight), embed_scale_for(self.config))

    def decoder_layer(self, layer: int) -> nn.Module:
        """Layer `layer` on the device, its routed experts dequantised from the planes at 8 bits."""
        c = self.config
        with torch.device("meta"):
            module = decoder_layer_class(c)(c, layer)
        module.moe.experts = nn.Identity()  # never allocate the dense experts
        module = module.to_empty(device=self.device)
        with torch.no_grad():
            for name, param in module.named_parameters():
                param.copy_(self._dense(f"layers.{layer}.{name}").to(param.dtype))
        apl = {}
        for m in MODULES:
            rows, cols = block_shape(c, m)
            prefix = f"layers.{layer}.{m}"
            planes = self._read(APL_FILE, f"{prefix}.planes", (c.num_experts, 8, rows, cols // 8), torch.uint8)
            luts = {b: self._read(APL_FILE, f"{prefix}.lut{b}", (c.num_experts, rows, lut_entries(b)), torch.float16)
                    for b in LUT_WIDTHS}
            apl[m] = LayerPlanes(planes, luts)
        experts = DequantizedExperts(layer, c.num_experts, apl, None, DTYPE, self.device, c.expert_activation)
        experts.set_bits({b: 8 for b in experts.get_bits()})
        module.moe.experts = experts
        return module.to(dtype=DTYPE).eval().requires_grad_(False)

    def head(self) -> tuple[RMSNorm, torch.Tensor]:
        """The final norm (a module on the device) and the LM head weight [V, H], fp32."""
        norm = norm_for(self.config, self.config.hidden_size)
        with torch.no_grad():
            norm.weight.copy_(self._dense("norm.weight"))
        return norm.to(self.device, DTYPE).eval(), self._dense("lm_head.weight").to(self.device, DTYPE)

    def rope(self, seq_len: int) -> dict:
        """Rotary tables for one sequence at positions 0..seq_len-1, as MoECausalLM makes them."""
        positions = torch.arange(seq_len, device=self.device).expand(1, seq_len)
        return rope_tables(self.rotaries, positions, DTYPE)
