"""Evidence: perplexity of every planner policy at equal expert-weight budgets.

For each paged model (tiny-mixtral, tiny-qwen-moe) and each `valid` domain:
- the first PROMPT tokens of the domain's valid text are the "prompts now running": they
  are prefilled once (every block at 8 bits) and their routing feeds the routing moving
  average (started from calibration) as a steady stream of such traffic (four half-lives,
  prompt_context.steady_traffic_tokens), and the prompt-residual heads -> a PlanContext;
- the next EVAL tokens are scored (perplexity, windows of SEQ_LEN) under each policy's
  plan at budgets = bytes of the uniform 3, 3.5, 4 and 5-bit model (LUTs included).
Every policy gets the same context through the same interface; static ones ignore it.
The 8-bit plan's perplexity is the reference. Loss scales (loss_scale.py) are measured
first on SCALE_TOKENS tokens of each domain's *calib* text, never on valid text.

Prompt-mix experiment (pycode): pagedweight plans made with the code prompt's features,
against plans made without features (calibration statistics only), and against plans made
with another domain's (kjv) features, all evaluated on code.

Writes bench/results/planner_eval.json and docs/planner_eval.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.bench_meta import write_result
from pagedweight.common.paths import corpus_dir
from pagedweight.offline.perplexity import perplexity
from pagedweight.planner.artifact import load_planner_inputs
from pagedweight.offline.group_scales import measure_group_scales
from pagedweight.planner.loss_scale import GroupScales
from pagedweight.planner.policies import POLICY_NAMES, PlanContext, make_policy
from pagedweight.offline.prompt_routing import record_prompt_routing
from pagedweight.planner.prompt_context import (
    prompt_context, steady_traffic_tokens,
)
from pagedweight.frontend.tokenizer import Tokenizer
from pagedweight.model.dequantized_experts import build_paged_lm, set_model_bits
from pagedweight.format.paged_model import load_paged_model

REPO = Path(__file__).resolve().parents[1]
CORPUS = corpus_dir()
MODELS = ("tiny-mixtral", "tiny-qwen-moe")
DOMAINS = ("kjv", "pydoc", "pycode", "cheader")
WIDTHS = (3, 3.5, 4, 5)
ABLATIONS = ("no-routing", "no-residual", "no-sensitivity", "no-loss-scale")
SCALE_TOKENS = 256  # calibration tokens per domain for the loss scales (calib files, not valid)


class Evaluator:
    """One loaded paged model; perplexity of a bit plan on a token list, cached per plan."""

    def __init__(self, model_dir: Path, seq_len: int, sensitivity: str = "sensitivity"):
        self.inputs = load_planner_inputs(model_dir, sensitivity=sensitivity)
        self.table = self.inputs.table
        self.model = build_paged_lm(load_paged_model(model_dir, with_bf16=False), dtype=torch.float32)
        self.tokenizer = Tokenizer(str(model_dir))
        self.seq_len = seq_len
        self._cache: dict[tuple[str, bytes], float] = {}

    def ppl(self, bits: np.ndarray, ids: list[int], tag: str) -> float:
        key = (tag, np.asarray(bits, dtype=np.int8).tobytes())
        if key not in self._cache:
            self.set_bits(bits)
            self._cache[key] = perplexity(self.model, ids, self.seq_len).ppl
        return self._cache[key]

    def context(self, prompt_ids: list[int]) -> PlanContext:
        self.set_uniform(8)
        recorder = record_prompt_routing(self.model, prompt_ids, self.table.num_experts)
        return prompt_context(recorder, self.inputs, traffic_tokens=steady_traffic_tokens())

    def set_uniform(self, bits: int) -> None:
        set_model_bits(self.model, {b: bits for b in self.table.block_ids})

    def set_bits(self, bits: np.ndarray) -> None:
        set_model_bits(self.model, {b: int(v) for b, v in zip(self.table.block_ids, bits)})

    def loss_scales(self) -> GroupScales:
        windows = [self.tokenizer.encode((CORPUS / f"{d}.calib.txt").read_text())[:SCALE_TOKENS] for d in DOMAINS]
        return measure_group_scales(self.model, self.table, windows, self.set_bits)


def domain_tokens(evaluator: Evaluator, domain: str, prompt: int, num_eval: int):
    ids = evaluator.tokenizer.encode((CORPUS / f"{domain}.valid.txt").read_text())
    return ids[:prompt], ids[prompt : prompt + num_eval + 1]


def evaluate_model(name: str, args) -> dict:
    started = time.perf_counter()
    ev = Evaluator(Path(args.artifacts) / name, args.seq_len)
    scales = ev.loss_scales()
    log(f"{name}: loss scales measured in {time.perf_counter() - started:.0f} s")
    policies = {p: make_policy(p, ev.table, scales=scales) for p in POLICY_NAMES}
    result = {"num_blocks": ev.table.num_blocks, "loss_scales": scales.to_json(),
              "uniform_bytes": {str(b): ev.table.uniform_bytes(b) for b in (3, 3.5, 4, 5, 6, 8)},
              "domains": {}}
    contexts = {}
    for domain in DOMAINS:
        prompt_ids, eval_ids = domain_tokens(ev, domain, args.prompt_tokens, args.eval_tokens)
        contexts[domain] = context = ev.context(prompt_ids)
        row = {"prompt_tokens": len(prompt_ids), "eval_tokens": len(eval_ids) - 1,
               "ppl_8bit": ev.ppl(np.full(ev.table.num_blocks, 8), eval_ids, domain), "budgets": {}}
        for width in WIDTHS:
            budget = ev.table.uniform_bytes(width)
            cell = {}
            for pname, policy in policies.items():
                plan = policy.plan(budget, context)
                assert plan.num_bytes <= budget, (name, domain, width, pname)
                cell[pname] = {"ppl": ev.ppl(plan.bits, eval_ids, domain), "plan_bytes": plan.num_bytes,
                               "mean_bits": float(plan.bits.mean()), "floors_relaxed": plan.floors_relaxed}
            row["budgets"][str(width)] = {"budget_bytes": budget, "policies": cell}
            log(f"{name} {domain} {width}: " + " ".join(f"{p}={c['ppl']:.3f}" for p, c in cell.items()))
        result["domains"][domain] = row
    result["prompt_mix"] = prompt_mix(ev, policies["pagedweight"], contexts, args)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def prompt_mix(ev: Evaluator, policy, contexts: dict, args) -> dict:
    """Plans for code traffic: with code features, without features, with kjv features."""
    _, eval_ids = domain_tokens(ev, "pycode", args.prompt_tokens, args.eval_tokens)
    variants = {"code_features": contexts["pycode"], "no_features": PlanContext(),
                "kjv_features": contexts["kjv"]}
    out = {}
    for width in WIDTHS:
        budget = ev.table.uniform_bytes(width)
        out[str(width)] = {v: ev.ppl(policy.plan(budget, ctx).bits, eval_ids, "pycode") for v, ctx in variants.items()}
        log(f"prompt-mix {width}: {out[str(width)]}")
    return out


def summarise(results: dict) -> dict:
    """Mean ppl over domains per (model, width, policy), and the checks the issue asks for."""
    summary, checks = {}, []
    for name, res in results.items():
        summary[name] = {}
        for width in WIDTHS:
            w = str(width)
            means = {p: float(np.mean([res["domains"][d]["budgets"][w]["policies"][p]["ppl"] for d in DOMAINS]))
                     for p in POLICY_NAMES}
            summary[name][w] = means
            for other in ("uniform", "mxmoe", "dpllm") + ABLATIONS:
                checks.append({"model": name, "width": width, "against": other,
                               "pagedweight": means["pagedweight"], "other": means[other],
                               "beats": means["pagedweight"] < means[other],
                               "ties": bool(np.isclose(means["pagedweight"], means[other], rtol=1e-6))})
        summary[name]["avg_over_budgets"] = {
            p: float(np.mean([summary[name][str(w)][p] for w in WIDTHS])) for p in POLICY_NAMES}
    return {"mean_ppl": summary, "checks": checks}


def markdown(payload: dict) -> str:
    lines = ["# Planner evaluation: perplexity of each policy at equal expert-weight budgets", "",
             f"Measured {payload['date']}, {payload['machine']['cpu']} "
             f"({payload['machine']['cpu_count']} CPUs, shared). Command: `{payload['command']}`.", "",
             f"Per model and domain: {payload['prompt_tokens']} prompt tokens (the traffic the planner "
             f"sees), then {payload['eval_tokens']} scored tokens (windows of {payload['seq_len']}) of the "
             "domain's `valid` text. Budget = bytes of the uniform B-bit model, LUTs included. "
             "Lower is better; **bold** = best in the row. What the numbers say, where the full "
             "policy loses and why, and the noise band: "
             "docs/planner.md.", ""]
    for name, res in payload["results"].items():
        lines += [f"## {name}", "", "Mean perplexity over the four domains:", "",
                  "| budget | " + " | ".join(POLICY_NAMES) + " |", "|---" * (len(POLICY_NAMES) + 1) + "|"]
        for w in [str(x) for x in WIDTHS] + ["avg_over_budgets"]:
            means = payload["summary"]["mean_ppl"][name][w]
            best = min(means.values())
            cells = [f"**{means[p]:.3f}**" if np.isclose(means[p], best) else f"{means[p]:.3f}" for p in POLICY_NAMES]
            label = "mean" if w == "avg_over_budgets" else f"{w} bits"
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += ["", "Per domain (8-bit reference in brackets):", "",
                  "| domain | budget | " + " | ".join(POLICY_NAMES) + " |", "|---" * (len(POLICY_NAMES) + 2) + "|"]
        for d, row in res["domains"].items():
            for w, cell in row["budgets"].items():
                ppl = {p: cell["policies"][p]["ppl"] for p in POLICY_NAMES}
                best = min(ppl.values())
                cells = [f"**{ppl[p]:.3f}**" if np.isclose(ppl[p], best) else f"{ppl[p]:.3f}" for p in POLICY_NAMES]
                lines.append(f"| {d} ({row['ppl_8bit']:.3f}) | {w} | " + " | ".join(cells) + " |")
        lines += ["", "Prompt mix (pagedweight plans, evaluated on pycode):", "",
                  "| budget | code features | no features | kjv features |", "|---|---|---|---|"]
        for w, v in res["prompt_mix"].items():
            lines.append(f"| {w} bits | {v['code_features']:.3f} | {v['no_features']:.3f} | {v['kjv_features']:.3f} |")
        lines.append("")
    lines += ["## Checks (mean over domains)", "", "| model | budget | against | pagedweight | other | result |",
              "|---|---|---|---|---|---|"]
    for c in payload["summary"]["checks"]:
        verdict = "tie" if c["ties"] else ("beats" if c["beats"] else "**loses**")
        lines.append(f"| {c['model']} | {c['width']} | {c['against']} | {c['pagedweight']:.3f} | {c['other']:.3f} | {verdict} |")
    return "\n".join(lines) + "\n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--artifacts", default="/work/artifacts/paged", help="folder of paged models, one per name")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {name: evaluate_model(name, args) for name in args.models}
    payload = {"prompt_tokens": args.prompt_tokens, "eval_tokens": args.eval_tokens, "seq_len": args.seq_len,
               "widths": list(WIDTHS), "policies": list(POLICY_NAMES),
               "command": "python -m bench.planner_eval " + " ".join(sys.argv[1:]),
               "results": results, "summary": summarise(results)}
    path = write_result("planner_eval", payload)
    import json
    record = json.loads(path.read_text())
    (REPO / "docs" / "planner_eval.md").write_text(markdown(record))
    log(f"wrote {path} and docs/planner_eval.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
