"""The dequantising reference experts operator: APL blocks, each at its own width, as dense weights.

`DequantizedExperts` has the call of `DenseExperts` (`experts(x, topk_ids, topk_weights)`), so
the MoE block never knows the storage. This is the dense torch reference path: a block
at b bits is dequantised (`apl_format.dequantize`: planes 0..b-1 and LUT_b) into a dense
matrix, cached per block at its current width only, and run through `moe_forward`. A width of
`None` means the original bf16 weights kept in the artifact (the unquantised reference).

Widths change at run time through `set_bits({block_id: bits})`, on one layer's operator
or, for the whole model, through `set_model_bits(model, ...)`. A change takes effect at
the next forward call. Serving does not use it: the runtime runs `weights.arena_experts.
ArenaExperts` over the memory arena (fused kernel on CUDA, this same dequantisation elsewhere);
this operator is for offline evaluation (perplexity and damage of an assignment, planning
scales) and `generate --bits`, where no arena or page table exists.

    paged = load_paged_model(dir)
    model = build_paged_lm(paged, dtype=torch.float32)        # all blocks at bf16
    set_model_bits(model, uniform_bits(paged.config, 4))     # every block at 4 bits
    set_model_bits(model, {BlockId(0, 3, "down"): 8})       # one block back to 8 bits
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight_kernels.moe_reference import check_activation, gated, moe_forward
from pagedweight.model.materialize import materialize_dense
from pagedweight.model.transformer import MoECausalLM
from pagedweight.format.apl_format import MODULES, BlockId, check_bits, expand_lut
from pagedweight.format.paged_model import LayerPlanes, PagedModel, all_block_ids

Bits = int | None  # None: the original bf16 weights

# bit i of every byte value, [256, 8]: unpacks a plane byte into its 8 columns (LSB first)
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.uint8)


def dequantize_block(planes: torch.Tensor, lut: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Same result as `apl_format.dequantize` (tested equal), ~40x faster on CPU: bytes are
    unpacked by table lookup and codes built in int16 instead of int64 shifts per bit. `dtype`:
    fp16 or bf16, the dtype the weights are computed in (the kernels' values)."""
    check_bits(bits)
    _, rows, packed = planes.shape
    table = _BYTE_BITS.to(planes.device)
    plane_bits = table[planes[:bits].long()].view(bits, rows, packed * 8)
    codes = plane_bits[0].to(torch.int16)
    for p in range(1, bits):
        codes = (codes << 1) | plane_bits[p]
    return torch.gather(expand_lut(lut, bits, dtype), 1, codes.long())


def weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype APL values are derived in for a model running in `dtype` (bf16 or fp16
    as is; fp32, a CPU reference, takes fp16's values)."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


class DequantizedExperts(nn.Module):
    """All routed experts of one layer, stored as APL blocks (plus the bf16 originals)."""

    def __init__(self, layer: int, num_experts: int, apl: dict[str, LayerPlanes],
                 bf16: dict[str, torch.Tensor] | None, dtype: torch.dtype, device: torch.device,
                 activation: str = "silu"):
        super().__init__()
        check_activation(activation)
        self.layer, self.num_experts, self.activation = layer, num_experts, activation
        self.dtype, self.device = dtype, torch.device(device)
        # Plain attributes, not buffers: `model.to(dtype)` must not cast planes or LUTs.
        self.apl = {m: LayerPlanes(lp.planes.to(self.device), {b: t.to(self.device) for b, t in lp.luts.items()})
                    for m, lp in apl.items()}
        self.bf16 = bf16  # module -> bf16 [E, rows, cols] on the CPU, or None
        self.bits: dict[tuple[int, str], Bits] = {(e, m): None for e in range(num_experts) for m in MODULES}
        self._cache: dict[tuple[int, str], tuple[Bits, torch.Tensor]] = {}  # (expert, module) -> (bits, W)

    def set_bits(self, assignment: dict[BlockId, Bits]) -> None:
        """# block_id -> bits (3..8, or None for bf16); blocks of other layers are an error."""
        for block_id, bits in assignment.items():
            if block_id.layer != self.layer or (block_id.expert, block_id.module) not in self.bits:
                raise ValueError(f"block {block_id.key()} is not an expert block of layer {self.layer}")
            if bits is None and self.bf16 is None:
                raise ValueError(f"block {block_id.key()}: bf16 experts were not loaded")
            if bits is not None:
                check_bits(bits)
        for block_id, bits in assignment.items():
            self.bits[(block_id.expert, block_id.module)] = bits

    def get_bits(self) -> dict[BlockId, Bits]:
        """# block_id -> bits of this layer."""
        return {BlockId(self.layer, e, m): b for (e, m), b in self.bits.items()}

    def clear_cache(self) -> None:
        self._cache.clear()

    def weight(self, expert: int, module: str) -> torch.Tensor:
        """The dense [rows, cols] matrix of one block at its current width."""
        bits = self.bits[(expert, module)]
        cached = self._cache.get((expert, module))
        if cached is None or cached[0] != bits:
            if bits is None:
                w = self.bf16[module][expert]
            else:
                lp = self.apl[module]
                w = dequantize_block(lp.planes[expert], lp.lut(bits)[expert], bits, weight_dtype(self.dtype))
            cached = (bits, w.to(device=self.device, dtype=self.dtype))
            self._cache[(expert, module)] = cached
        return cached[1]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.weight(e, "gate_up")).chunk(2, dim=-1)
        return F.linear(gated(gate, up, self.activation), self.weight(e, "down"))

    def forward(self, x, topk_ids, topk_weights):
        return moe_forward(x, topk_ids, topk_weights, self.expert, self.num_experts)


def build_paged_lm(paged: PagedModel, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> MoECausalLM:
    """An `MoECausalLM` whose MoE layers run `DequantizedExperts` (every block starts at bf16
    if the artifact's bf16 experts were loaded, else at 8 bits)."""
    config = paged.config
    model = materialize_dense(paged, dtype, device)
    for layer, block in enumerate(model.moe_blocks):
        apl = {m: paged.apl[(layer, m)] for m in MODULES}
        bf16 = {m: paged.bf16_experts[(layer, m)] for m in MODULES} if paged.bf16_experts else None
        block.experts = DequantizedExperts(layer, config.num_experts, apl, bf16, dtype, torch.device(device),
                                           config.expert_activation)
    if paged.bf16_experts is None:
        set_model_bits(model, uniform_bits(config, 8))
    return model


def paged_experts_of(model: MoECausalLM) -> list[DequantizedExperts]:
    experts = [block.experts for block in model.moe_blocks]
    if not all(isinstance(e, DequantizedExperts) for e in experts):
        raise ValueError("the model does not run paged experts (build it with build_paged_lm)")
    return experts


def set_model_bits(model: MoECausalLM, assignment: dict[BlockId, Bits]) -> None:
    """# block_id -> bits; blocks not named keep their width. Checked before anything changes."""
    layers = paged_experts_of(model)
    by_layer: dict[int, dict[BlockId, Bits]] = {}
    for block_id, bits in assignment.items():
        if not 0 <= block_id.layer < len(layers):
            raise ValueError(f"block {block_id.key()}: the model has {len(layers)} layers")
        by_layer.setdefault(block_id.layer, {})[block_id] = bits
    for layer, part in by_layer.items():  # validate every layer first, then apply
        experts = layers[layer]
        saved = dict(experts.bits)
        experts.set_bits(part)
        experts.bits = saved
    for layer, part in by_layer.items():
        layers[layer].set_bits(part)


def get_model_bits(model: MoECausalLM) -> dict[BlockId, Bits]:
    """# block_id -> bits of every expert block."""
    bits: dict[BlockId, Bits] = {}
    for experts in paged_experts_of(model):
        bits.update(experts.get_bits())
    return bits


def uniform_bits(config: ModelConfig, bits: Bits) -> dict[BlockId, Bits]:
    """# block_id -> bits, the same width for every block."""
    return {block_id: bits for block_id in all_block_ids(config)}
