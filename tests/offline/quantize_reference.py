"""The whole-model quantiser `pagedweight quantize` ran before the streaming one
(services/pagedweight/offline/quantize.py), kept unchanged as its test oracle: test_quantize_stream.py
checks that both write the same planes and tables. It holds the whole model in fp32 on
one device, so it only suits small models.

Phases:
1. calibrate: run the calibration text through the dense model and collect, per chunk
   and per expert block, input statistics and routing (calibrate.py);
2. quantise: per layer and module, all experts' rows at once, with the block's
   smoothed Hessian diagonal as k-means weights (apl_quantizer.py), then pack planes;
3. sensitivity: S_i(b) from the Hessians and per-column errors (sensitivity.py), and
   per chunk for the residual heads (residual_heads.py);
4. save the directory (paged_model.py); no bf16 copy of the routed experts unless
   `keep_bf16` (the source checkpoint has them: model/source_experts.py);
5. the planner's loss scales: one KL measurement per (layer, module) group on the
   calibration files, recorded in the artifact for every sensitivity table
   (artifact_scales.py), so `plan`, `eval` and the runtime rank in loss units by default.
Shared experts and every non-expert weight are copied in bf16, unquantised.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from pagedweight.offline.artifact_scales import add_planner_scales
from pagedweight.offline.calib_text import calib_text_record
from pagedweight.offline.calibrate import (
    CalibConfig, CalibrationStats, block_hessians, calibrate, output_fisher, read_chunks,
    routing_summary, smoothed_hessians,
)
from pagedweight.offline.error_feedback import smoothed_full_hessians
from pagedweight.offline.layer_quantize import quantize_layer
from pagedweight.offline.quantize import QuantizeConfig
from pagedweight.offline.residual_heads import fit_residual_heads, heads_tensors
from pagedweight.planner.residual_predictor import routing_features
from pagedweight.offline.sensitivity import check_monotone, sensitivity_matrix, sensitivity_table
from pagedweight.model import load_model
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.format.apl_format import BIT_WIDTHS, MODULES, BlockId
from pagedweight.format.paged_model import all_block_ids, save_paged_model


def quantize_model_in_memory(model_dir: str | Path, out_dir: str | Path, calib_files: list[Path],
                             config: QuantizeConfig = QuantizeConfig(),
                             log: Callable[[str], None] = lambda msg: None) -> Path:
    started = time.perf_counter()
    model = load_model(model_dir, dtype=torch.float32, device=config.device)
    cfg = model.config
    chunks, domains = read_chunks(Tokenizer(model_dir), calib_files, config.calib)
    log(f"calibrating on {len(chunks)} chunks of {config.calib.seq_len} tokens")
    stats = calibrate(model, chunks, domains, config.calib, files=[str(f) for f in calib_files],
                      full_hessians=config.quantizer.needs_full_hessians)
    calib_seconds = time.perf_counter() - started
    h = dict(zip(MODULES, block_hessians(stats, config.calib)))  # module -> [L, E, C]
    fisher = output_fisher(stats, config.calib)
    g = dict(zip(MODULES, fisher)) if fisher else None  # module -> [L, E, rows]
    h_full = full_hessians(stats, h, config.calib) if config.quantizer.needs_full_hessians else None

    apl, col_errors, col_errors_gn = {}, {}, {}
    for layer, block in enumerate(model.moe_blocks):
        log(f"quantising layer {layer + 1}/{cfg.num_layers}")
        for module in MODULES:
            w = getattr(block.experts, module).detach()  # on config.device
            result = quantize_layer(w, h[module][layer], config.quantizer, config.device,
                                    g[module][layer] if g else None,
                                    h_full[module][layer] if h_full else None)
            apl[(layer, module)], col_errors[(layer, module)] = result.planes, result.col_errors
            col_errors_gn[(layer, module)] = result.col_errors_gn
    quant_seconds = time.perf_counter() - started - calib_seconds

    sens = sensitivity_table(h, col_errors, cfg.num_layers)
    heads, heads_report = fit_heads(stats, col_errors, sens, all_block_ids(cfg), config)
    meta = {
        "calibration": {**routing_summary(stats, config.calib)["coverage"],
                        "files": stats.files, "num_tokens": stats.num_tokens,
                        "text": calib_text_record(calib_files, config.calib_text_name),
                        "num_chunks": stats.num_chunks, "seq_len": stats.num_tokens_per_chunk,
                        "hessian": "mean squared input per column over routed tokens, smoothed",
                        "config": asdict(config.calib)},
        "routing": routing_summary(stats, config.calib),
        "sensitivity": {b.key(): {str(bits): s for bits, s in row.items()} for b, row in sens.items()},
        "sensitivity_non_monotone": check_monotone({b.key(): row for b, row in sens.items()}),
        **gauss_newton_meta(h, col_errors_gn, cfg.num_layers, g is not None),
        "quantizer": {"config": asdict(config.quantizer), "device": config.device,
                      "calibration_seconds": calib_seconds, "quantization_seconds": quant_seconds},
        "residual_heads": heads_report,
    }
    dense = {k: v.cpu() for k, v in model.state_dict().items() if ".experts." not in k}
    bf16 = {(l, m): getattr(b.experts, m).detach().cpu() for l, b in enumerate(model.moe_blocks)
            for m in MODULES} if config.keep_bf16 else None
    hessians = {(l, m): h[m][l] for l in range(cfg.num_layers) for m in MODULES}
    if g:
        hessians.update({(l, f"{m}.grad_sq"): g[m][l] for l in range(cfg.num_layers) for m in MODULES})
    del model
    out = save_paged_model(out_dir, model_dir, cfg, dense, apl, bf16, meta, heads_tensors(heads), hessians)
    if config.scale_tokens > 0:
        log(f"measuring the planner's loss scales ({2 * cfg.num_layers} groups)")
        scales_started = time.perf_counter()
        add_planner_scales(out, calib_files, config.scale_tokens, config.device)
        log(f"loss scales in {time.perf_counter() - scales_started:.1f} s")
    log(f"wrote {out} in {time.perf_counter() - started:.1f} s")
    return out


def full_hessians(stats: CalibrationStats, h: dict, config: CalibConfig) -> dict:
    """module -> [L, E, C, C]: the smoothed full input Hessians error feedback runs on."""
    counts = stats.token_counts.sum(0)  # [L, E]
    grams = {"gate_up": stats.gram_gate_up, "down": stats.gram_down}
    return {m: torch.stack([smoothed_full_hessians(grams[m][l], counts[l], h[m][l], config.prior_tokens)
                            for l in range(counts.shape[0])]) for m in MODULES}


def gauss_newton_meta(h, col_errors_gn, num_layers: int, present: bool) -> dict:
    """The `sensitivity_gn` section: S_gn_i(b) = sum G[r] h[c] (w - Q_b)^2 (calibrate.py)."""
    if not present:
        return {}
    table = sensitivity_table(h, col_errors_gn, num_layers)
    return {"sensitivity_gn": {b.key(): {str(bits): s for bits, s in row.items()} for b, row in table.items()}}


def chunk_sensitivities(stats: CalibrationStats, col_errors, config: CalibConfig) -> torch.Tensor:
    """S_i^chunk(b) [N, B, nb] with each chunk's own smoothed Hessian (block order: all_block_ids)."""
    counts = stats.token_counts
    h_chunk = {"gate_up": smoothed_hessians(stats.sum_sq_gate_up, counts, config.prior_tokens, True),
               "down": smoothed_hessians(stats.sum_sq_down, counts, config.prior_tokens, False)}
    L, E = counts.shape[1], counts.shape[2]
    out = torch.empty(stats.num_chunks, L, E, len(MODULES), len(BIT_WIDTHS), dtype=torch.float64)
    for layer in range(L):
        for mi, module in enumerate(MODULES):
            for e in range(E):
                errs = {b: col_errors[(layer, module)][b][e] for b in BIT_WIDTHS}
                out[:, layer, e, mi] = sensitivity_matrix(h_chunk[module][:, layer, e], errs)
    return out.reshape(stats.num_chunks, L * E * len(MODULES), len(BIT_WIDTHS))


def fit_heads(stats, col_errors, sens, ids: list[BlockId], config: QuantizeConfig):
    """Per-chunk log corrections of S against routing features -> ridge heads + R^2 report."""
    chunk_s = chunk_sensitivities(stats, col_errors, config.calib)
    global_s = torch.tensor([[sens[b][bits] for bits in BIT_WIDTHS] for b in ids], dtype=torch.float64)
    targets = torch.log(chunk_s.clamp_min(1e-30) / global_s.clamp_min(1e-30)).mean(-1)  # [N, B]
    features = routing_features(stats.token_counts.cpu().numpy())
    return fit_residual_heads(features, targets.cpu(), stats.chunk_domains, config.residual)

