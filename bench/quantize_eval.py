"""Evidence for the APL quantiser and the sensitivity tables.

For each paged model, on every `valid` domain (first --max-tokens tokens each):
1. perplexity with bf16 experts and at uniform 3..8 bits;
2. per layer: that layer's blocks alone at 3 bits (the rest bf16), pooled NLL increase;
   per expert: that expert's two blocks alone at 3 bits (first --expert-tokens tokens
   per domain); Spearman rank correlation of the increase with S(3) summed over the
   lowered blocks, and with S(3) times the expert's calibration routing share;
3. quantisation wall time of --time-model (fresh `quantize_model` into a temp dir).
Evaluation runs in fp32 on --device (the numbers do not depend on it beyond float
rounding); quantisation timing always runs on the CPU (--threads, default 1). A perturbation at
layer l reuses the bf16 model's cached layer-l inputs and runs layers l.. only (exact:
earlier layers are unchanged).

    python -m bench run quantize-eval --artifacts DIR
    python -m bench.quantize_eval --models --out bench/results/quantize_time.json  # the timing alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]

from bench.bench_meta import log, stamp
from pagedweight.common.paths import shared_dir
from pagedweight.offline.perplexity import token_windows
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.format.apl_format import BIT_WIDTHS, MODULES, BlockId
from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits, uniform_bits
from pagedweight.format.paged_model import load_paged_model

SHARED = shared_dir()
DOMAINS = ("kjv", "pydoc", "pycode", "cheader")


def windows_by_domain(tokenizer, max_tokens: int, seq_len: int, device="cpu") -> dict[str, torch.Tensor]:
    """domain -> [num_windows, seq_len + 1] token ids (full windows only)."""
    out = {}
    for d in DOMAINS:
        ids = tokenizer.encode((SHARED / "data" / "corpus" / f"{d}.valid.txt").read_text())
        wins = [w for w in token_windows(ids, seq_len, max_tokens) if len(w) == seq_len + 1]
        out[d] = torch.tensor(wins, device=device)
    return out


@torch.inference_mode()
def layer_inputs(model, batch: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream entering each decoder layer for batch [B, T]."""
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for layer in model.layers]
    try:
        model(batch)
    finally:
        for h in hooks:
            h.remove()
    return inputs


@torch.inference_mode()
def logits_from(model, x: torch.Tensor, first_layer: int) -> torch.Tensor:
    """fp32 logits, running layers first_layer.. from their input x."""
    return model.forward_from_layer(x, first_layer).float()


class Evaluator:
    """Mean NLL per domain and KL to the bf16 model; caches the bf16 model's layer inputs
    (for layer-local changes) and its log-probabilities (for the KL)."""

    def __init__(self, model, windows: dict[str, torch.Tensor], batch_size: int = 4):
        self.model = model
        self.batches = {d: [w[i:i + batch_size] for i in range(0, len(w), batch_size)] for d, w in windows.items()}
        self.cache = None
        self.ref_logp = None

    @torch.inference_mode()
    def cache_inputs(self):
        set_model_bits(self.model, uniform_bits(self.model.config, None))
        self.cache = {d: [layer_inputs(self.model, b[:, :-1]) for b in bs] for d, bs in self.batches.items()}
        self.ref_logp = {d: [torch.log_softmax(logits_from(self.model, c[0], 0), -1).half() for c in cs]
                         for d, cs in self.cache.items()}

    def nll(self, first_layer: int = 0) -> dict[str, float]:
        return self.measure(first_layer)[0]

    @torch.inference_mode()
    def measure(self, first_layer: int = 0) -> tuple[dict[str, float], float | None]:
        """(mean NLL per domain, mean KL(bf16 || current) per token or None before caching)."""
        out, kl_sum, kl_count = {}, 0.0, 0
        for d, batches in self.batches.items():
            total, count = 0.0, 0
            for i, batch in enumerate(batches):
                if first_layer == 0 and self.cache is None:
                    x = self.model.embed_tokens(batch[:, :-1])
                else:
                    x = self.cache[d][i][first_layer]
                logits = logits_from(self.model, x, first_layer)
                targets = batch[:, 1:]
                total += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
                count += targets.numel()
                if self.ref_logp is not None:
                    ref = self.ref_logp[d][i].float()
                    kl_sum += float((ref.exp() * (ref - torch.log_softmax(logits, -1))).sum())
                    kl_count += targets.numel()
            out[d] = total / count
        return out, (kl_sum / kl_count if kl_count else None)


def pooled(nll: dict[str, float]) -> float:
    return sum(nll.values()) / len(nll)  # domains have equal token counts


def spearman(a: list[float], b: list[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def expert_blocks(layer: int, expert: int) -> list[BlockId]:
    return [BlockId(layer, expert, m) for m in MODULES]


def evaluate_model(path: Path, max_tokens: int, expert_tokens: int, seq_len: int, device: str) -> dict:
    paged = load_paged_model(path)
    cfg = paged.config
    model = build_paged_lm(paged, dtype=torch.float32, device=device)
    windows = windows_by_domain(Tokenizer(path), max_tokens, seq_len, device)
    ev = Evaluator(model, windows)
    started = time.perf_counter()
    result = {"tokens_per_domain": {d: int(w[:, 1:].numel()) for d, w in windows.items()}, "ppl": {}}
    for bits in (None, *BIT_WIDTHS):
        set_model_bits(model, uniform_bits(cfg, bits))
        nll = ev.nll()
        result["ppl"]["bf16" if bits is None else str(bits)] = {d: math.exp(v) for d, v in nll.items()}
        log(f"{path.name} {bits or 'bf16'}: " + " ".join(f"{d}={math.exp(v):.3f}" for d, v in nll.items()))
    sens, share = paged.sensitivity, routing_share(paged)
    gn = paged.sensitivity_gn  # None for artifacts calibrated without gradients
    keys = ("s3", "s3_x_share") + (("s3_gn", "s3_gn_x_share") if gn else ())

    def predictors(blocks: list[BlockId]) -> dict[str, float]:
        """S(3) of the lowered blocks, alone and times their expert's routing share."""
        out = {"s3": sum(sens[b][3] for b in blocks),
               "s3_x_share": sum(sens[b][3] * share[b.layer][b.expert] for b in blocks)}
        if gn:
            out["s3_gn"] = sum(gn[b][3] for b in blocks)
            out["s3_gn_x_share"] = sum(gn[b][3] * share[b.layer][b.expert] for b in blocks)
        return out

    ev.cache_inputs()
    base = {l: pooled(ev.nll(l)) for l in range(cfg.num_layers)}  # bf16, through the same path
    layers = []
    for layer in range(cfg.num_layers):
        blocks = [b for e in range(cfg.num_experts) for b in expert_blocks(layer, e)]
        layers.append({"layer": layer, **lowered_damage(model, ev, blocks, layer, base[layer]),
                       **predictors(blocks)})
    result["per_layer"] = layers
    result["per_layer_spearman"] = correlations(layers, keys)
    log(f"{path.name} per layer: {result['per_layer_spearman']}")
    ev = Evaluator(model, windows_by_domain(Tokenizer(path), expert_tokens, seq_len, device))
    ev.cache_inputs()
    base = {l: pooled(ev.nll(l)) for l in range(cfg.num_layers)}
    experts = []
    for layer in range(cfg.num_layers):
        for e in range(cfg.num_experts):
            blocks = expert_blocks(layer, e)
            experts.append({"block": f"L{layer}.E{e}",
                            **lowered_damage(model, ev, blocks, layer, base[layer]),
                            **predictors(blocks)})
    result["per_expert"] = experts
    result["per_expert_tokens_per_domain"] = expert_tokens
    result["per_expert_spearman"] = correlations(experts, keys)
    log(f"{path.name} per expert: {result['per_expert_spearman']}")
    result["eval_seconds"] = time.perf_counter() - started
    result["calibration"] = {k: paged.meta["calibration"][k] for k in ("num_tokens", "under_covered_experts")}
    result["quantizer"] = paged.meta["quantizer"]
    result["residual_heads_heldout_r2"] = paged.meta["residual_heads"]["heldout_r2"]
    return result


def routing_share(paged) -> list[list[float]]:
    """[L][E] fraction of the calibration tokens routed to each expert."""
    counts = torch.tensor(paged.routing["token_counts"])
    return (counts / paged.routing["num_tokens"]).tolist()


def lowered_damage(model, ev: Evaluator, blocks: list[BlockId], layer: int, base: float) -> dict:
    """NLL increase and KL to bf16 with `blocks` at 3 bits, the rest bf16."""
    set_model_bits(model, {b: 3 for b in blocks})
    nll, kl = ev.measure(layer)
    set_model_bits(model, {b: None for b in blocks})
    return {"delta_nll": pooled(nll) - base, "kl": kl}


def correlations(rows: list[dict], keys) -> dict:
    """damage measure -> predictor -> Spearman rho."""
    return {target: {k: spearman([r[target] for r in rows], [r[k] for r in rows]) for k in keys}
            for target in ("delta_nll", "kl")}


def time_quantize(model_name: str, log) -> dict:
    from pagedweight.offline.quantize import quantize_model

    files = sorted((SHARED / "data" / "corpus").glob("*.calib.txt"))
    with tempfile.TemporaryDirectory() as out:
        started, cpu_started = time.perf_counter(), time.process_time()
        load_before = os.getloadavg()[0]
        quantize_model(SHARED / "models" / model_name, Path(out) / "m", files, log=log)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        meta = json.loads((Path(out) / "m" / "paged_model.json").read_text())
    # with one thread, cpu_seconds is about the wall time on an otherwise idle machine
    return {"model": model_name, "seconds": seconds, "cpu_seconds": cpu_seconds, "goal_seconds": 180,
            "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
            "calibration_tokens": meta["calibration"]["num_tokens"], "phases": meta["quantizer"]}


def quantize_into(model_name: str, out: Path, device: str, log) -> None:
    from pagedweight.offline.quantize import QuantizeConfig, quantize_model

    files = sorted((SHARED / "data" / "corpus").glob("*.calib.txt"))
    quantize_model(SHARED / "models" / model_name, out, files, QuantizeConfig(device=device), log=log)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def environment() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip() != ""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit, "dirty": dirty,
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "load_average": os.getloadavg(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny-mixtral", "tiny-qwen-moe"])
    parser.add_argument("--artifacts", default="/work/artifacts/paged")
    parser.add_argument("--max-tokens", type=int, default=4096, help="scored tokens per domain")
    parser.add_argument("--expert-tokens", type=int, default=1024, help="per domain, per-expert study")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--time-model", default="tiny-qwen-moe", help="'' to skip the timing")
    parser.add_argument("--device", default="cpu", help="where evaluation runs")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quantize-missing", action="store_true",
                        help="quantise models missing from --artifacts first (k-means on --device)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "quantize_eval.json"))
    args = parser.parse_args()
    # One thread by default: on the shared 2-core machine (load average 10+) two OpenMP
    # threads spin against each other and ran a forward 13x slower than one (measured).
    torch.set_num_threads(args.threads)
    report = {"benchmark": "quantize_eval", **stamp(), "environment": {**environment(), "threads": args.threads}, "dtype": "float32", "seq_len": args.seq_len,
              "device": device_name(args.device), "models": {}}
    if args.time_model:
        report["quantize_time"] = time_quantize(args.time_model, log)
        log(f"quantize {args.time_model}: {report['quantize_time']['seconds']:.1f} s")
    for name in args.models:
        path = Path(args.artifacts) / name
        if args.quantize_missing and not path.is_dir():
            quantize_into(name, path, args.device, log)
        report["models"][name] = evaluate_model(path, args.max_tokens, args.expert_tokens, args.seq_len, args.device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
