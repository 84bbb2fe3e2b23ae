"""The docs' result tables from bench/results/ (`python -m bench tables [--check]`): what lies
between a page's `<!-- table: NAME -->` and `<!-- /table -->` is what TABLES[NAME] renders, so
after a new run the diff shows what moved. A rewritten page's figures (FIGURES) are drawn again.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from bench.bench_meta import REPO, RESULTS_DIR as RESULTS, STEP_COMPONENTS, md_header, md_row, pyplot, save_figure

DOCS = REPO / "docs"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def source(*files: str) -> str:
    stamps = [f"`{f}` ({load(f)['gpu']}, {str(load(f)['date'])[:10]})" for f in files]
    return "From " + ", ".join(stamps) + "."


def no_result(writer: str, files: list[str]) -> list[str]:
    return [f"No result yet: {writer} " + ", ".join(f"`{f}`" for f in files) + "."]


def tok_s(loads: list) -> dict:
    """concurrency -> output tok/s of a list of loads (rows a time limit skipped left out)."""
    return {r["concurrency"]: r["output_tokens_per_s"] for r in loads if "output_tokens_per_s" in r}


def skipped(section) -> str | None:
    """Why a run skipped a section (it did not fit, a time limit), or None."""
    return section.get("skipped") if isinstance(section, dict) else None


REAL_SHAPE_CONCURRENCY = (1, 16, 64, 256)


def real_shape(files: list[str]) -> list[str]:
    """Output tok/s per concurrency: transformers, our engine in bf16 and the runtime at
    static bits, each mode, with the HBM floor of the same run ("does not fit" beside a
    bf16 floor whose model the run could not hold). Result files not run yet are left out."""
    present = [f for f in files if (RESULTS / f).is_file()]
    if not present:
        return no_result("the real-shape recipes write", files)
    lines = md_header("model", "decoder, mode", *(f"c={c}" for c in REAL_SHAPE_CONCURRENCY))
    for f in present:
        d = load(f)
        hf, bf16, rows = d.get("transformers_generate", []), d.get("engine_bf16_dense") or {}, []
        if skipped(hf):
            rows.append((f"transformers generate: {skipped(hf)}", {}))
        elif tok_s(hf):
            rows.append(("transformers generate, bf16", tok_s(hf)))
        if skipped(bf16):
            rows.append((f"engine bf16: {skipped(bf16)}", {}))
        else:  # per mode its loads beside its step profiles
            rows += [(f"engine bf16, {m}", tok_s(v["loads"])) for m, v in bf16.items()]
        for name, static in (d.get("runtime_static") or {}).items():
            if skipped(static):
                rows.append((f"runtime {name}: {skipped(static)}", {}))
            else:
                rows += [(f"runtime {name}, {m}", tok_s(v)) for m, v in static["modes"].items()]
        rows += [(f"HBM floor {k}" + (" (does not fit)" if v.get("does_not_fit") else ""),
                  {int(c): x["floor_tokens_per_s"] for c, x in v.items() if c.isdigit()})
                 for k, v in d.get("hbm_floor", {}).items() if k in ("bf16", "static-4")]
        lines += [md_row(d["model"], label, *(by_c.get(c, "") for c in REAL_SHAPE_CONCURRENCY)) for label, by_c in rows]
    return lines + ["", source(*present)]


def real_shape_components(files: list[str]) -> list[str]:
    """Per decode step (per concurrency) and prefill step (prompts x tokens), run eagerly
    (bench/step_components.py): the device ms and kernel launches of each component, bf16
    and every static width; host = the step's wall time less its kernels' device time (what a
    graph replay takes away)."""
    present = [f for f in files if (RESULTS / f).is_file()
               and any("components" in str(v) for v in load(f).get("runtime_static", {}).values())]
    if not present:
        return no_result("`python -m bench run real-shape-qwen` (-mixtral, -gemma4) writes", files)
    lines = md_header("model", "weights", "step", "step ms", "host ms",
                      *(f"{c} ms (kernels)" for c in STEP_COMPONENTS), "kernels")
    for f in present:
        d = load(f)
        bf16 = d.get("engine_bf16_dense") or {}
        sections = [] if skipped(bf16) else [("bf16", v) for v in bf16.values()]
        for weights, v in sections + list((d.get("runtime_static") or {}).items()):
            # decode steps at c sequences, then the prefill steps (c prompts x n tokens)
            steps = [(f"decode c{c}", p) for c, p in v.get("components", {}).items()]
            steps += [(f"prefill {shape}", p) for shape, p in v.get("prefill_components", {}).items()]
            for step, p in steps:
                cells = [f"{p['components'][k]['ms']} ({p['components'][k]['kernels']:g})" for k in STEP_COMPONENTS]
                lines.append(md_row(d["model"], weights, step, p["step_ms"], p["host_ms"], *cells,
                                    p["kernels_per_step"]))
    return lines + ["", source(*present)]


def real_shape_pressure(files: list[str]) -> list[str]:
    """The real-shape run's pressure section: one budget between 4-bit and 8-bit experts plus
    the trace's KV, every policy's tok/s, preemptions, page moves and mean bits, and the logit
    error against bf16 of what it served (bench/logit_probe.py; "–" in results without it)."""
    present = [f for f in files if (RESULTS / f).is_file() and "pressure" in load(f)]
    if not present:
        return no_result("`python -m bench run real-shape-qwen` writes", files)
    lines = md_header("model", "budget GB", "policy", "output tok/s", "steps", "preemptions", "page moves",
                      "mean bits start / min / end", "pager host s", "logit rel. err mean / worst", "top-1 agree",
                      "at lowest bits: bits, rel. err")
    for f in present:
        d = load(f)
        p = d["pressure"]
        for name, r in p["policies"].items():
            if skipped(r):  # (the run's time limit came first)
                lines.append(md_row(d["model"], round(p["budget_bytes"] / 1e9, 2), name, r["skipped"], *[""] * 8))
                continue
            bits = f"{r['bits_mean_start']:.2f} / {r['bits_mean_min']:.2f} / {r['bits_mean_end']:.2f}"
            prof = (r.get("pager_profile") or {}).get("seconds", {})
            lines.append(md_row(d["model"], round(p["budget_bytes"] / 1e9, 2), name, round(r["output_tokens_per_s"]),
                                r["steps"], r["preemptions"], r["page_moves"], bits,
                                round(prof["plan"] + prof["boundary"], 2) if prof else "",  # a boundary holds the rest
                                *served_error_cells(r.get("served_logit_error"))))
    return lines + ["", source(*present)]


def served_error_cells(e: dict | None) -> tuple:
    """A pressure row's logit error against bf16: mean / worst relative error, top-1 agreement,
    and the probe at the lowest bits; "–" where the result has none, the reason where skipped."""
    if e is None:
        return "–", "–", "–"
    if skipped(e):
        return e["skipped"], "", ""
    low = e["at_lowest_bits"]
    return (f"{e['relative_error_mean']:.4f} / {e['relative_error_worst']:.4f}", f"{e['argmax_agree']:.3f}",
            f"{low['bits_mean']:.2f}, {low['relative_error_mean']:.4f}")


def quantize_stream(files: list[str]) -> list[str]:
    lines = md_header("model", "layers", "quantise s", "s per layer", "full depth s", "peak device GiB",
                      "peak host GiB", "artifact GB")
    for d in map(load, files):
        lines.append(md_row(d["model"], f"{d['layers_built']} of {d['layers_full']}", round(d["quantize_seconds"]),
                            round(d["per_layer_seconds"], 1), round(d["full_depth_seconds_extrapolated"]),
                            round(d["peak_device_gib"], 1), round(d["peak_host_bytes"] / 2**30, 1),
                            round(d.get("artifact_bytes", 0) / 1e9, 1)))
    return lines + ["", source(*files)]


def planner_speed(files: list[str]) -> list[str]:
    d = load(files[0])
    shown = ("pagedweight@3", "pagedweight@4", "uniform@4", "mxmoe@4", "dpllm@4", "online tick", "heapq@3", "heapq@4")
    plans = {**d["static_plans"], "online tick": d["online_tick"], **d["baseline_python_heapq"]}
    return md_header("plan", "median ms", "p90 ms") + [
        md_row(n, plans[n]["median_ms"], plans[n]["p90_ms"]) for n in shown if n in plans] + ["", source(*files)]


def controller_scale(files: list[str]) -> list[str]:
    keys = ["planner_solve_ms", "idle_boundary_us", "plan_free_10pct_ms", "num_lowered_10pct",
            "lower_10pct_boundary_ms", "feed_snapshot_us"]
    return md_header("blocks", *keys) + [md_row(r["num_blocks"], *(r.get(k, "") for k in keys))
                                         for r in load(files[0])["results"]] + ["", source(*files)]


def decode_speed(files: list[str]) -> list[str]:
    return md_header("model", "pagedweight tok/s", "transformers tok/s", "speed-up") + [
        md_row(r["model"], r["pagedweight_tokens_per_s"], r["transformers_tokens_per_s"], r["speedup"])
        for r in load(files[0])["results"]] + ["", source(*files)]


def serve_load(files: list[str]) -> list[str]:
    lines = md_header("trace", "in-process tok/s", "worker gRPC tok/s", "cluster (HTTP) tok/s", "cluster overhead")
    for d in map(load, files):
        t = d["trace"]
        trace = f"{t['num_prompts']} prompts, rate {t['request_rate'] or 'max'}, concurrency {t['max_concurrency']}"
        lines.append(md_row(trace, d["in_process_output_tok_s_mean"], d["worker_grpc_output_tok_s_mean"],
                            d["cluster_output_tok_s_mean"], f"{d['overhead_output_tok_s']:.0%}"))
    return lines + ["", source(*files)]


def budget_sweep(files: list[str]) -> list[str]:
    """Per budget and row: tok/s, KL to bf16 of what it served, preemptions, page moves (with the
    planes lowered against the fewest that free the bytes asked), bits."""
    present = [f for f in files if (RESULTS / f).is_file()]
    if not present:
        return no_result("`python -m bench run budget-sweep-cpu` (CPU) or `budget-sweep-qwen-a` / "
                         "`budget-sweep-qwen-b` (GPU) write", files)
    lines = md_header("budget MiB (fitting width)", "row", "tok/s", "KL x 1000", "preemptions", "page moves",
                      "mean bits served")
    for point in (p for f in present for p in load(f)["budgets"]):
        budget = f"{point['budget'] / 2**20:.1f} ({point['fitting_uniform_bits'] or 'none'})"
        for name, x in point["rows"].items():
            why = f"= {x['same_run_as']}" if "same_run_as" in x else x.get("refused") or x.get("skipped")
            if why:
                lines.append(md_row(budget, name, why, "", "", "", ""))
                continue
            kl = x.get("kl_served")
            done = "" if x["requests_finished"] == x["requests"] else \
                f" ({x['requests_finished']}/{x['requests']} requests in the time limit)"
            moves = x["page_moves"]
            if x.get("planes_fewest"):  # what the free plans lowered against the least that frees the bytes asked
                moves = f"{moves} ({x['planes_lowered'] / x['planes_fewest']:.2f}x the fewest planes"
                if x.get("blocks_fewest"):
                    moves += (f", {x['blocks_lowered'] / x['blocks_fewest']:.2f}x the fewest blocks,"
                              f" {x['bytes_freed'] / x['bytes_asked']:.2f}x the bytes asked")
                moves += ")"
            lines.append(md_row(budget, name, f"{x['output_tokens_per_s']}{done}",
                                "" if kl is None else f"{1000 * kl:.2f}", x["preemptions"], moves,
                                x["bits_mean_served"]))
    return lines + ["", source(*present)]


def budget_sweep_plot(files: list[str], path: Path) -> None:
    """Throughput against KL to bf16, one point per row and budget (refused rows left out),
    each row's budgets joined from the largest to the smallest."""
    result = load(files[0])
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(n for p in result["budgets"] for n in p["rows"] if n != "fitting-uniform"):
        rows = [p["rows"].get(name, {}) for p in result["budgets"]]
        points = [(r["kl_served"], r["output_tokens_per_s"]) for r in rows if r.get("kl_served") is not None]
        if points:
            kl, tps = zip(*points)
            ax.plot([max(k, 1e-5) for k in kl], tps, marker="o", label=name)
    ax.set_xscale("log")
    ax.set(xlabel="KL(bf16 || served), nats per token (bf16 drawn at 1e-5)", ylabel="output tokens/s")
    model = result["model"]
    name = Path(model["artifact"]).name if "artifact" in model else model["shape"]
    ax.set_title(f"{name}: {len(result['budgets'])} budgets, one point each", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


KERNEL_WIDTHS = ("3", "4", "5", "6", "7", "8", "mixed")


def kernel_cell(row: dict, width: str) -> str:
    """'fused us (x floor, x bf16)' for one width of one row, or '' when not timed."""
    timed = row.get(f"bits_{width}")
    if not timed:
        return ""
    grouped = row.get("bf16_grouped_us")
    speedup = f", {grouped / timed['fused_us']:.2f}x bf16" if grouped else ""
    return f"{timed['fused_us']:.1f} ({timed['fused_over_floor']:.2f}x floor{speedup})"


def kernel_model_table(rows: list[dict]) -> list[str]:
    widths = [w for w in KERNEL_WIDTHS if any(f"bits_{w}" in r for r in rows)]
    gemv = any(r.get("bf16_gemv_us") for r in rows)  # results that timed the engine's bf16 GEMV
    names = [f"{w} bits" if w != "mixed" else "mixed" for w in widths]
    lines = md_header("tokens", *names, "bf16 grouped", *["bf16 engine GEMV"] * gemv, "mixed / byte-weighted")
    for row in sorted(rows, key=lambda r: r["tokens"]):
        mixed = row.get("bits_mixed", {}).get("over_byte_weighted")
        grouped, gemv_us = row.get("bf16_grouped_us"), row.get("bf16_gemv_us")
        lines.append(md_row(row["tokens"], *(kernel_cell(row, w) for w in widths), f"{grouped:.1f}" if grouped else "",
                            *[f"{gemv_us:.1f}" if gemv_us else ""] * gemv, f"{mixed:.2f}x" if mixed else ""))
    return lines


def kernel(files: list[str]) -> list[str]:
    """The kernel benchmark (bench/apl_moe_kernel.py), one table per result and model:
    microseconds per MoE layer call at each width, its ratio to the HBM floor and its speed-up
    over bf16 grouped GEMM on the same experts in the same run."""
    lines = []
    for f in files:
        d = load(f)
        lines += [""] * bool(lines) + [f"Measured on {d['gpu']}, {d['date'][:10]} (`bench/results/{f}`); microseconds "
                                       "per layer call (ratio to the HBM floor, speed-up over bf16 grouped GEMM in "
                                       "the same run)."]
        models: dict[str, list] = {}
        for row in d["results"]:
            models.setdefault(row["model"], []).append(row)
        for name, rows in models.items():
            lines += ["", f"**{name}**", "", *kernel_model_table(rows)]
    return lines


def kernel_plot(files: list[str], path: Path) -> None:
    """Speed-up over bf16 grouped GEMM against tokens, one panel per model, a line per width."""
    results = [row for f in files for row in load(f)["results"]]
    models = sorted({r["model"] for r in results})
    fig, axes = pyplot().subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, name in zip(axes[0], models):
        rows = sorted((r for r in results if r["model"] == name), key=lambda r: r["tokens"])
        for width in KERNEL_WIDTHS:
            points = [(r["tokens"], r["bf16_grouped_us"] / r[f"bits_{width}"]["fused_us"]) for r in rows
                      if r.get(f"bits_{width}") and r.get("bf16_grouped_us")]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{width} bits" if width != "mixed" else "mixed")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=name, xlabel="tokens per layer call", ylabel="speed-up over bf16 grouped GEMM")
    axes[0][-1].legend(fontsize=7)
    save_figure(fig, path)


# the real-shape recipes' models (RECIPES in bench/__main__.py), in the order the tables show them
REAL_SHAPE_MODELS = ("qwen1.5-moe-a2.7b", "mixtral-8x7b", "gemma-4-26b-a4b")
# the earlier H200 results, which also ran the real-shape-qwen3 and -olmoe recipes
REAL_SHAPE_MODELS_H200 = ("qwen1.5-moe-a2.7b", "mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "gemma-4-26b-a4b")
KERNEL_RESULTS = [f"apl_moe_kernel_{m}_h100.json" for m in ("qwen", "mixtral", "gemma4")]
# table name -> (generator, result files)
TABLES = {
    "kernel": (kernel, KERNEL_RESULTS),
    "real_shape_h100": (real_shape, [f"real_shape_{m}_h100.json" for m in REAL_SHAPE_MODELS]),
    "real_shape_components": (real_shape_components, [f"real_shape_{m}_h100.json" for m in REAL_SHAPE_MODELS]),
    "real_shape_pressure": (real_shape_pressure, ["real_shape_qwen1.5-moe-a2.7b_h100.json"]),
    "real_shape_h200": (real_shape, [f"real_shape_{m}_h200.json" for m in REAL_SHAPE_MODELS_H200]),
    "quantize_stream": (quantize_stream, ["quantize_full_depth_qwen_h200.json", "quantize_mixtral_2layer_h200.json"]),
    "planner_speed": (planner_speed, ["planner_speed_cpu.json"]),
    "controller_scale": (controller_scale, ["controller_scale_cpu.json"]),
    "decode_speed": (decode_speed, ["decode_speed_cpu.json"]),
    "serve_load": (serve_load, ["serve_load_micro-mixtral_c16_cpu.json",
                                "serve_load_micro-mixtral_poisson8_24MiB_cpu.json"]),
    "budget_sweep": (budget_sweep, ["budget_sweep_tiny-qwen-moe_cpu.json", "budget_sweep_qwen1.5-moe-a2.7b_a_h100.json",
                                    "budget_sweep_qwen1.5-moe-a2.7b_b_h100.json"]),
}
# whole pages a benchmark renders from its own result: page -> (module of bench/, result file)
PAGES = {"quality.md": ("quality_budget", "quality_budget_cpu.json"),
         "calibration.md": ("calibration_quality", "calibration_quality_cpu.json")}
# sections such a page goes on with, each a benchmark's own from its result: page -> [(module, result)]
PAGE_SECTIONS = {"quality.md": [("retrieval_budget", "retrieval_budget_retrieval-moe_cpu.json")]}
# a page's figures, drawn again where `tables` rewrites the page: page -> [(draw, result files, image)]
FIGURES = {"kernel.md": [(kernel_plot, KERNEL_RESULTS, "kernel_speedup.png")],
           "elasticity.md": [(budget_sweep_plot, ["budget_sweep_tiny-qwen-moe_cpu.json"],
                              "budget_sweep_tiny-qwen-moe_cpu.png")]}
MARK = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- /table -->)", re.S)


def render(text: str) -> str:
    def fill(m: re.Match) -> str:
        generate, files = TABLES[m.group(2)]
        return m.group(1) + "\n".join(generate(files)) + "\n" + m.group(4)
    return MARK.sub(fill, text)


def page_text(page: Path) -> str:
    """What a page should hold: a benchmark's whole rendered page (and the sections of
    PAGE_SECTIONS whose results exist), or the page with its marked tables filled in."""
    if page.name in PAGES:
        import importlib

        module, result = PAGES[page.name]
        sections = [(m, r) for m, r in PAGE_SECTIONS.get(page.name, ()) if (RESULTS / r).is_file()]
        return "".join(importlib.import_module(f"bench.{m}").markdown(load(r))
                       for m, r in [(module, result), *sections])
    return render(page.read_text())


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        new = page_text(page)
        if new != page.read_text():
            stale.append(page.name)
            if not check:
                page.write_text(new)
                for draw, files, image in FIGURES.get(page.name, ()):
                    draw(files, DOCS / image)
    print(("stale: " if check else "rewrote: ") + (", ".join(stale) or "nothing"))
    return 1 if check and stale else 0
