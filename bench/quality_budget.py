"""The quality-vs-memory table: KL to bf16 and perplexity of every policy at expert-byte budgets.

For each shared model (paged artifacts made by `pagedweight quantize` with its defaults,
so the planner's loss scales are the artifact's) and each expert-byte budget of
20, 25, 30, 40, 50% of the bf16 experts' bytes (planes + LUTs count against it):
- per domain, the first PROMPT tokens of the domain's `valid` text are the traffic the
  planner sees (prefilled at 8 bits; routing + prompt residuals -> PlanContext), the next
  EVAL tokens are scored;
- each policy's plan is scored by the mean per-token KL(bf16 || plan) of the next-token
  distributions (the reference is the same model with the original bf16 experts, read from
  the source checkpoint) and by perplexity;
- a budget below the all-3-bit plan is reported infeasible (no plan fits it);
- the calibration check: pagedweight against uniform and uniform-plus-fill on CALIB tokens
  of each domain's `calib` text (the planner's own calibration data), KL to bf16.
Per budget also: bytes of the whole model (dense bf16 + expert plan) for each shared model,
and for the real-shape configs (Qwen1.5-MoE-A2.7B, Mixtral-8x7B) the whole model's bytes and
the KV tokens the bytes freed from bf16 experts buy (bf16 K and V, all layers).

Writes bench/results/quality_budget.json, docs/quality_budget.md, docs/quality_budget.png.
    python -m bench.quality_budget --artifacts DIR   # DIR/<model> from `pagedweight quantize`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.bench_meta import write_result
from pagedweight.common.paths import corpus_dir
from pagedweight.format.blocks import MIN_BITS, block_bytes
from pagedweight.format.paged_model import load_paged_model
from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits
from pagedweight.model.source_experts import attach_source_experts
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.offline.prompt_routing import record_prompt_routing
from pagedweight.planner.artifact import load_planner_inputs
from pagedweight.planner.policies import POLICY_NAMES, make_policy
from pagedweight.planner.prompt_context import prompt_context, steady_traffic_tokens

REPO = Path(__file__).resolve().parents[1]
MODELS = ("micro-mixtral", "tiny-mixtral", "tiny-qwen-moe")
DOMAINS = ("kjv", "pydoc", "pycode", "cheader")
FRACTIONS = (0.20, 0.25, 0.30, 0.40, 0.50)
BASELINES = ("uniform", "uniform-fill", "mxmoe", "dpllm")
ABLATIONS = ("no-routing", "no-residual", "no-sensitivity", "no-loss-scale", "no-guard")
# Real-shape configs for the memory columns (Hugging Face config fields that matter here).
REAL_SHAPES = {
    "Qwen1.5-MoE-A2.7B": {"vocab": 151936, "hidden": 2048, "layers": 24, "heads": 16, "kv_heads": 16,
                          "head_dim": 128, "experts": 60, "expert_inter": 1408, "shared_inter": 5632,
                          "tied": False},
    "Mixtral-8x7B": {"vocab": 32000, "hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8,
                     "head_dim": 128, "experts": 8, "expert_inter": 14336, "shared_inter": 0, "tied": False},
}


class Scorer:
    """One paged model with its bf16 experts; scores a plan by KL to bf16 and NLL."""

    def __init__(self, model_dir: Path):
        self.inputs = load_planner_inputs(model_dir)
        self.table = self.inputs.table
        paged = attach_source_experts(load_paged_model(model_dir, with_bf16=True))
        self.paged = paged
        self.model = build_paged_lm(paged, dtype=torch.float32)
        self.tokenizer = Tokenizer(str(model_dir))
        self._refs: dict[str, torch.Tensor] = {}

    def set_bits(self, bits: np.ndarray | None) -> None:
        """A plan's bits per block; None: every block at its original bf16 weights."""
        if bits is None:
            set_model_bits(self.model, {b: None for b in self.table.block_ids})
        else:
            set_model_bits(self.model, {b: int(v) for b, v in zip(self.table.block_ids, bits)})

    @torch.inference_mode()
    def log_probs(self, windows: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.model(windows[:, :-1]).float(), dim=-1)

    def reference(self, tag: str, windows: torch.Tensor) -> torch.Tensor:
        if tag not in self._refs:
            self.set_bits(None)
            self._refs[tag] = self.log_probs(windows)
        return self._refs[tag]

    def score(self, bits: np.ndarray, tag: str, windows: torch.Tensor) -> dict:
        ref = self.reference(tag, windows)
        self.set_bits(bits)
        lp = self.log_probs(windows)
        kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
        nll = float(F.nll_loss(lp.flatten(0, 1), windows[:, 1:].flatten()))
        return {"kl": kl, "ppl": float(np.exp(nll))}

    def bf16_ppl(self, tag: str, windows: torch.Tensor) -> float:
        ref = self.reference(tag, windows)
        return float(np.exp(float(F.nll_loss(ref.flatten(0, 1), windows[:, 1:].flatten()))))

    def context(self, prompt_ids: list[int]):
        self.set_bits(np.full(self.table.num_blocks, 8))
        recorder = record_prompt_routing(self.model, prompt_ids, self.table.num_experts)
        return prompt_context(recorder, self.inputs, traffic_tokens=steady_traffic_tokens())

    def bf16_expert_bytes(self) -> int:
        return int(sum(2 * r * c for r, c in self.shapes()))

    def shapes(self):
        meta = {b["key"]: (b["rows"], b["cols"]) for b in self.paged.meta["blocks"]}
        return [meta[b.key()] for b in self.table.block_ids]

    def dense_bytes(self) -> int:
        return int(sum(t.numel() * 2 for t in self.paged.dense_state.values()))


def windows_of(ids: list[int], length: int, count: int) -> torch.Tensor:
    """`count` windows of `length` scored tokens (length + 1 ids each), consecutive."""
    need = count * length + 1
    if len(ids) < need:
        raise SystemExit(f"text too short: {len(ids)} tokens, need {need}")
    return torch.tensor([ids[i * length: i * length + length + 1] for i in range(count)])


def evaluate_model(name: str, args) -> dict:
    started = time.perf_counter()
    sc = Scorer(Path(args.artifacts) / name)
    table = sc.table
    policies = {p: make_policy(p, table, scales=sc.inputs.scales) for p in POLICY_NAMES}
    bf16_bytes = sc.bf16_expert_bytes()
    min_bytes = table.uniform_bytes(MIN_BITS)
    budgets = {f: int(f * bf16_bytes) for f in FRACTIONS}
    result = {"scales": "artifact" if sc.inputs.scales is not None else "raw",
              "calibration_tokens": sc.paged.meta["calibration"]["num_tokens"],
              "bf16_expert_bytes": bf16_bytes, "dense_bytes": sc.dense_bytes(),
              "all_3_bit_bytes": min_bytes, "all_3_bit_fraction": min_bytes / bf16_bytes,
              "uniform_fraction": {str(b): table.uniform_bytes(b) / bf16_bytes for b in range(3, 9)},
              "budgets": {}, "domains": {}, "calib_check": {}}
    corpus = corpus_dir()
    for domain in DOMAINS:
        ids = sc.tokenizer.encode((corpus / f"{domain}.valid.txt").read_text())
        context = sc.context(ids[: args.prompt_tokens])
        windows = windows_of(ids[args.prompt_tokens:], args.seq_len, args.eval_tokens // args.seq_len)
        row = {"bf16_ppl": sc.bf16_ppl(domain, windows), "eval_tokens": int(windows[:, 1:].numel()),
               "budgets": {}}
        for f, budget in budgets.items():
            if budget < min_bytes:
                row["budgets"][str(f)] = None
                continue
            cell = {}
            for pname, policy in policies.items():
                plan = policy.plan(budget, context)
                assert plan.num_bytes <= budget, (name, domain, f, pname)
                cell[pname] = {**sc.score(plan.bits, domain, windows), "plan_bytes": plan.num_bytes,
                               "mean_bits": float(plan.bits.mean()), "action": plan.action}
            row["budgets"][str(f)] = cell
            log(f"{name} {domain} {f:.0%}: " + " ".join(f"{p}={c['kl']:.4f}" for p, c in cell.items()))
        result["domains"][domain] = row
    result["calib_check"] = calib_check(sc, policies, budgets, min_bytes, args)
    for f, budget in budgets.items():
        result["budgets"][str(f)] = {"expert_budget_bytes": budget, "feasible": budget >= min_bytes,
                                     "whole_model_bytes": sc.dense_bytes() + budget}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def calib_check(sc: Scorer, policies, budgets, min_bytes, args) -> dict:
    """pagedweight vs uniform / uniform-fill on the planner's own calibration text (KL)."""
    corpus = corpus_dir()
    ids = [sc.tokenizer.encode((corpus / f"{d}.calib.txt").read_text())[: args.calib_tokens + 1] for d in DOMAINS]
    windows = torch.tensor(ids)
    out = {"tokens": int(windows[:, 1:].numel())}
    for f, budget in budgets.items():
        if budget < min_bytes:
            continue
        out[str(f)] = {p: sc.score(policies[p].plan(budget).bits, "calib", windows)["kl"]
                       for p in ("pagedweight", "uniform", "uniform-fill")}
    return out


def real_shape_rows() -> dict:
    """Whole-model bytes and KV tokens bought by the freed expert bytes, per budget."""
    out = {}
    for name, c in REAL_SHAPES.items():
        H, L = c["hidden"], c["layers"]
        shapes = [(2 * c["expert_inter"], H), (H, c["expert_inter"])] * (L * c["experts"])
        expert_bf16 = sum(2 * r * cc for r, cc in shapes)
        attention = L * (H * c["heads"] * c["head_dim"] * 2 + H * c["kv_heads"] * c["head_dim"] * 2)
        shared = L * 3 * H * c["shared_inter"] + (L * H if c["shared_inter"] else 0)  # + its gate
        dense_params = (c["vocab"] * H * (1 if c["tied"] else 2) + attention + shared
                        + L * H * c["experts"] + L * 2 * H + H)  # router, norms
        kv_per_token = L * c["kv_heads"] * c["head_dim"] * 2 * 2  # K and V, bf16
        uniform = {str(b): sum(block_bytes(r, cc, b) for r, cc in shapes) / expert_bf16 for b in range(3, 9)}
        rows = {}
        for f in FRACTIONS:
            budget = int(f * expert_bf16)
            fits = [b for b in range(3, 9) if uniform[str(b)] <= f]
            rows[str(f)] = {"expert_budget_bytes": budget, "whole_model_bytes": 2 * dense_params + budget,
                            "freed_bytes": expert_bf16 - budget,
                            "kv_tokens_bought": (expert_bf16 - budget) // kv_per_token,
                            "largest_uniform_width": max(fits) if fits else None}
        out[name] = {"bf16_expert_bytes": expert_bf16, "dense_bytes": 2 * dense_params,
                     "kv_bytes_per_token": kv_per_token, "uniform_fraction": uniform, "budgets": rows}
    return out


def summarise(results: dict) -> dict:
    """Mean KL / ppl over domains per (model, budget, policy), and the targets' checks."""
    summary, checks = {}, []
    for name, res in results.items():
        summary[name] = {}
        for f in FRACTIONS:
            cells = [res["domains"][d]["budgets"][str(f)] for d in DOMAINS]
            if any(c is None for c in cells):
                summary[name][str(f)] = None
                continue
            summary[name][str(f)] = {p: {"kl": float(np.mean([c[p]["kl"] for c in cells])),
                                         "ppl": float(np.mean([c[p]["ppl"] for c in cells]))}
                                     for p in POLICY_NAMES}
            means = summary[name][str(f)]
            for other in BASELINES:
                checks.append({"model": name, "fraction": f, "against": other,
                               "pagedweight_kl": means["pagedweight"]["kl"], "other_kl": means[other]["kl"],
                               "beats": means["pagedweight"]["kl"] < means[other]["kl"]})
        feasible = [str(f) for f in FRACTIONS if summary[name][str(f)] is not None]
        summary[name]["avg_kl_over_budgets"] = {
            p: float(np.mean([summary[name][f][p]["kl"] for f in feasible])) for p in POLICY_NAMES}
        summary[name]["bf16_ppl"] = float(np.mean([res["domains"][d]["bf16_ppl"] for d in DOMAINS]))
    return {"mean": summary, "checks": checks}


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["results"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        mean = payload["summary"]["mean"][name]
        feasible = [f for f in FRACTIONS if mean[str(f)] is not None]
        for p in POLICY_NAMES:
            style = {"linewidth": 2.5, "color": "black"} if p == "pagedweight" else \
                {"linestyle": "--" if p in ABLATIONS else "-", "linewidth": 1.2}
            ax.plot([100 * f for f in feasible], [mean[str(f)][p]["kl"] for f in feasible],
                    marker="o", markersize=3, label=p, **style)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("expert bytes, % of bf16 (LUTs included)")
        ax.set_ylabel("mean KL to bf16 per token (nats)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(payload: dict) -> str:
    s = payload["summary"]["mean"]
    if payload.get("runs"):  # combined from runs side by side, one model each
        where = "Measured in runs side by side on " + "; ".join(
            f"`{r['command'].split('--models ')[-1].split()[0]}` {r['date']}"
            for r in payload["runs"])
    else:
        where = f"Measured {payload['date']}"
    lines = ["# Quality vs memory: KL to bf16 at expert-byte budgets", "",
             f"{where}, {payload['machine']['cpu']} ({payload['machine']['cpu_count']} CPUs, shared with "
             f"other work). Command: `{payload['command']}`. "
             f"Per domain: {payload['prompt_tokens']} prompt tokens (what the planner sees), then "
             f"{payload['eval_tokens']} scored tokens of the domain's `valid` text (windows of "
             f"{payload['seq_len']}). Budget: a fraction of the bf16 experts' bytes; plans count planes "
             "and LUTs. KL: mean per-token KL(bf16 || plan) of the next-token distribution, nats, mean "
             "over the four domains (lower is better, **bold** the best). `-` : the budget is below "
             "every block at 3 bits (no plan fits). Plot: docs/quality_budget.png. Numbers: "
             "bench/results/quality_budget.json. What the numbers say: docs/planner.md, section Measured.", ""]
    for name, res in payload["results"].items():
        lines += [f"## {name}", "",
                  f"bf16 experts {res['bf16_expert_bytes']:,} B, dense {res['dense_bytes']:,} B; every block "
                  f"at 3 bits = {res['all_3_bit_fraction']:.1%} of bf16; mean bf16 perplexity "
                  f"{s[name]['bf16_ppl']:.3f}; loss scales: {res['scales']}; artifact calibrated on "
                  f"{res.get('calibration_tokens', '?')} tokens.", "",
                  "| policy | " + " | ".join(f"{f:.0%}" for f in FRACTIONS) + " | mean |",
                  "|---" * (len(FRACTIONS) + 2) + "|"]
        best = {str(f): min(v["kl"] for v in s[name][str(f)].values()) if s[name][str(f)] else None
                for f in FRACTIONS}
        for p in POLICY_NAMES:
            cells = []
            for f in FRACTIONS:
                cell = s[name][str(f)]
                if cell is None:
                    cells.append("-")
                    continue
                text = f"{cell[p]['kl']:.4f} ({cell[p]['ppl']:.3f})"
                cells.append(f"**{text}**" if np.isclose(cell[p]["kl"], best[str(f)]) else text)
            lines.append(f"| {p} | " + " | ".join(cells) + f" | {s[name]['avg_kl_over_budgets'][p]:.4f} |")
        lines += ["", "Cells: KL (perplexity). Whole model bytes (dense + expert budget): " +
                  ", ".join(f"{f}: {b['whole_model_bytes']:,}" for f, b in res["budgets"].items()), ""]
        cc = res["calib_check"]
        lines += [f"Calibration check ({cc['tokens']} tokens of the `calib` files, KL): " +
                  "; ".join(f"{float(f):.0%} pagedweight {v['pagedweight']:.4f} / uniform {v['uniform']:.4f} / "
                            f"uniform-fill {v['uniform-fill']:.4f}" for f, v in cc.items() if f != "tokens"), ""]
    lines += ["## Real-shape memory", "",
              "| model | budget | largest uniform width | whole model bytes | freed expert bytes | KV tokens bought |",
              "|---|---|---|---|---|---|"]
    for name, r in payload["real_shapes"].items():
        for f, b in r["budgets"].items():
            lines.append(f"| {name} | {float(f):.0%} | {b['largest_uniform_width']} | {b['whole_model_bytes'] / 1e9:.2f} GB "
                         f"| {b['freed_bytes'] / 1e9:.2f} GB | {b['kv_tokens_bought']:,} |")
    lines += ["", f"KV bytes per token (bf16 K and V, all layers): " +
              ", ".join(f"{n} {r['kv_bytes_per_token']:,}" for n, r in payload["real_shapes"].items()),
              "", "## Checks (mean KL over domains)", "", "| model | budget | against | pagedweight | other | beats |",
              "|---|---|---|---|---|---|"]
    for c in payload["summary"]["checks"]:
        lines.append(f"| {c['model']} | {c['fraction']:.0%} | {c['against']} | {c['pagedweight_kl']:.4f} | "
                     f"{c['other_kl']:.4f} | {'yes' if c['beats'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", required=True, help="directory of paged models, one per --models name")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=512, help="scored tokens per domain")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--calib-tokens", type=int, default=128, help="per domain, for the calibration check")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-name", default="quality_budget")
    parser.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                        help="no measuring: merge the results of earlier runs (one model each, run "
                             "side by side) into one table, plot and JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.combine:
        parts = [json.loads(Path(f).read_text()) for f in args.combine]
        results = {name: res for part in parts for name, res in part["results"].items()}
        for name, res in results.items():  # runs older than this field: read it from the artifact
            if "calibration_tokens" not in res and (Path(args.artifacts) / name).is_dir():
                meta = json.loads((Path(args.artifacts) / name / "paged_model.json").read_text())
                res["calibration_tokens"] = meta["calibration"]["num_tokens"]
        payload = {k: parts[0][k] for k in ("prompt_tokens", "eval_tokens", "seq_len", "calib_tokens")}
        payload["command"] = " ; ".join(p["command"] for p in parts)
        payload["runs"] = [{k: p[k] for k in ("date", "machine", "commit", "command")} for p in parts]
    else:
        results = {name: evaluate_model(name, args) for name in args.models}
        payload = {"prompt_tokens": args.prompt_tokens, "eval_tokens": args.eval_tokens,
                   "seq_len": args.seq_len, "calib_tokens": args.calib_tokens,
                   "command": "python -m bench.quality_budget " + " ".join(sys.argv[1:])}
    payload.update({"fractions": list(FRACTIONS), "policies": list(POLICY_NAMES), "results": results,
                    "real_shapes": real_shape_rows(), "summary": summarise(results)})
    path = write_result(args.out_name, payload)
    record = json.loads(path.read_text())
    (REPO / "docs" / f"{args.out_name}.md").write_text(markdown(record))
    plot(record, REPO / "docs" / f"{args.out_name}.png")
    log(f"wrote {path}, docs/{args.out_name}.md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
