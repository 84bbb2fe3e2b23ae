"""What the calibration text does to held-out quality: prompt residuals under domain shift, and
the calibration defaults (docs/calibration.md, rendered whole from the result).

Artifacts: DIR/<model>/<variant>, each from `pagedweight quantize` with one calibration: `all-<T>`
(the four domains' `calib` files, T tokens each) or `<domain>-<T>` (one domain's), e.g.
`--out DIR/M/kjv-16384 --calib data/corpus/kjv.calib.txt --calib-tokens 16384`. Each is scored
as in quality_budget. Domain shift: an artifact calibrated on one domain serves the other three,
planner minus no-residual, paired; defaults: each variant minus `all-16384`, paired.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench.bench_meta import arg_parser, log, md_header, md_row, write_result
from bench.quality_budget import (DOMAINS, PLANNER, add_eval_args, as_ppl_change, chunks, combine, domain_mean,
                                  evaluate_model, fmt_interval, how_measured, measured, paired, vs_bf16)

POLICIES = (PLANNER, "no-residual", "uniform")
BITS = (3.5, 4.0, 5.0)
DEFAULT_VARIANT = "all-16384"


def variant_domains(variant: str) -> tuple[str, ...]:
    """The domains a variant was calibrated on ("all-16384" -> all four, "kjv-16384" -> kjv)."""
    which = variant.rsplit("-", 1)[0]
    if which == "all":
        return DOMAINS
    if which not in DOMAINS:
        raise ValueError(f"variant {variant!r}: expected all-<tokens> or <domain>-<tokens>")
    return (which,)


def variant_tokens(variant: str) -> int:
    return int(variant.rsplit("-", 1)[1])


def summarise(results: dict) -> dict:
    """results[model][variant]: evaluate_model's result on all four domains."""
    models = list(results)
    out = {"shift": {}, "defaults": {}}
    for b in map(str, BITS):
        pairs = [(m, v) for m in models for v in results[m] if len(variant_domains(v)) == 1]
        if pairs:
            rows = {f"{m} {v}": {
                metric: paired(results[m][v], b, PLANNER, "no-residual", metric,
                               [d for d in DOMAINS if d not in variant_domains(v)])
                for metric in ("kl", "nll")} for m, v in pairs}
            out["shift"][b] = {"pairs": {k: {m: {"mean": x[0], "se": x[1]} for m, x in r.items()}
                                         for k, r in rows.items()},
                               "kl": combine([r["kl"] for r in rows.values()]),
                               "log_ppl": combine([r["nll"] for r in rows.values()])}
        labels = {}
        for m in models:
            for v in results[m]:
                label = v if len(variant_domains(v)) > 1 else f"one-domain-{variant_tokens(v)}"
                labels.setdefault(label, []).append((m, v))
        cell = {}
        for label, members in sorted(labels.items(), key=lambda kv: (kv[0].startswith("one"),
                                                                      variant_tokens(kv[0]))):
            row = {"tokens_per_file": variant_tokens(label), "artifacts": len(members),
                   "models": sorted({m for m, _ in members})}
            for p in POLICIES:
                row[p] = {"kl": combine([domain_mean(chunks(results[m][v], b, p, "kl")) for m, v in members]),
                          "ppl_change": as_ppl_change(combine([vs_bf16(results[m][v], b, p) for m, v in members]))}
            if label != DEFAULT_VARIANT and all(DEFAULT_VARIANT in results[m] for m, _ in members):
                row["minus_default_kl"] = combine([_cross(results[m][v], results[m][DEFAULT_VARIANT], b)
                                                   for m, v in members])
            cell[label] = row
        out["defaults"][b] = cell
    return out


def _cross(a: dict, base: dict, bits: str) -> tuple[float, float]:
    """The planner's KL of artifact a minus artifact base, paired over the same chunks."""
    return domain_mean([x - y for x, y in zip(chunks(a, bits, PLANNER, "kl"), chunks(base, bits, PLANNER, "kl"))])


def markdown(payload: dict) -> str:
    s = payload["summary"]
    bits = list(s["defaults"])
    lines = ["# Calibration and held-out quality", "",
             f"Models: {', '.join(payload['results'])}. Scoring as in quality.md: {payload['prompt_tokens']} prompt "
             f"tokens, then {payload['eval_tokens']} scored tokens per domain in chunks of {payload['seq_len']}; "
             "budgets in mean plane bits. Numbers: bench/results/calibration_quality_cpu.json; the script: "
             "bench/calibration_quality.py; how they were made: the last section.", "",
             "## Prompt residuals under domain shift", "",
             "Each artifact calibrated on one domain serves the other three. Planner minus the planner "
             "without prompt residuals, mean over models and calibration domains [95% CI]; below zero: "
             "residuals help.", "",
             *md_header("bits", "KL x 1000", "log-perplexity x 1000")]
    shift = s["shift"]
    lines += [md_row(b, fmt_interval(shift[b]["kl"], 1000, 3), fmt_interval(shift[b]["log_ppl"], 1000, 3))
              for b in bits if b in shift]
    lines += ["", "Per model and calibration domain (KL x 1000, mean ± 1.96 se):", "",
              *md_header("model, calibrated on", *(f"{b} bits" for b in bits))]
    for k in (list(next(iter(shift.values()))["pairs"]) if shift else []):
        kl = [shift[b]["pairs"][k]["kl"] for b in bits]
        lines.append(md_row(k, *(f"{1000 * x['mean']:+.3f} ± {1000 * 1.96 * x['se']:.3f}" for x in kl)))
    lines += ["", "## Calibration tokens and domains", "",
              "The planner on all four domains' held-out text, mean over the row's models: KL x 1000 [95% CI], "
              "perplexity change against bf16 (%), and KL x 1000 minus the default's (all four domains, "
              f"{variant_tokens(DEFAULT_VARIANT)} tokens each), paired. one-domain: the four artifacts "
              "each calibrated on one domain, pooled.", ""]
    for b in bits:
        lines += [f"### {b} bits", "", *md_header("calibration", "tokens (files x per file)", "models",
                                                  "planner KL x 1000", "perplexity change",
                                                  "minus default, KL x 1000", "uniform KL x 1000")]
        for label, row in s["defaults"][b].items():
            minus = fmt_interval(row["minus_default_kl"], 1000, 3) if "minus_default_kl" in row else "-"
            files = 1 if label.startswith("one-domain") else len(DOMAINS)
            lines.append(md_row(label.rsplit("-", 1)[0], f"{files} x {row['tokens_per_file']}",
                                ", ".join(row["models"]), fmt_interval(row[PLANNER]["kl"], 1000),
                                f"{100 * row[PLANNER]['ppl_change']['mean']:+.2f}%", minus,
                                f"{1000 * row['uniform']['kl']['mean']:.2f}"))
        lines.append("")
    return "\n".join(lines + how_measured(payload)[1:]) + "\n"


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--artifacts", required=True, help="DIR/<model>/<variant>, see the module docstring")
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--variants", nargs="+", default=None, help="default: every variant found")
    add_eval_args(parser, "calibration_quality")
    args = parser.parse_args()
    args.calib_tokens = 0  # no calibration check here
    torch.set_num_threads(args.threads)

    def measure(model: str) -> dict:
        folder = Path(args.artifacts) / model
        variants = args.variants or sorted(p.name for p in folder.iterdir() if (p / "paged_model.json").is_file())
        return {v: evaluate_model(model, args, POLICIES, BITS, DOMAINS, folder / v) for v in variants}

    results, payload = measured(args, measure, "calibration_quality")
    payload.update({"bits": list(BITS), "policies": list(POLICIES), "results": results,
                    "summary": summarise(results)})
    log(f"wrote {write_result(args.out_name, payload)} (`python -m bench tables` renders docs/calibration.md from it)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
