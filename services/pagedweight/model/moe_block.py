"""The sparse MoE block: router, experts operator, optional gated shared expert."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedweight.format.model_config import ModelConfig
from pagedweight.model.experts import DenseExperts, ExpertsOp
from pagedweight.model.layers import GatedMLP
from pagedweight_kernels import decode_ops

# Called after routing with (layer_idx, x [T, H], topk_ids [T, k], topk_weights [T, k]);
# the worker feeds routing statistics from it, calibration records expert inputs.
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts: ExpertsOp = DenseExperts(
            config.num_experts, config.hidden_size, config.expert_intermediate_size, config.expert_activation
        )
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                          config.expert_activation)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.observer: RoutingObserver | None = None
        self._inputs: tuple | None = None  # fuse_inputs: (weight, split sizes), not a parameter
        # A CUDA stream the shared expert runs on while the router and the routed experts run
        # on the current one (MoECausalLM.overlap_shared_experts; None: one after the other).
        self.shared_stream: torch.cuda.Stream | None = None

    def fuse_inputs(self) -> None:
        """Serve the shared expert's gate and up projections, the router and the shared
        expert's gate from one product of the normalised input (4 products -> 1 per
        layer), as Attention.fuse_qkv does for q, k, v: the parameters become views of
        the one [2 I_shared + E + 1 (+ zero rows to a multiple of 8), H] weight, gate/up rows
        first (the product's front, aligned, is what `decode_ops.gated_rows` reads)."""
        if self.shared_expert is None or self._inputs is not None:
            return
        se = self.shared_expert
        mods = (se.gate_proj, se.up_proj, self.gate, self.shared_expert_gate)
        if any(m.bias is not None for m in mods):
            return
        rows = sum(m.weight.shape[0] for m in mods)
        pad = -rows % 8  # zero rows: the product's rows stay 16-byte aligned for any token count
        with torch.no_grad():
            weight = torch.cat([m.weight for m in mods] + [mods[0].weight.new_zeros(pad, mods[0].weight.shape[1])])
        start = 0
        for m in mods:
            rows = m.weight.shape[0]
            m.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
            start += rows
        self._inputs = (weight, tuple(m.weight.shape[0] for m in mods) + (pad,))

    @property
    def shared_inputs_fused(self) -> bool:
        """True once fuse_inputs made one product of the router's and the shared expert's
        inputs (what _forward_parts_overlapped splits)."""
        return self._inputs is not None

    def route(self, x: torch.Tensor):
        """x [T, H] -> topk_ids [T, k], topk_weights [T, k] (softmax in fp32, then top-k)."""
        return self._route_logits(self.gate(x), x.dtype)

    def _route_logits(self, logits: torch.Tensor, dtype: torch.dtype):
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights.to(dtype)

    def forward_parts(self, x: torch.Tensor) -> tuple:
        """The CUDA decode form of `forward` for x [T, H]: (routed,) or (routed, shared,
        gate logit [T, 1]), whose sum routed + sigmoid(gate) * shared the next
        `decode_ops.add_rms_norm` adds into the residual (the value `forward` returns,
        rounded where it rounds). Routing in one kernel (decode_ops.route_topk) where it
        takes the router's size; with fuse_inputs, one product feeds the router and the
        shared expert, and act(gate) * up is one kernel."""
        if self._inputs is not None and self.shared_stream is not None:
            return self._forward_parts_overlapped(x)
        shared_gu = gate_logit = None
        if self._inputs is not None:
            weight, (gate_rows, up_rows, num_experts, one, pad) = self._inputs
            shared_gu, logits, gate_logit, _ = F.linear(x, weight).split(
                (gate_rows + up_rows, num_experts, one, pad), dim=-1)
        else:
            logits = self.gate(x)
        routed = self.experts(x, *self._topk(x, logits))
        if self.shared_expert is None:
            return (routed,)
        se = self.shared_expert
        if shared_gu is None:
            return routed, se(x), self.shared_expert_gate(x)
        return routed, se.down_proj(decode_ops.gated_rows(shared_gu, se.activation)), gate_logit

    def _topk(self, x: torch.Tensor, logits: torch.Tensor):
        """Routing from the router's logits (one kernel where it takes the router's size),
        handed to the observer."""
        if decode_ops.route_supported(logits.shape[-1], self.top_k):
            topk_ids, topk_weights = decode_ops.route_topk(logits, self.top_k, self.norm_topk_prob, x.dtype)
        else:
            topk_ids, topk_weights = self._route_logits(logits, x.dtype)
        if self.observer is not None:
            self.observer(self.layer_idx, x, topk_ids, topk_weights)
        return topk_ids, topk_weights

    def _forward_parts_overlapped(self, x: torch.Tensor) -> tuple:
        """forward_parts with the shared expert on `shared_stream`, concurrent with the
        router, routing and the routed experts on the current stream (at a few
        tokens the routed kernel is bound by dependent latency, not bytes, and leaves the
        HBM idle that the shared expert's bandwidth-bound products can use). The fused input
        product is split at its rows: the shared gate/up rows on the side stream, the router
        and shared-gate rows (64 rows at Qwen1.5-MoE) on this one. A fork and a join of
        streams, so a CUDA graph capture records the two branches and replays them
        concurrently. Memory: x is produced on this stream before the fork and the outputs
        are consumed after the join, so the caching allocator reuses none of them early."""
        weight, (gate_rows, up_rows, num_experts, one, pad) = self._inputs
        se, main, side = self.shared_expert, torch.cuda.current_stream(x.device), self.shared_stream
        shared_rows = gate_rows + up_rows
        # The fork first: the shared gate/up product then runs beside the router's rows,
        # route_topk and the routed experts, the small latency-bound kernels included. On the
        # H200 (docs/real_shape.md, "the shared expert beside the routed experts") this order
        # gained 6-8% at batch 1; forking after the router's rows as much in bf16 and less at
        # 4 bits; forking after routing under 1% (the shared products then overlap only the
        # routed experts). Kernels on this stream may queue behind the shared product's CTAs
        # (the router's rows measured 13.9 us against 5.2 forked after them): still the best.
        side.wait_stream(main)
        with torch.cuda.stream(side):
            shared = se.down_proj(decode_ops.gated_rows(F.linear(x, weight[:shared_rows]), se.activation))
        logits, gate_logit, _ = F.linear(x, weight[shared_rows:]).split((num_experts, one, pad), dim=-1)
        routed = self.experts(x, *self._topk(x, logits))
        main.wait_stream(side)
        return routed, shared, gate_logit

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.route(x)
        if self.observer is not None:
            self.observer(self.layer_idx, x, topk_ids, topk_weights)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
