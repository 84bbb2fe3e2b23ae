"""Figure of the tiles regime (prefill sizes) against bf16 `torch._grouped_mm`: per shape,
the fused kernel's time under each variant of an `apl_gemv_variants --tiles` result over the
grouped time of an `apl_moe_kernel` result (both runs on the same machine kind; below 1 is
faster than grouped), with the issue's targets (1.0 at 4 bits, 1.3 at 8 bits) drawn in.

    .venv/bin/python -m bench.plot_prefill bench/results/apl_gemv_batched_tiles.json \\
        bench/results/apl_moe_kernel_batched.json docs/prefill_vs_grouped.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.bar_figure import save_grouped_bars

TARGETS = {"4": 1.0, "8": 1.3}  # fused time / grouped time at most this


def ratios(variants: dict, layer: dict) -> dict[str, dict[tuple[str, int, str], float]]:
    """variant -> {(model, tokens, bits): fused us / grouped us} for the shapes both results hold."""
    grouped = {(row["model"], row["tokens"]): row["bf16_grouped_us"] for row in layer["results"]
               if row.get("bf16_grouped_us") == row.get("bf16_grouped_us")}  # (NaN: no grouped_mm)
    out: dict[str, dict[tuple[str, int, str], float]] = {}
    for row in variants["results"]:
        g = grouped.get((row["model"], row["tokens"]))
        if g:
            out.setdefault(row["variant"], {})[(row["model"], row["tokens"], str(row["bits"]))] = row["us"] / g
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", type=Path, help="an apl_gemv_variants --tiles JSON")
    parser.add_argument("layer", type=Path, help="an apl_moe_kernel JSON with bf16_grouped_us")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        data = ratios(json.loads(args.variants.read_text()), json.loads(args.layer.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"plot_prefill: cannot read the results: {exc}", file=sys.stderr)
        return 2
    if not data:
        print("plot_prefill: no shape is in both results", file=sys.stderr)
        return 2
    shapes = sorted({s for v in data.values() for s in v}, key=lambda s: (s[0], s[1], s[2]))

    def targets(ax, x_of):
        for (_, _, bits), j in x_of.items():
            if bits in TARGETS:
                ax.hlines(TARGETS[bits], j - 0.1, j + 0.9 - 0.1, colors="k", linestyles="dashed", linewidth=1)

    save_grouped_bars(data, shapes, lambda s: f"{s[0].split('-')[0]}\n{s[1]} tok, {s[2]} b",
                      "fused time / bf16 grouped_mm time",
                      "Tiles regime (H200) against bf16 grouped_mm; dashed: the issue's targets", args.out, targets)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
