"""One decoder layer at a time, read straight from a checkpoint's safetensors files.

The streaming quantiser never builds the whole model: it asks for the embedding, one
decoder layer (attention, router, dense experts, shared expert or Gemma-4's dense MLP) or the final norm and
head, each placed on the device in the compute dtype and dropped after use. The
checkpoint is untrusted input, so the constructor checks every tensor header against the
config (model/loader.py's checks, before anything is read), and every tensor read is
checked again for shape, floating dtype and finiteness (`CheckpointReader.get`; a decoder
layer's finiteness on the device, after the conversion to the compute dtype: on the host,
Qwen1.5-MoE-A2.7B's ~1 GB a layer, read twice a layer, cost more than the copy).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from pagedweight.common.errors import CheckpointError, UserError
from pagedweight.format.apl_format import MODULES
from pagedweight.format.model_config import ModelConfig
from pagedweight.model.experts import DenseExperts
from pagedweight.model.layers import RMSNorm, norm_for
from pagedweight.model.loader import (
    CheckpointReader, fused_layers, checkpoint_key, expected_shapes, load_experts,
)
from pagedweight.model.transformer import (
    MoECausalLM, decoder_layer_class, embed_scale_for, rope_tables, rotaries_for, scale_embeddings,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointLayers:
    """Modules of one checkpoint, built one at a time on `device` in `dtype`."""

    def __init__(self, model_dir: str | Path, device: str, dtype: str = "auto"):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: model directory does not exist")
        self.config = ModelConfig.from_dir(self.model_dir)
        self.reader = CheckpointReader(self.model_dir)
        with torch.device("meta"):
            skeleton = MoECausalLM(self.config)  # shapes and names only: allocates nothing
        self.param_shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
        self.reader.check_header(self.config, expected_shapes(
            self.config, self.param_shapes, fused_layers(self.reader, self.config)))
        self.device = torch.device(device)
        self.checkpoint_dtype = self.reader.get(self._key("embed_tokens.weight")).dtype
        self.dtype = self._compute_dtype(dtype)
        self.rotaries = rotaries_for(self.config)

    def _compute_dtype(self, name: str) -> torch.dtype:
        """auto: the checkpoint's dtype on an accelerator; fp32 on the CPU, where bf16
        matmuls are slow and fp32 is what the whole-model reference computed in."""
        if name == "auto":
            return self.checkpoint_dtype if self.device.type != "cpu" else torch.float32
        if name not in DTYPES:
            raise UserError(f"compute dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
        return DTYPES[name]

    def _key(self, name: str) -> str:
        return checkpoint_key(self.config, name)

    def _read(self, name: str, check_finite: bool = True) -> torch.Tensor:
        return self.reader.get(self._key(name), self.param_shapes[name], check_finite)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, T] (CPU) -> hidden states [B, T, H] on the CPU, in the compute dtype."""
        weight = self._read("embed_tokens.weight").to(self.dtype)
        return scale_embeddings(F.embedding(token_ids, weight), embed_scale_for(self.config))

    def decoder_layer(self, layer: int) -> torch.nn.Module:
        """Layer `layer` with its dense experts, on the device, frozen (no weight gradients)."""
        with torch.device("meta"):
            module = decoder_layer_class(self.config)(self.config, layer)
        module = module.to(self.dtype).to_empty(device=self.device)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name.startswith("moe.experts."):
                    continue  # per expert or fused in the checkpoint: load_experts
                param.copy_(self._read(f"layers.{layer}.{name}", check_finite=False))
            load_experts(self.reader, self.config, layer, module.moe.experts, self.dtype, check_finite=False)
        self._check_finite(module, layer)
        return module.eval().requires_grad_(False)

    def _check_finite(self, module: torch.nn.Module, layer: int) -> None:
        """Every parameter of the layer finite, checked where it now lives (one host read)."""
        params = list(module.named_parameters())
        finite = torch.stack([torch.isfinite(p).all() for _, p in params]).tolist()
        bad = [name for (name, _), ok in zip(params, finite) if not ok]
        if bad:
            raise CheckpointError(f"{self.model_dir}: layer {layer}'s {', '.join(bad)} hold NaN or infinite "
                                  f"values (in {str(self.dtype).removeprefix('torch.')})")

    def head(self) -> tuple[RMSNorm, torch.Tensor]:
        """The final norm (a module on the device) and the LM head weight [V, H]."""
        norm = norm_for(self.config, self.config.hidden_size)
        with torch.no_grad():
            norm.weight.copy_(self._read("norm.weight"))
        norm = norm.to(self.device, self.dtype).requires_grad_(False)
        return norm, self._read("lm_head.weight").to(self.device, self.dtype)

    def rope(self, batch: int, seq_len: int) -> dict:
        """Rotary tables for positions 0..seq_len-1 of every sequence, as MoECausalLM makes them."""
        positions = torch.arange(seq_len, device=self.device).expand(batch, seq_len)
        return rope_tables(self.rotaries, positions, self.dtype)

    def dense_state(self) -> dict[str, torch.Tensor]:
        """Every non-routed-expert parameter (our names), as stored (CPU)."""
        state, seen = {}, set()
        for name in self.param_shapes:
            if ".experts." in name:
                continue
            tensor = self._read(name)
            # tied embeddings (Gemma-4) read lm_head from embed_tokens' bytes: the artifact
            # stores each parameter on its own, as the whole-model quantiser's state_dict does
            if tensor.data_ptr() in seen:
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            state[name] = tensor
        return state

    def expert_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """module -> [E, rows, cols] of one layer's routed experts (CPU, as stored)."""
        c = self.config
        experts = DenseExperts(c.num_experts, c.hidden_size, c.expert_intermediate_size).to(self.checkpoint_dtype)
        with torch.no_grad():
            load_experts(self.reader, c, layer, experts, self.checkpoint_dtype)
        return {m: getattr(experts, m).detach() for m in MODULES}
