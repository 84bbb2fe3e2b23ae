"""The retrieval budget benchmark's report (bench/retrieval_budget.py measures): the section of
docs/quality.md, rendered from its result by `python -m bench tables`, and its figure.

Tables: exact match per row and context length with 95% Wilson intervals and the examples lost
and gained against unlimited bf16; how each budget row was served (memory, the bits the prompt
tokens were computed at, requests held, preemptions, steps short of KV, throughput); the
targets; and the reading of them in numbers from the result (what one example weighs, the
examples lost and how near a tie unlimited bf16's answer was, what the elastic plan gave).
"""

from __future__ import annotations

from pathlib import Path


def accuracy_rows(payload: dict) -> dict[str, dict[tuple, dict]]:
    """Series name -> {(expert bits, length): row}: unlimited bf16 (the same at every budget),
    bf16 in the budget, each elastic policy and the fitting uniform width."""
    series: dict[str, dict[tuple, dict]] = {}
    for r in payload["lengths"]:
        for point in r["budgets"]:
            shape = (point["expert_bits"], r["length"])
            series.setdefault("bf16, unlimited memory", {})[shape] = r["bf16_unlimited"]
            for name, row in point["results"].items():
                if "refused" in row:
                    continue
                label = "fitting uniform (static-B)" if name.startswith("static-") else name
                series.setdefault({"bf16": "bf16 in the budget"}.get(name, label), {})[shape] = row
    return series


def figure(payload: dict, out: Path) -> Path:
    """Exact match per budget and context length, one bar per row, with 95% Wilson intervals
    (matplotlib's Agg backend, no screen); writes and returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = accuracy_rows(payload)
    shapes = sorted({s for rows in series.values() for s in rows})
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4))
    for i, (name, rows) in enumerate(series.items()):
        xs = [j + i * width for j, s in enumerate(shapes) if s in rows]
        points = [rows[s] for s in shapes if s in rows]
        acc = [100 * r["accuracy"] for r in points]
        ax.bar(xs, acc, width, label=name)
        ax.errorbar(xs, acc, fmt="none", ecolor="black", capsize=2, linewidth=0.8,
                    yerr=[[100 * (r["accuracy"] - r["ci95"][0]) for r in points],
                          [100 * (r["ci95"][1] - r["accuracy"]) for r in points]])
    ax.set_ylim(0, 105)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([f"{s[1]} tokens\n{s[0]:g} expert bits" for s in shapes], fontsize=7)
    ax.set_ylabel("exact match, %")
    ax.set_title(f"{payload['model']}: exact match under a memory budget, 95% intervals")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def accuracy_cell(row: dict, paired: bool) -> str:
    if "refused" in row:
        return "refused"
    lo, hi = row["ci95"]
    cell = f"{pct(row['accuracy'])}% [{pct(lo)}, {pct(hi)}]"
    return cell + (f" (-{row['lost']} / +{row['gained']})" if paired else "")


def accuracy_table(payload: dict) -> list[str]:
    """Exact match per row and context length, unlimited bf16 first, then each budget's rows."""
    lengths = payload["lengths"]
    lines = ["| budget | row | " + " | ".join(f"{r['length']} tokens" for r in lengths) + " |",
             "|---|---|" + "---|" * len(lengths),
             "| unlimited | bf16 | " + " | ".join(accuracy_cell(r["bf16_unlimited"], False) for r in lengths) + " |"]
    for i, point in enumerate(lengths[0]["budgets"]):
        for name in point["results"]:
            label = "bf16" if name == "bf16" else f"`{name}`"
            cells = [accuracy_cell(r["budgets"][i]["results"][name], True) for r in lengths]
            lines.append(f"| {point['expert_bits']:g} expert bits | {label} | " + " | ".join(cells) + " |")
    return lines


def serving_table(payload: dict) -> list[str]:
    """How each budget row was served: memory, the bits its prompt tokens saw, what it paid."""
    lines = ["| expert bits | context | row | budget MiB (bf16 needs) | mean bits (lowest) | per layer | "
             "most / least routed | requests (KV tokens) held, most | preemptions | steps short of KV | "
             "prompt tok/s |", "|---" * 11 + "|"]
    for r in payload["lengths"]:
        for point in r["budgets"]:
            mib = f"{point['budget_bytes'] / 2**20:.2f} ({point['bf16_needs_bytes'] / 2**20:.2f})"
            for name, x in point["results"].items():
                if "refused" in x:
                    lines.append(f"| {point['expert_bits']:g} | {r['length']} | {name} | {mib} | {x['refused']} |"
                                 + " |" * 6)
                    continue
                b = x["bits"]
                bits = ["16 (bf16)", "", ""] if "by_layer" not in b else [
                    f"{b['mean']:.2f} ({b['mean_min']:.2f})", " / ".join(f"{v:.2f}" for v in b["by_layer"].values()),
                    f"{b['most_routed']:.2f} / {b['least_routed']:.2f}"]
                paid = [f"{x['max_running']} ({x['peak_kv_tokens']:,})", x["preemptions"], x["memory_short_steps"],
                        f"{x['prompt_tokens_per_s']:,.0f}"]
                lines.append(f"| {point['expert_bits']:g} | {r['length']} | {name} | {mib} | "
                             + " | ".join(str(c) for c in [*bits, *paid]) + " |")
    return lines


def target_rows(payload: dict) -> list[str]:
    """The targets: the elastic policy within 1 point of unlimited bf16 at every length and
    budget, and 10 points above the fitting uniform width at the tightest budget."""
    lines = ["| target | budget | " + " | ".join(f"{r['length']} tokens" for r in payload["lengths"]) + " |",
             "|---|---|" + "---|" * len(payload["lengths"])]
    tight = min(p["expert_bits"] for p in payload["lengths"][0]["budgets"])
    for i, point in enumerate(payload["lengths"][0]["budgets"]):
        for policy in [n for n in point["results"] if n != "bf16" and not n.startswith("static-")]:
            gaps = [r["budgets"][i]["results"][policy]["accuracy"] - r["bf16_unlimited"]["accuracy"]
                    for r in payload["lengths"]]
            lines.append(f"| `{policy}` within 1 point of unlimited bf16 | {point['expert_bits']:g} | " + " | ".join(
                f"{100 * g:+.1f} points: {'yes' if round(100 * g, 9) >= -1 else '**no**'}" for g in gaps) + " |")
            if point["expert_bits"] != tight:
                continue
            static = [n for n in point["results"] if n.startswith("static-")]
            for uniform in static:
                gaps = [r["budgets"][i]["results"][policy]["accuracy"] - r["budgets"][i]["results"][uniform]["accuracy"]
                        for r in payload["lengths"]]
                lines.append(f"| `{policy}` 10 points above `{uniform}` | {point['expert_bits']:g} | " + " | ".join(
                    f"{100 * g:+.1f} points: {'yes' if round(100 * g, 9) >= 10 else '**no**'}" for g in gaps) + " |")
    return lines


def lost_examples(payload: dict) -> list[str]:
    """Each example a budget row lost against unlimited bf16: which rows lost it and how near a
    tie unlimited bf16's answer was (its margin beside the median at that length)."""
    out = []
    for r in payload["lengths"]:
        ref = r["bf16_unlimited"]
        median = sorted(ref["margins"])[len(ref["margins"]) // 2]
        for i, margin in enumerate(ref["margins"]):
            rows = [f"{p['expert_bits']:g} `{n}`" for p in r["budgets"] for n, x in p["results"].items()
                    if "right" in x and ref["right"][i] and not x["right"][i]]
            if rows:
                out.append(f"{r['length']} tokens, example {i}: bf16 margin {margin:.2f} (median {median:.2f}), "
                           f"lost by {', '.join(rows)}")
    return out


def account(payload: dict) -> list[str]:
    """The reading of the targets in numbers from the result: what one example weighs, the
    examples lost and how near a tie they were, and at the tightest budget how far the fitting
    uniform width fell and what bits the elastic plan gave."""
    lengths = payload["lengths"]
    n = lengths[0]["examples"]
    lines = [f"One example is {100 / n:.1f} points at {n} examples per length."]
    lost = lost_examples(payload)
    if lost:
        lines += ["", "Examples a budget row lost (the margin: unlimited bf16's logit of its answer above the "
                  "runner-up's):", "", *(f"- {x}" for x in lost)]
    i = min(range(len(lengths[0]["budgets"])), key=lambda j: lengths[0]["budgets"][j]["expert_bits"])
    point = lengths[0]["budgets"][i]
    static = next((k for k in point["results"] if k.startswith("static-")), None)
    elastic = next((k for k in point["results"] if k != "bf16" and k != static), None)
    if static is None or elastic is None:
        return lines
    rows = [(r["length"], r["bf16_unlimited"], r["budgets"][i]["results"]) for r in lengths]
    fall = max(100 * (ref["accuracy"] - res[static]["accuracy"]) for _, ref, res in rows)
    plan = "; ".join(f"{length} tokens {res[elastic]['bits']['mean']:.2f}, per layer "
                     + " / ".join(f"{v:.2f}" for v in res[elastic]["bits"]["by_layer"].values())
                     + f", most-routed experts {res[elastic]['bits']['most_routed']:.2f}" for length, _, res in rows)
    lines += ["", f"At {point['expert_bits']:g} expert bits `{static}` scored at most {fall:.1f} points below "
              f"unlimited bf16 at any length" + (", so no policy could be 10 points above it" if fall < 10 else "")
              + f". The mean bits `{elastic}` gave the prompt tokens: {plan}. Only the experts are quantised: "
              "attention, which finds the queried key and copies the value after it, runs in the compute dtype "
              "in every row. Each layer's experts but the last's sit between two attention layers (they write "
              "the residual stream the next attention matches on); the last layer's feed the output."]
    return lines


def markdown(payload: dict) -> str:
    """The retrieval section of docs/quality.md (bench/tables.py renders it from the result)."""
    a, first = payload["args"], payload["lengths"][0]
    budgets = ", ".join(f"{p['expert_bits']:g} (the widest uniform width that fits: {p['fitting_uniform_bits']})"
                        for p in first["budgets"])
    decode = ", ".join(f"{r['decode_tokens']} at {r['length']}" for r in payload["lengths"])
    lines = ["", "## Long-context retrieval under a memory budget", "",
             f"`{payload['model']}` (Mixtral architecture, {payload['model_config']['num_local_experts']} experts, "
             f"top-{payload['model_config']['num_experts_per_tok']}; docs/retrieval.md) answers one query among "
             f"{a['records']} key-value records in filler text; exact match of the value under greedy decoding, "
             f"{first['examples']} held-out examples per context length, the same examples in every row. `bf16`, "
             "unlimited memory: the unquantised checkpoint, one request at a time. A budget of B expert bits holds "
             f"the dense weights, the workspace, the KV of {a['concurrency']} whole requests and the experts at B "
             f"mean bits: {budgets}; bf16 experts do not fit beside that KV. At a budget every example is sent at "
             f"once and each request decodes a few tokens after its prompt ({decode}; the first is the answer "
             f"scored), so up to {a['concurrency']} requests hold KV together. Rows there: `bf16` (the unquantised "
             "experts with the KV blocks the budget leaves: it holds fewer requests at once and queues the rest "
             "or preempts), `pagedweight` (the elastic policy) and `static-B` (the widest uniform width that "
             "fits). Cells: exact match, % [95% Wilson interval] (examples lost / gained against unlimited bf16). "
             f"Computed in {payload['dtype']} on the CPU. Numbers: "
             f"bench/results/retrieval_budget_{payload['model']}_cpu.json; plot: retrieval_budget.png.", "",
             "![exact match by budget and context length](retrieval_budget.png)", "",
             *accuracy_table(payload), "",
             "How each budget row was served. Bits: the mean width the prompt tokens were computed at (the "
             f"lowest mean at any step), per layer, and over the {payload['model_config']['num_experts_per_tok']} "
             "experts per layer the calibration routed to most and to least. Held: the most requests holding "
             "KV in one step, and their KV tokens.", "",
             *serving_table(payload), "", "### Targets", "", *target_rows(payload), "", *account(payload)]
    load = payload["load_average"]
    lines += ["", "### How the retrieval numbers were made", "",
              f"On {payload['machine']['cpu']} ({payload['machine']['cpu_count']} CPUs, load average "
              f"{load[0]:.1f} at the start and {load[1]:.1f} at the end), torch threads: {a['threads']}; "
              f"{payload['seconds']:.0f} s in all ({payload['cpu_seconds']:.0f} s of CPU time), quantisation "
              f"{payload['quantize_seconds']:.0f} s of it:", "",
              "```", "python -m bench run retrieval-budget", "```", ""]
    return "\n".join(lines)
