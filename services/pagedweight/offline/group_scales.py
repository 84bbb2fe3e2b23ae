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


def measure_group_scales(model, table: BlockTable, windows: list[list[int]], set_bits) -> GroupScales:
    """`set_bits(bits [N])` puts the model at a plan; windows are token lists (one forward each)."""
    kls, num_tokens = measure_group_kls(model, table, windows, set_bits)
    return scales_from_kls(table, kls, num_tokens)


@torch.inference_mode()
def measure_group_kls(model, table: BlockTable, windows: list[list[int]], set_bits) -> tuple[dict, int]:
    """Per (layer, module) group: mean KL(8-bit || group at 3 bits) per token. The KL does
    not depend on the sensitivity table, so one measurement calibrates every table."""
    bits = np.full(table.num_blocks, 8)
    set_bits(bits)
    device = next(model.parameters()).device
    batches = [torch.tensor([w], device=device) for w in windows]
    reference = [F.log_softmax(model(x).float(), dim=-1) for x in batches]
    num_tokens = sum(x.shape[1] for x in batches)
    modules = sorted({b.module for b in table.block_ids})
    module_of = np.array([b.module for b in table.block_ids])
    kls = {}
    for layer in range(table.num_layers):
        for module in modules:
            group = (table.layer == layer) & (module_of == module)
            trial = bits.copy()
            trial[group] = 3
            set_bits(trial)
            # sum over tokens of KL(p_8bit || p_trial), then the mean per token
            kls[group_key(layer, module)] = sum(
                float(F.kl_div(F.log_softmax(model(x).float(), dim=-1), ref, log_target=True, reduction="sum"))
                for x, ref in zip(batches, reference)) / num_tokens
    set_bits(bits)
    return kls, num_tokens


def scales_from_kls(table: BlockTable, kls: dict[str, float], num_tokens: int,
                    sensitivity: str = "sensitivity") -> GroupScales:
    """scale_g = KL_g / sum over g's blocks of m_i (S_i(3) - S_i(8)), floored (loss_scale.py)."""
    # A KL is >= 0, but a group whose lowering changes nothing can sum to a rounding error
    # below zero; recorded as is, the artifact's own loader would refuse it.
    kls = {key: max(float(kl), 0.0) for key, kl in kls.items()}
    rel = table.calib_mass / np.maximum(table.calib_mass.mean(axis=1, keepdims=True), 1e-12) \
        if table.calib_mass is not None else np.ones((table.num_layers, table.num_experts))
    mult = np.maximum(rel.reshape(-1)[table.expert_index], 1e-3)
    module_of = np.array([b.module for b in table.block_ids])
    scales = {}
    for key in kls:
        layer, module = key[1:].split(".", 1)
        group = (table.layer == int(layer)) & (module_of == module)
        s = float((mult[group] * (table.sensitivity[group, 0] - table.sensitivity[group, 5])).sum())
        scales[key] = kls[key] / max(s, 1e-30)
    floor = MIN_SCALE_FRACTION * float(np.median(list(scales.values())))
    return GroupScales({k: max(v, floor) for k, v in scales.items()}, dict(kls), num_tokens, sensitivity)
