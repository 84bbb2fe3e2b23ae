"""The tables `quantize` derives from calibration statistics and quantisation errors:
per-chunk sensitivities for one layer, the prompt-residual heads fitted on them, the
Gauss-Newton section, and the artifact's metadata sections. Shared by the streaming
quantiser (quantize.py) and the whole-model reference (tests/offline/quantize_reference.py), so both
write the same artifact from the same numbers.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from pagedweight.format.apl_format import BIT_WIDTHS, MODULES, BlockId
from pagedweight.offline.calib_text import calib_text_record
from pagedweight.offline.calibrate import CalibConfig, CalibrationStats, routing_summary, smoothed_hessians
from pagedweight.offline.residual_heads import fit_residual_heads
from pagedweight.planner.residual_predictor import routing_features
from pagedweight.offline.sensitivity import check_monotone, sensitivity_matrix, sensitivity_table


def layer_chunk_sensitivities(sum_sq: dict[str, torch.Tensor], counts: torch.Tensor, col_errors,
                              config: CalibConfig) -> torch.Tensor:
    """One layer's S_i^chunk(b) [N, E, len(MODULES), nb], each chunk with its own smoothed
    Hessian. sum_sq: module -> [N, 1, E, C] (the layer's per-chunk sums), counts [N, 1, E];
    col_errors: module -> bits -> [E, C]."""
    per_column = {"gate_up": True, "down": False}  # calibrate.block_hessians' priors
    N, _, E = counts.shape
    out = torch.empty(N, E, len(MODULES), len(BIT_WIDTHS), dtype=torch.float64)
    for mi, module in enumerate(MODULES):
        h_chunk = smoothed_hessians(sum_sq[module], counts, config.prior_tokens, per_column[module])[:, 0]
        for e in range(E):
            errs = {b: col_errors[module][b][e] for b in BIT_WIDTHS}
            out[:, e, mi] = sensitivity_matrix(h_chunk[:, e], errs)
    return out


def fit_heads(chunk_s: torch.Tensor, sens, ids: list[BlockId], token_counts: torch.Tensor,
              domains: list[str], config):
    """Per-chunk log corrections of S against routing features -> ridge heads + R^2 report.
    chunk_s [N, B, nb] in `ids` order; token_counts [N, L, E]."""
    global_s = torch.tensor([[sens[b][bits] for bits in BIT_WIDTHS] for b in ids], dtype=torch.float64)
    targets = torch.log(chunk_s.clamp_min(1e-30) / global_s.clamp_min(1e-30)).mean(-1)  # [N, B]
    features = routing_features(token_counts.detach().cpu().numpy())
    return fit_residual_heads(features, targets.detach().cpu(), domains, config.residual)


def gauss_newton_meta(h, col_errors_gn, num_layers: int, present: bool) -> dict:
    """The `sensitivity_gn` section: S_gn_i(b) = sum G[r] h[c] (w - Q_b)^2 (calibrate.py)."""
    if not present:
        return {}
    table = sensitivity_table(h, col_errors_gn, num_layers)
    return {"sensitivity_gn": {b.key(): {str(bits): s for bits, s in row.items()} for b, row in table.items()}}


def artifact_meta(stats: CalibrationStats, calib_files, config, h, col_errors, col_errors_gn,
                  num_layers: int, gradients: bool, heads_report: dict, quantizer: dict) -> dict:
    """Every metadata section the quantiser adds to paged_model.json. `stats` needs only
    its routing fields (token_counts, routing_mass, chunk_domains, files)."""
    sens = sensitivity_table(h, col_errors, num_layers)
    summary = routing_summary(stats, config.calib)
    return {
        "calibration": {**summary["coverage"],
                        "files": stats.files, "num_tokens": stats.num_tokens,
                        "text": calib_text_record(calib_files, config.calib_text_name),
                        "num_chunks": stats.num_chunks, "seq_len": stats.num_tokens_per_chunk,
                        "hessian": "mean squared input per column over routed tokens, smoothed",
                        "config": asdict(config.calib)},
        "routing": summary,
        "sensitivity": {b.key(): {str(bits): s for bits, s in row.items()} for b, row in sens.items()},
        "sensitivity_non_monotone": check_monotone({b.key(): row for b, row in sens.items()}),
        **gauss_newton_meta(h, col_errors_gn, num_layers, gradients),
        "quantizer": {"config": asdict(config.quantizer), "device": config.device, **quantizer},
        "residual_heads": heads_report,
    }
