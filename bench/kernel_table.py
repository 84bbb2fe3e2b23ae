"""The kernel benchmark's tables and figure in docs/kernel.md, from its results:

    python -m bench.kernel_table RESULT.json [MORE.json ...] [--plot docs/kernel_speedup.png]

Between the page's KERNEL TABLE markers, one table per model: microseconds per MoE layer call at
each width, its ratio to the HBM floor and its speed-up over bf16 `torch._grouped_mm` on the same
experts in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.bench_meta import REPO, md_header, md_row, pyplot, save_figure

DOCS = REPO / "docs" / "kernel.md"
START, END = "<!-- KERNEL TABLE START -->", "<!-- KERNEL TABLE END -->"
WIDTHS = ("3", "4", "5", "6", "7", "8", "mixed")


def cell(row: dict, width: str) -> str:
    """'fused us (x floor, x bf16)' for one width of one row, or '' when not timed."""
    timed = row.get(f"bits_{width}")
    if not timed:
        return ""
    grouped = row.get("bf16_grouped_us")
    speedup = f", {grouped / timed['fused_us']:.2f}x bf16" if grouped else ""
    return f"{timed['fused_us']:.1f} ({timed['fused_over_floor']:.2f}x floor{speedup})"


def model_table(rows: list[dict]) -> str:
    widths = [w for w in WIDTHS if any(f"bits_{w}" in r for r in rows)]
    gemv = any(r.get("bf16_gemv_us") for r in rows)  # results that timed the engine's bf16 GEMV
    names = [f"{w} bits" if w != "mixed" else "mixed" for w in widths]
    lines = md_header("tokens", *names, "bf16 grouped", *["bf16 engine GEMV"] * gemv, "mixed / byte-weighted")
    for row in sorted(rows, key=lambda r: r["tokens"]):
        mixed = row.get("bits_mixed", {}).get("over_byte_weighted")
        grouped, gemv_us = row.get("bf16_grouped_us"), row.get("bf16_gemv_us")
        lines.append(md_row(row["tokens"], *(cell(row, w) for w in widths), f"{grouped:.1f}" if grouped else "",
                            *[f"{gemv_us:.1f}" if gemv_us else ""] * gemv, f"{mixed:.2f}x" if mixed else ""))
    return "\n".join(lines)


def render(record: dict, source: str) -> str:
    """One result's tables; `source` names its file (the commit it measured is in the file)."""
    gpu = record.get("machine", {}).get("gpu") or record.get("gpu") or "unknown GPU"
    parts = [f"Measured on {gpu}, {record.get('date', '')[:10]} (`{source}`); microseconds per layer "
             "call (ratio to the HBM floor, speed-up over bf16 grouped GEMM in the same run)."]
    models = {}
    for row in record["results"]:
        models.setdefault(row["model"], []).append(row)
    for name, rows in models.items():
        parts.append(f"**{name}**\n\n" + model_table(rows))
    return "\n\n".join(parts)


def replace_block(text: str, block: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"the docs page has no {START} ... {END} block")
    return re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{block}\n{END}", text, flags=re.S)


def plot(record: dict, path: Path) -> None:
    plt = pyplot()
    models = sorted({r["model"] for r in record["results"]})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, name in zip(axes[0], models):
        rows = sorted((r for r in record["results"] if r["model"] == name), key=lambda r: r["tokens"])
        for width in WIDTHS:
            points = [(r["tokens"], r["bf16_grouped_us"] / r[f"bits_{width}"]["fused_us"]) for r in rows
                      if r.get(f"bits_{width}") and r.get("bf16_grouped_us")]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{width} bits" if width != "mixed" else "mixed")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=name, xlabel="tokens per layer call", ylabel="speed-up over bf16 grouped GEMM")
    axes[0][-1].legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="one result per model recipe")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    records = [json.loads(path.read_text()) for path in args.results]
    text = "\n\n".join(render(record, path.as_posix()) for record, path in zip(records, args.results))
    DOCS.write_text(replace_block(DOCS.read_text(), text))
    if args.plot:
        plot({**records[0], "results": [row for record in records for row in record["results"]]}, args.plot)
    print("wrote docs/kernel.md" + (f" and {args.plot}" if args.plot else ""))


if __name__ == "__main__":
    main()
