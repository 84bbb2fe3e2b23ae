"""Sensitivity tables: the Hessian-weighted quantisation error of every block at every width.

    S_i(b) = sum over weights (r, c) of h_i[c] * (w[r, c] - Q_b(w)[r, c])^2
           = h_i . err_i(b),   err_i(b)[c] = sum_r (w[r, c] - Q_b(w)[r, c])^2

h_i is the block's diagonal input Hessian (calibrate.py). With the per-column error
vectors err_i(b) kept, any other h (a single chunk's, a prompt's) gives its own S
with one dot product; residual_heads.py uses that.
"""

from __future__ import annotations

import torch

from services.worker.weights.apl_format import BIT_WIDTHS


def sensitivity(h: torch.Tensor, col_errors: dict[int, torch.Tensor]) -> dict[int, float]:
    """h [C], col_errors bits -> [C]  ->  bits -> S(b)."""
    return {b: float(h.double() @ col_errors[b].double()) for b in BIT_WIDTHS}


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
