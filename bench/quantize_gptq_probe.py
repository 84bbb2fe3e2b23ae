"""Probe: would GPTQ-style error feedback lower the nested codes' error at 3-4 bits? (issue 14, quality)

The quantiser (offline/apl_quantizer.py) clusters each row's weights by a k-means weighted
with the diagonal of the input Hessian; it never looks at how columns' errors interact.
GPTQ (Frantar et al. 2022) quantises a row column by column and pushes each column's
error onto the columns not yet quantised through the inverse of the full Hessian
H = sum_x x x^T, which the diagonal cannot express. Before building that into the
quantiser (the calibration would have to record full Hessians, and the nested codes would
have to be re-split above the width it runs at), this probe measured what it could give
(since built in as `quantize --error-feedback`: offline/error_feedback.py, whose operations
and the calibration's full-Hessian recording the probe now uses),
on the layer-output error each expert block causes:

    err(Q) = trace((W - Q) H (W - Q)^T)     (H from held-out text: the `valid` files)

for every (layer, expert, module) of a shared model, at b = 3 and 4 bits:
- kmeans: today's nested codes and LUT at b bits (quantize_rows, importance diag(H_calib));
- gptq: the same per-row LUT, codes chosen column by column with error feedback (H_calib);
- gptq+lut: then each row's LUT refitted by least squares under H_calib given the codes;
- kmeans+lut: today's codes with the LUT refitted the same way (no feedback).
And the model's mean per-token KL(unquantised || quantised) on the `valid` text with every
expert block at b bits, for kmeans, kmeans+lut, gptq and gptq+lut at `--kl-damp`.
The expert inputs come from a layer-by-layer fp32 forward (offline/checkpoint_layers.py)
of the bundled calibration text (H_calib) and of each domain's `valid` text (H_valid).
The block error is a proxy; the KL is the model's, but with every block at one width
(uniform), not a planner's mix.

    .venv/bin/python -m bench.quantize_gptq_probe --model tiny-mixtral --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from bench.bench_meta import write_result
from pagedweight.common.paths import corpus_dir, shared_dir
from pagedweight.format.apl_format import MAX_BITS, MODULES
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.offline.apl_quantizer import KMEANS_ONLY, quantize_rows
from pagedweight.offline.calib_text import bundled_calib_files
from pagedweight.offline.calibrate import CalibConfig, CalibrationStats, RecordingExperts, read_chunks
from pagedweight.offline.checkpoint_layers import CheckpointLayers
from pagedweight.offline.error_feedback import block_error, feedback_codes, feedback_factors

DOMAINS = ("cheader", "kjv", "pycode", "pydoc")


def hessian_recorder(dense) -> RecordingExperts:
    """The calibration's recorder with full input Hessians (calibrate.py): every token in
    one chunk, so only the [E, C, C] sums of x x^T (gate_up) and a a^T (down) matter."""
    E, H, I = dense.num_experts, dense.gate_up.shape[2], dense.down.shape[2]
    stats = CalibrationStats([""], torch.zeros(1, 1, E, H), torch.zeros(1, 1, E, I), torch.zeros(1, 1, E),
                             torch.zeros(1, 1, E), 0, gram_gate_up=torch.zeros(1, E, H, H),
                             gram_down=torch.zeros(1, E, I, I))
    return RecordingExperts(dense, 0, stats)


def forward(layers: CheckpointLayers, chunks: torch.Tensor, batch: int, record: bool = False,
            weights: dict | None = None) -> tuple[torch.Tensor, list[dict] | None]:
    """The final hidden states [N, T, H] of the chunks, layer by layer; `record`: also every
    layer's expert Hessians (module -> [E, C, C]); `weights`: (layer, module) -> [E, R, C]
    expert weights to run instead of the checkpoint's."""
    x = layers.embed(chunks)
    hessians = [] if record else None
    for layer in range(layers.config.num_layers):
        module = layers.decoder_layer(layer)
        dense = module.moe.experts
        for m in MODULES:
            if weights is not None and (layer, m) in weights:
                getattr(dense, m).data.copy_(weights[(layer, m)])
        if record:
            module.moe.experts = hessian_recorder(dense)
        outputs = []
        for s in range(0, len(x), batch):
            xb = x[s:s + batch]
            if record:
                module.moe.experts.chunk_of_token = torch.zeros(xb.shape[0] * xb.shape[1], dtype=torch.long)
            with torch.inference_mode():
                outputs.append(module(xb, layers.rope(xb.shape[0], x.shape[1]), 0, None))
        x = torch.cat(outputs)
        if record:
            stats = module.moe.experts.stats
            hessians.append({"gate_up": stats.gram_gate_up[0], "down": stats.gram_down[0]})
    return x, hessians


def mean_kl(layers: CheckpointLayers, x_ref: torch.Tensor, x: torch.Tensor, batch: int) -> float:
    """Mean per-token KL(reference || variant) of the next-token distributions."""
    norm, head = layers.head()
    total, count = 0.0, 0
    with torch.inference_mode():
        for s in range(0, len(x), batch):
            p = torch.log_softmax(F.linear(norm(x_ref[s:s + batch]), head).float(), -1)
            q = torch.log_softmax(F.linear(norm(x[s:s + batch]), head).float(), -1)
            total += float((p.exp() * (p - q)).sum())
            count += p.shape[0] * p.shape[1]
    return total / count


def gptq_codes(w: torch.Tensor, h: torch.Tensor, lut: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """w [R, C], h [C, C], lut [R, K] sorted -> codes [R, C] with GPTQ's error feedback
    (the quantiser's own operations: offline/error_feedback.py)."""
    return feedback_codes(w[None], feedback_factors(h[None], damp), lut[None].float())[0].long()


def refit_lut(w: torch.Tensor, h: torch.Tensor, codes: torch.Tensor, K: int, fallback: torch.Tensor) -> torch.Tensor:
    """Per row, the LUT minimising (w - lut[codes]) H (w - lut[codes])^T for fixed codes:
    (S H S^T) lut = S H w with S the one-hot [K, C] of the row's codes."""
    S = torch.nn.functional.one_hot(codes, K).transpose(1, 2).double()  # [R, K, C]
    SH = S @ h.double()
    A = SH @ S.transpose(1, 2) + 1e-9 * torch.eye(K, dtype=torch.float64)
    b = (SH @ w.double()[:, :, None])[:, :, 0]
    lut = torch.linalg.solve(A, b).float()
    used = S.sum(2) > 0
    return torch.where(used, lut, fallback)


def probe_inputs(model: str, tokens: int) -> tuple[CheckpointLayers, list[dict], torch.Tensor]:
    """A shared model's layers (fp32, CPU), its expert Hessians on `tokens` per bundled
    calibration file, and the chunks of `tokens` per domain's `valid` file (held out)."""
    model_dir = shared_dir() / "models" / model
    layers = CheckpointLayers(model_dir, "cpu", "float32")
    calib = CalibConfig(max_tokens_per_file=tokens)
    tok = Tokenizer(model_dir)
    _, h_calib = forward(layers, torch.tensor(read_chunks(tok, bundled_calib_files(), calib)[0]), 8, record=True)
    valid_files = [corpus_dir() / f"{d}.valid.txt" for d in DOMAINS]
    return layers, h_calib, torch.tensor(read_chunks(tok, valid_files, calib)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-mixtral")
    parser.add_argument("--tokens", type=int, default=2048, help="per file, calibration and valid each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bits", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--damp", type=float, nargs="+", default=[0.01, 0.1, 1.0],
                        help="GPTQ's dampening: this fraction of H's mean diagonal added to it")
    parser.add_argument("--kl-damp", type=float, default=0.1, help="the dampening whose model KL is measured")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    layers, h_calib, valid = probe_inputs(args.model, args.tokens)
    x_ref, h_valid = forward(layers, valid, 8, record=True)
    kl_methods = ("kmeans", "kmeans+lut", f"gptq@{args.kl_damp}", f"gptq+lut@{args.kl_damp}")
    kl_weights = {(b, m): {} for b in args.bits for m in kl_methods}  # every expert at b bits
    print(f"Hessians in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    methods = ("kmeans", "kmeans+lut", *(f"{m}@{d}" for d in args.damp for m in ("gptq", "gptq+lut")))
    totals = {b: {m: {"valid": 0.0, "calib": 0.0} for m in methods} for b in args.bits}
    for layer in range(layers.config.num_layers):
        dense = layers.decoder_layer(layer).moe.experts
        for module in MODULES:
            for e in range(dense.num_experts):
                w = getattr(dense, module)[e].detach().float()
                hc, hv = h_calib[layer][module][e], h_valid[layer][module][e]
                q = quantize_rows(w, hc.diagonal(), KMEANS_ONLY)
                for b in args.bits:
                    K = 1 << b
                    lut = q.luts[b].float()
                    codes = q.codes.long() >> (MAX_BITS - b)
                    candidates = {"kmeans": (codes, lut)}
                    candidates["kmeans+lut"] = (codes, refit_lut(w, hc, codes, K, lut))
                    for d in args.damp:
                        g = gptq_codes(w, hc, lut, d)
                        candidates[f"gptq@{d}"] = (g, lut)
                        candidates[f"gptq+lut@{d}"] = (g, refit_lut(w, hc, g, K, lut))
                    for name, (c, l) in candidates.items():
                        deq = torch.gather(l, 1, c)
                        if name in kl_methods:
                            kl_weights[(b, name)].setdefault((layer, module), getattr(dense, module).detach().clone())[e] = deq
                        totals[b][name]["valid"] += block_error(w, deq, hv)
                        totals[b][name]["calib"] += block_error(w, deq, hc)
        print(f"layer {layer} done, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    kl = {b: {} for b in args.bits}
    for (b, name), weights in kl_weights.items():
        x, _ = forward(layers, valid, 8, weights=weights)
        kl[b][name] = mean_kl(layers, x_ref, x, 8)
        print(f"KL at {b} bits, {name}: {kl[b][name]:.4f}", file=sys.stderr, flush=True)
    relative = {b: {m: {s: v / totals[b]["kmeans"][s] for s, v in r.items()} for m, r in t.items()}
                for b, t in totals.items()}
    result = {"model": args.model, "tokens_per_file": args.tokens, "bits": args.bits, "damp": args.damp,
              "error_sum": {str(b): t for b, t in totals.items()},
              "relative_to_kmeans": {str(b): r for b, r in relative.items()},
              "kl_every_expert_at_bits": {str(b): r for b, r in kl.items()},
              "kl_tokens": int(valid.numel()),
              "seconds": time.perf_counter() - started,
              "note": "sum over blocks of trace((W-Q) H (W-Q)^T), H from valid text (held out) or the "
                      "calibration text (what GPTQ and the refit optimise); a proxy, not KL"}
    path = write_result(f"quantize_gptq_probe_{args.model}", result)
    for b, r in relative.items():
        print(b, {m: f"{v['valid']:.3f} (calib {v['calib']:.3f})" for m, v in r.items()})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
