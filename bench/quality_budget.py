"""The quality table: KL to bf16 and perplexity of every policy at budgets in mean plane bits
(docs/quality.md and docs/quality.png, rendered whole from the result).

A budget of b bits caps a plan's bit planes at b x weights / 8 bytes (the fp16 LUTs reported
beside, not charged). Per domain the planner sees the first `--prompt-tokens` of the `valid`
text (prefilled at 8 bits) and the next `--eval-tokens` are scored in chunks. Differences are
paired over the same chunks; a model's value is the mean over its domains, its standard error
from the chunks' spread; the mean over models has standard error sqrt(sum se^2) / models;
95% CI = +-1.96 se.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.bench_meta import REPO, arg_parser, log, md_header, md_row, pyplot, save_figure, write_result
from pagedweight.common.paths import corpus_dir
from pagedweight.format.blocks import MIN_BITS
from pagedweight.format.paged_model import load_paged_model
from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits
from pagedweight.model.source_experts import attach_source_experts
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.offline.perplexity import token_windows
from pagedweight.offline.prompt_routing import record_prompt_routing
from pagedweight.planner.artifact import load_planner_inputs
from pagedweight.planner.policies import POLICY_NAMES, PlanContext, make_policy
from pagedweight.planner.prompt_context import prompt_context, steady_traffic_tokens

MODELS = ("micro-mixtral", "tiny-mixtral", "tiny-qwen-moe", "tiny-gemma4-moe")
DOMAINS = ("kjv", "pydoc", "pycode", "cheader")
BITS = (3.0, 3.5, 4.0, 5.0, 6.0)  # budgets, mean plane bits over the expert weights
PLANNER = "pagedweight"
ABLATIONS = ("no-sensitivity", "no-routing", "no-residual", "no-guard", "no-loss-scale")
# perplexity over bf16 the planner must stay within, mean over models
TARGETS = {4.0: 0.010, 5.0: 0.003}
Z95 = 1.96


class Scorer:
    """One paged model with its bf16 experts; scores a plan per chunk by KL to bf16 and NLL."""

    def __init__(self, model_dir: Path):
        self.inputs = load_planner_inputs(model_dir)
        self.table = self.inputs.table  # bytes with LUTs, as the worker charges them
        self.paged = attach_source_experts(load_paged_model(model_dir, with_bf16=True))
        self.model = build_paged_lm(self.paged, dtype=torch.float32)
        self.tokenizer = Tokenizer(str(model_dir))
        meta = {b["key"]: (b["rows"], b["cols"]) for b in self.paged.meta["blocks"]}
        shapes = [meta[b.key()] for b in self.table.block_ids]
        self.plane_table = self.table.planes_only(shapes)  # what budgets are stated in
        self.weights = np.array([r * c for r, c in shapes], dtype=np.int64)
        self.bf16_expert_bytes = int(2 * self.weights.sum())
        self._refs: dict[str, torch.Tensor] = {}
        self._scores: dict[tuple[str, bytes], dict] = {}

    def set_bits(self, bits: np.ndarray | None) -> None:
        """A plan's bits per block; None: every block at its original bf16 weights."""
        ids = self.table.block_ids
        set_model_bits(self.model, dict(zip(ids, [None] * len(ids) if bits is None else map(int, bits))))

    @torch.inference_mode()
    def log_probs(self, windows: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.model(windows[:, :-1]).float(), dim=-1)

    def reference(self, tag: str, windows: torch.Tensor) -> torch.Tensor:
        if tag not in self._refs:
            self.set_bits(None)
            self._refs[tag] = self.log_probs(windows)
        return self._refs[tag]

    def chunk_nll(self, lp: torch.Tensor, windows: torch.Tensor) -> list[float]:
        nll = -lp.gather(-1, windows[:, 1:, None])[..., 0]
        return nll.mean(1).tolist()

    def kl(self, bits: np.ndarray, tag: str, windows: torch.Tensor) -> float:
        """Mean KL(bf16 || plan) per token over all the windows."""
        return float(np.mean(self.score_chunks(bits, tag, windows)["kl"]))

    def score_chunks(self, bits: np.ndarray, tag: str, windows: torch.Tensor) -> dict:
        """Per window (chunk): mean KL(bf16 || plan) and mean NLL; a plan scored before on
        the same windows is not run again."""
        key = (tag, np.asarray(bits, dtype=np.int8).tobytes())
        if key not in self._scores:
            ref = self.reference(tag, windows)
            self.set_bits(bits)
            lp = self.log_probs(windows)
            kl = (ref.exp() * (ref - lp)).sum(-1).mean(1)
            self._scores[key] = {"kl": kl.tolist(), "nll": self.chunk_nll(lp, windows)}
        return self._scores[key]

    def context(self, prompt_ids: list[int]) -> PlanContext:
        self.set_bits(np.full(self.table.num_blocks, 8))
        recorder = record_prompt_routing(self.model, prompt_ids, self.table.num_experts)
        return prompt_context(recorder, self.inputs, traffic_tokens=steady_traffic_tokens())

    def plane_budget(self, bits: float) -> int:
        """Plane bytes of `bits` mean plane bits over every expert weight."""
        return int(bits * int(self.weights.sum()) // 8)


def windows_of(ids: list[int], length: int, count: int) -> torch.Tensor:
    """`count` windows of `length` scored tokens (length + 1 ids each), consecutive."""
    if len(ids) < count * length + 1:
        raise SystemExit(f"text too short: {len(ids)} tokens, need {count * length + 1}")
    return torch.tensor(token_windows(ids, length, count * length))


def plan_cell(sc: Scorer, plan) -> dict:
    """What a plan costs: mean plane bits, plane bytes, and the LUT bytes it also needs."""
    with_luts = sc.table.bytes_of(plan.bits)
    planes = sc.plane_table.bytes_of(plan.bits)
    return {"mean_bits": float((sc.weights * plan.bits).sum() / sc.weights.sum()), "plane_bytes": planes,
            "lut_bytes": with_luts - planes, "bytes_fraction": with_luts / sc.bf16_expert_bytes, "action": plan.action}


def evaluate_model(name: str, args, policies_names=POLICY_NAMES, bits_list=BITS, domains=DOMAINS,
                   model_dir: Path | None = None) -> dict:
    started = time.perf_counter()
    sc = Scorer(model_dir or Path(args.artifacts) / name)
    policies = {p: make_policy(p, sc.plane_table, scales=sc.inputs.scales) for p in policies_names}  # plane bytes
    meta_calib = sc.paged.meta["calibration"]
    result = {"scales": "artifact" if sc.inputs.scales is not None else "raw",
              "calibration_tokens": meta_calib["num_tokens"],
              "calibration_files": [Path(f["name"] if isinstance(f, dict) and "name" in f else str(f)).name
                                    for f in meta_calib.get("files", [])],
              "weights": int(sc.weights.sum()), "bf16_expert_bytes": sc.bf16_expert_bytes,
              "dense_bytes": int(sum(t.numel() * 2 for t in sc.paged.dense_state.values())),
              "budgets": {str(b): {"plane_budget_bytes": sc.plane_budget(b)} for b in bits_list},
              "domains": {}}
    for domain in domains:
        ids = sc.tokenizer.encode((corpus_dir() / f"{domain}.valid.txt").read_text())
        context = sc.context(ids[: args.prompt_tokens])
        windows = windows_of(ids[args.prompt_tokens:], args.seq_len, args.eval_tokens // args.seq_len)
        row = {"bf16_nll": sc.chunk_nll(sc.reference(domain, windows), windows),
               "eval_tokens": int(windows[:, 1:].numel()), "bits": {}}
        for b in bits_list:
            budget = sc.plane_budget(b)
            cell = {}
            for pname, policy in policies.items():
                plan = policy.plan(budget, context)
                assert sc.plane_table.bytes_of(plan.bits) <= budget, (name, domain, b, pname)
                cell[pname] = {**plan_cell(sc, plan), **sc.score_chunks(plan.bits, domain, windows)}
            row["bits"][str(b)] = cell
            log(f"{name} {domain} {b} bits: " + " ".join(f"{p}={np.mean(c['kl']):.4f}" for p, c in cell.items())
                + f" ({time.perf_counter() - started:.0f}s)")
        result["domains"][domain] = row
    if args.calib_tokens and {PLANNER, "uniform", "uniform-fill"} <= set(policies):
        result["calib_check"] = calib_check(sc, policies, bits_list, args)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def calib_check(sc: Scorer, policies, bits_list, args) -> dict:
    """pagedweight vs uniform / uniform-fill on the planner's own calibration text (KL)."""
    ids = [sc.tokenizer.encode((corpus_dir() / f"{d}.calib.txt").read_text())[: args.calib_tokens + 1] for d in DOMAINS]
    windows = torch.tensor(ids)
    out = {"tokens": int(windows[:, 1:].numel())}
    for b in bits_list:
        out[str(b)] = {p: sc.kl(policies[p].plan(sc.plane_budget(b)).bits, "calib", windows)
                       for p in (PLANNER, "uniform", "uniform-fill")}
    return out


# ---- statistics -------------------------------------------------------------------------------
def domain_mean(chunks: list[np.ndarray]) -> tuple[float, float]:
    """Mean over domains (weighted equally) of each domain's chunk mean, and its standard error
    from the chunks' spread (chunks independent)."""
    means = [float(np.mean(c)) for c in chunks]
    var = [float(np.var(c, ddof=1)) / len(c) if len(c) > 1 else 0.0 for c in chunks]
    return float(np.mean(means)), math.sqrt(sum(var)) / len(chunks)


def combine(stats: list[tuple[float, float]]) -> dict:
    """Mean over models of (mean, se) pairs, models independent: mean, se, 95% interval."""
    mean = float(np.mean([m for m, _ in stats]))
    se = math.sqrt(sum(s * s for _, s in stats)) / len(stats)
    return {"mean": mean, "se": se, "low": mean - Z95 * se, "high": mean + Z95 * se}


def as_ppl_change(interval: dict) -> dict:
    """A difference of mean log-perplexity -> the relative change of perplexity (exp - 1)."""
    return {k: (math.expm1(v) if k != "se" else v) for k, v in interval.items()}


def chunks(result: dict, bits: str, policy: str, metric: str, domains=DOMAINS) -> list[np.ndarray]:
    return [np.asarray(result["domains"][d]["bits"][bits][policy][metric]) for d in domains]


def paired(result: dict, bits: str, a: str, b: str, metric: str, domains=DOMAINS) -> tuple[float, float]:
    """Policy a minus policy b, paired over the same chunks: (mean over domains, se)."""
    return domain_mean([x - y for x, y in zip(chunks(result, bits, a, metric, domains),
                                               chunks(result, bits, b, metric, domains))])


def vs_bf16(result: dict, bits: str, policy: str, domains=DOMAINS) -> tuple[float, float]:
    """Mean NLL of the plan minus bf16's, paired over chunks: log of the perplexity ratio."""
    return domain_mean([np.asarray(p) - np.asarray(result["domains"][d]["bf16_nll"])
                        for d, p in zip(domains, chunks(result, bits, policy, "nll", domains))])


def summarise(results: dict, bits_list=BITS, policies=POLICY_NAMES, domains=DOMAINS) -> dict:
    """Per model and mean over models: KL and perplexity change of every policy; the planner
    minus every other policy, paired; and the targets' checks."""
    names = list(results)
    per_model, mean, versus = {}, {}, {}
    for b in map(str, bits_list):
        per_model[b], mean[b], versus[b] = {}, {}, {}
        for p in policies:
            kl = [domain_mean(chunks(results[n], b, p, "kl", domains)) for n in names]
            dppl = [vs_bf16(results[n], b, p, domains) for n in names]
            cells = [[results[n]["domains"][d]["bits"][b][p] for d in domains] for n in names]
            per_model[b][p] = {n: {"kl": k[0], "ppl_change": math.expm1(v[0]),
                                   "mean_bits": float(np.mean([c["mean_bits"] for c in cs])),
                                   "bytes_fraction": float(np.mean([c["bytes_fraction"] for c in cs]))}
                               for n, k, v, cs in zip(names, kl, dppl, cells)}
            mean[b][p] = {"kl": combine(kl), "ppl_change": as_ppl_change(combine(dppl)),
                          "bytes_fraction": float(np.mean([per_model[b][p][n]["bytes_fraction"] for n in names])),
                          "mean_bits": float(np.mean([per_model[b][p][n]["mean_bits"] for n in names]))}
            if p != PLANNER and PLANNER in policies:
                versus[b][p] = {"kl": combine([paired(results[n], b, PLANNER, p, "kl", domains) for n in names]),
                                "log_ppl": combine([paired(results[n], b, PLANNER, p, "nll", domains)
                                                    for n in names])}
    checks = []
    for b, limit in TARGETS.items():
        if str(b) in mean and PLANNER in policies:
            got = mean[str(b)][PLANNER]["ppl_change"]
            checks.append({"check": f"perplexity <= +{limit:.1%} of bf16 at {b} bits", "bits": b,
                           "value": got["mean"], "high": got["high"], "met": got["mean"] <= limit})
    for b in versus:
        if float(b) == MIN_BITS:  # every policy's one plan: every block at the narrowest width
            continue
        for p, v in versus[b].items():
            if p in ("uniform", "mxmoe", "dpllm") or p in ABLATIONS:
                checks.append({"check": f"planner better than {p} (KL, CI below 0)", "against": p,
                               "bits": float(b), "value": v["kl"]["mean"], "high": v["kl"]["high"],
                               "met": v["kl"]["high"] < 0})
    guard = {b: {"guard_plans": sum(results[n]["domains"][d]["bits"][b][PLANNER].get("action") == "uniform-guard"
                                    for n in names for d in domains),
                 "plans": len(names) * len(domains)} for b in map(str, bits_list)} if PLANNER in policies else {}
    return {"models": names, "per_model": per_model, "mean": mean, "versus": versus, "checks": checks,
            "guard": guard}


# ---- report -----------------------------------------------------------------------------------
def plot(payload: dict, path: Path) -> None:
    plt = pyplot()
    s = payload["summary"]
    names = s["models"]
    bits = [float(b) for b in s["mean"]]
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4.2 * (len(names) + 1), 4), squeeze=False)
    for ax, name in zip(axes[0], ["mean over models"] + names):
        for p in payload["policies"]:
            style = {"linewidth": 2.5, "color": "black"} if p == PLANNER else \
                {"linestyle": "--" if p in ABLATIONS else "-", "linewidth": 1.2}
            if name == "mean over models":
                y = np.array([s["mean"][str(b)][p]["kl"]["mean"] for b in bits])
                err = np.array([Z95 * s["mean"][str(b)][p]["kl"]["se"] for b in bits])
                ax.errorbar(bits, y, yerr=err, marker="o", markersize=3, capsize=2, label=p, **style)
            else:
                ax.plot(bits, [s["per_model"][str(b)][p][name]["kl"] for b in bits], marker="o", markersize=3,
                        label=p, **style)
        ax.set_yscale("log")
        ax.set(title=name, xlabel="budget, mean plane bits (LUTs not charged)", ylabel="KL to bf16 per token (nats)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def fmt_interval(v: dict, scale: float = 1.0, digits: int = 2) -> str:
    return f"{v['mean'] * scale:+.{digits}f} [{v['low'] * scale:+.{digits}f}, {v['high'] * scale:+.{digits}f}]"


def kl_cell(cell: dict) -> str:
    """KL x 1000 (perplexity change, %) of one policy at one budget."""
    return f"{1000 * cell['kl']:.2f} ({100 * cell['ppl_change']:+.2f}%)"


def markdown(payload: dict) -> str:
    s = payload["summary"]
    bits = list(s["mean"])
    head = md_header("policy", *(f"{b} bits" for b in bits))
    others = [q for q in payload["policies"] if q != PLANNER]
    lines = ["# Quality at budgets in mean plane bits", "",
             f"Models: {', '.join(s['models'])}. Per domain ({', '.join(payload['domains'])}): "
             f"{payload['prompt_tokens']} prompt tokens of the domain's `valid` text (what the planner "
             f"sees), then {payload['eval_tokens']} scored tokens in chunks of {payload['seq_len']}. "
             "A budget of b bits: the plan's bit planes may not exceed b x (expert weights) / 8 bytes; "
             "the fp16 LUTs a plan needs are not charged, their bytes are reported beside it. At 3.0 "
             "every policy has one plan, every block at 3 bits; at 3.5 `uniform` is the widest single "
             "width that fits (3 bits) and only mixed plans reach the budget. KL: mean per-token "
             "KL(bf16 || plan) of the next-token distribution, nats. 95% confidence intervals from "
             "chunk-paired differences (bench/quality_budget.py says how). `pagedweight` plans with "
             "the prompts' residuals; the worker's default leaves them off (`--prompt-residuals` turns "
             "them on: docs/calibration.md), so it plans as the `no-residual` row. Numbers: "
             "bench/results/quality_budget_cpu.json; plot: quality.png; how they were made: the "
             "last section.", "",
             "![KL to bf16 by budget](quality.png)", "",
             "## Mean over models", "",
             "KL x 1000 (perplexity change against bf16, %); **bold**: the lowest KL at that budget.", "", *head]
    for p in payload["policies"]:
        cells = []
        for b in bits:
            c = s["mean"][b][p]
            text = kl_cell({"kl": c["kl"]["mean"], "ppl_change": c["ppl_change"]["mean"]})
            best = np.isclose(c["kl"]["mean"], min(v["kl"]["mean"] for v in s["mean"][b].values()))
            cells.append(f"**{text}**" if best else text)
        lines.append(md_row(p, *cells))
    lines.append(md_row("bytes with LUTs, % of bf16 (planner)",
                        *(f"{100 * s['mean'][b][PLANNER]['bytes_fraction']:.1f}%" for b in bits)))
    lines += ["", "## Planner minus each other policy, mean over models", "",
              "KL x 1000, mean [95% CI]; below zero: the planner's plan is closer to bf16.", "", *head]
    lines += [md_row(p, *(fmt_interval(s["versus"][b][p]["kl"], 1000) for b in bits)) for p in others]
    lines += ["", "Log-perplexity x 1000, mean [95% CI]:", "", *head]
    lines += [md_row(p, *(fmt_interval(s["versus"][b][p]["log_ppl"], 1000) for b in bits)) for p in others]
    lines += ["", "Planner perplexity change against bf16, %, mean [95% CI]: " + "; ".join(
        f"{b} bits {fmt_interval(s['mean'][b][PLANNER]['ppl_change'], 100)}" for b in bits), "",
        "## Targets", "", *md_header("target", "value", "95% CI", "met")]
    for c in (c for c in s["checks"] if c["check"].startswith("perplexity")):
        ppl = s["mean"][str(c["bits"])][PLANNER]["ppl_change"]
        lines.append(md_row(c["check"], f"{100 * c['value']:+.2f}%", f"[{100 * ppl['low']:+.2f}%, "
                            f"{100 * ppl['high']:+.2f}%]", "yes" if c["met"] else "**no**"))
    beats = [c for c in s["checks"] if "against" in c]
    checked = list(dict.fromkeys(str(c["bits"]) for c in beats))
    lines += ["", "The planner better than each policy, mean over models (KL, the 95% CI of the paired "
              "difference below zero); 3.0 bits is left out, every policy's one plan being every block "
              "at 3 bits:", "", *md_header("against", *(f"{b} bits" for b in checked))]
    for p in dict.fromkeys(c["against"] for c in beats):
        met = {str(c["bits"]): c["met"] for c in beats if c["against"] == p}
        lines.append(md_row(p, *("yes" if met[b] else "**no**" for b in checked)))
    if s.get("guard"):
        lines += ["", "Held-out plans where the uniform guard chose uniform-plus-fill (`no-guard` differs "
                  "from the planner only there): " + ", ".join(
                      f"{b} bits {g['guard_plans']} of {g['plans']}" for b, g in s["guard"].items()) + "."]
    return "\n".join(lines + model_sections(payload, head) + how_measured(payload)) + "\n"


def model_sections(payload: dict, head: list[str]) -> list[str]:
    """One section per model: its policies' KL at every budget and its calibration check."""
    s = payload["summary"]
    bits = list(s["mean"])
    lines = []
    for name in s["models"]:
        res = payload["results"][name]
        lines += ["", f"## {name}", "",
                  f"{res['weights']:,} expert weights (bf16 {res['bf16_expert_bytes']:,} B), dense "
                  f"{res['dense_bytes']:,} B; loss scales: {res['scales']}; calibrated on "
                  f"{res['calibration_tokens']:,} tokens. KL x 1000 (perplexity change, %):", "", *head]
        lines += [md_row(p, *(kl_cell(s["per_model"][b][p][name]) for b in bits)) for p in payload["policies"]]
        lines.append(md_row("bytes with LUTs, % of bf16 (planner)",
                            *(f"{100 * s['per_model'][b][PLANNER][name]['bytes_fraction']:.1f}%" for b in bits)))
        cc = res.get("calib_check")
        if cc:
            lines += ["", f"Calibration check ({cc['tokens']} tokens of the `calib` files, KL x 1000, "
                      "pagedweight / uniform / uniform-fill): " + "; ".join(
                          f"{b} bits {1000 * v[PLANNER]:.2f} / {1000 * v['uniform']:.2f} / "
                          f"{1000 * v['uniform-fill']:.2f}" for b, v in cc.items() if b != "tokens")]
    return lines


def how_measured(payload: dict) -> list[str]:
    """The closing section of a generated page: the machine and the commands that made its
    numbers (one per model when runs side by side were combined); dates stay in the JSON."""
    runs = payload.get("runs") or [payload]
    machine = payload["machine"]
    return ["", "## How these numbers were made", "",
            f"On {machine['cpu']} ({machine['cpu_count']} CPUs, shared with other work), "
            + ("in runs side by side, combined with `--combine`:" if len(runs) > 1 else "with:"), "",
            "```", *(r["command"] for r in runs), "```"]


def add_eval_args(parser, out_name: str) -> None:
    """The scoring's flags, the result's name and --combine: what this and calibration_quality take."""
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=1024, help="scored tokens per domain")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per scored chunk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-name", default=out_name)
    parser.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                        help="no measuring: merge the results of earlier runs (e.g. one model each, run side by side)")


def measured(args, measure, module: str) -> tuple[dict, dict]:
    """The results by model, measured now (`measure(model)`) or merged from earlier runs with
    --combine (a model's parts may come from several), and the payload's head: the scoring's
    settings and the commands that made it."""
    if not args.combine:
        return {m: measure(m) for m in args.models}, {
            "prompt_tokens": args.prompt_tokens, "eval_tokens": args.eval_tokens, "seq_len": args.seq_len,
            "calib_tokens": args.calib_tokens, "command": f"python -m bench.{module} " + " ".join(sys.argv[1:])}
    parts = [json.loads(Path(f).read_text()) for f in args.combine]
    results: dict = {}
    for part in parts:
        for m, r in part["results"].items():
            results.setdefault(m, {}).update(r)
    return results, {**{k: parts[0].get(k) for k in ("prompt_tokens", "eval_tokens", "seq_len", "calib_tokens")},
                     "command": " ; ".join(p["command"] for p in parts),
                     "runs": [{k: p[k] for k in ("date", "machine", "commit", "command")} for p in parts]}


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--artifacts", required=True, help="directory of paged models, one per --models name")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    add_eval_args(parser, "quality_budget")
    parser.add_argument("--calib-tokens", type=int, default=256, help="per domain, for the calibration check")
    parser.add_argument("--docs-name", default="quality", help="the figure: docs/NAME.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results, payload = measured(args, lambda name: evaluate_model(name, args), "quality_budget")
    results = {name: results[name] for name in MODELS if name in results}
    payload.update({"bits": list(BITS), "domains": list(DOMAINS), "policies": list(POLICY_NAMES),
                    "targets": {str(b): v for b, v in TARGETS.items()}, "results": results,
                    "summary": summarise(results)})
    path = write_result(args.out_name, payload)
    plot(json.loads(path.read_text()), REPO / "docs" / f"{args.docs_name}.png")
    log(f"wrote {path} and docs/{args.docs_name}.png (`python -m bench tables` renders docs/quality.md from it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
