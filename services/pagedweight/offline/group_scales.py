"""Measure the planner's loss scales: one KL measurement per (layer, module) group.

For every group, lower its blocks to 3 bits (everything else at 8) and measure the mean
KL divergence from the all-8-bit model's next-token distribution; the scale is that KL
over the group's routing-weighted sensitivity drop (planner/loss_scale.py explains why
S needs these scales). This runs the model, so it lives offline; the torch-free planner
reads and applies the resulting `GroupScales`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedweight.planner.loss_scale import GroupScales, group_key
from pagedweight.planner.tables import BlockTable

MIN_SCALE_FRACTION = 0.02  # of the median group scale


@torch.inference_mode()
def measure_group_scales(model, table: BlockTable, windows: list[list[int]], set_bits) -> GroupScales:
    """`set_bits(bits [N])` puts the model at a plan; windows are token lists (one forward each)."""
    bits = np.full(table.num_blocks, 8)
    set_bits(bits)
    device = next(model.parameters()).device
    batches = [torch.tensor([w], device=device) for w in windows]
    reference = [F.log_softmax(model(x).float(), dim=-1) for x in batches]
    num_tokens = sum(x.shape[1] for x in batches)
    rel = table.calib_mass / np.maximum(table.calib_mass.mean(axis=1, keepdims=True), 1e-12) \
        if table.calib_mass is not None else np.ones((table.num_layers, table.num_experts))
    mult = np.maximum(rel.reshape(-1)[table.expert_index], 1e-3)
    modules = sorted({b.module for b in table.block_ids})
    module_of = np.array([b.module for b in table.block_ids])
    scales, kls = {}, {}
    for layer in range(table.num_layers):
        for module in modules:
            group = (table.layer == layer) & (module_of == module)
            trial = bits.copy()
            trial[group] = 3
            set_bits(trial)
            # sum over tokens of KL(p_8bit || p_trial), then the mean per token
            kl = sum(float(F.kl_div(F.log_softmax(model(x).float(), dim=-1), ref,
                                    log_target=True, reduction="sum"))
                     for x, ref in zip(batches, reference)) / num_tokens
            s = float((mult[group] * (table.sensitivity[group, 0] - table.sensitivity[group, 5])).sum())
            key = group_key(layer, module)
            kls[key], scales[key] = kl, kl / max(s, 1e-30)
    set_bits(bits)
    floor = MIN_SCALE_FRACTION * float(np.median(list(scales.values())))
    return GroupScales({k: max(v, floor) for k, v in scales.items()}, kls, num_tokens)
