"""Sensitivity tables: the Hessian-weighted quantisation error of every block at every width.

    S_i(b) = sum over weights (r, c) of h_i[c] * (w[r, c] - Q_b(w)[r, c])^2
           = h_i . err_i(b),   err_i(b)[c] = sum_r (w[r, c] - Q_b(w)[r, c])^2

h_i is the block's diagonal input Hessian (calibrate.py). With the per-column error
vectors err_i(b) kept, any other h (a single chunk's, a prompt's) gives its own S
with one dot product; residual_heads.py uses that. The Gauss-Newton table uses the same
code with err rows weighted by the output Fisher G[r] (quantize.py, calibrate.py):
    S_gn_i(b) = sum h_i[c] G_i[r] (w - Q_b(w))^2.
"""

from __future__ import annotations

import torch

from pagedweight.format.apl_format import BIT_WIDTHS, MODULES, BlockId


def sensitivity_table(h: dict[str, torch.Tensor], col_errors, num_layers: int) -> dict[BlockId, dict[int, float]]:
    """h: module -> [L, E, C]; col_errors: (layer, module) -> bits -> [E, C].

    Returns # block_id -> bits -> S_i(b)."""
    table = {}
    for layer in range(num_layers):
        for module in MODULES:
            errs = torch.stack([col_errors[(layer, module)][b] for b in BIT_WIDTHS], -1).double()  # [E, C, nb]
            s = torch.einsum("ec,ecb->eb", h[module][layer].double(), errs)
            for e in range(s.shape[0]):
                table[BlockId(layer, e, module)] = {b: float(v) for b, v in zip(BIT_WIDTHS, s[e])}
    return table


def sensitivity_matrix(h: torch.Tensor, col_errors: dict[int, torch.Tensor]) -> torch.Tensor:
    """h [N, C] (one row per chunk), col_errors bits -> [C]  ->  S [N, len(BIT_WIDTHS)]."""
    errs = torch.stack([col_errors[b] for b in BIT_WIDTHS], dim=1).double()  # [C, nb]
    return h.double() @ errs


def check_monotone(table: dict[str, dict[int, float]]) -> list[str]:
    """Keys of blocks whose S(b) does not fall as b rises (nested splits can only help;
    a violation points at a quantiser bug or fp16 LUT rounding at tiny errors)."""
    bad = []
    for key, row in table.items():
        values = [row[b] for b in BIT_WIDTHS]
        if any(hi > lo * (1 + 1e-3) + 1e-12 for lo, hi in zip(values, values[1:])):
            bad.append(key)
    return bad
