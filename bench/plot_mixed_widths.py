"""Figure of the mixed-width target: per shape, a mixed layer's time over its
byte-weighted single-width time (`over_byte_weighted` of `bench/apl_moe_kernel.py`'s mixed cells:
each width's share of the layer's bytes at that width's own uniform rate, timed in the same run),
one bar per result file given (e.g. the same benchmark at successive commits), with the target
(1.2) drawn in.

    .venv/bin/python -m bench.plot_mixed_widths docs/mixed_over_byte_weighted.png \\
        bench/results/apl_moe_kernel_hint.json bench/results/apl_moe_kernel_stagger.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.bar_figure import save_grouped_bars

TARGET = 1.2  # every bit mix within 1.2x of its byte-weighted time


def over_byte_weighted(layer: dict) -> dict[tuple[str, int], float]:
    """(model, tokens) -> mixed time over byte-weighted time, for the rows that carry it."""
    out = {}
    for row in layer["results"]:
        ratio = (row.get("bits_mixed") or {}).get("over_byte_weighted")
        if isinstance(ratio, (int, float)) and ratio > 0:
            out[(row["model"], int(row["tokens"]))] = float(ratio)
    return out


def label(path: Path, layer: dict) -> str:
    """A result's legend entry: its commit where it names one, else its file name."""
    commit = layer.get("commit")
    return f"{commit} ({path.stem})" if isinstance(commit, str) and commit else path.stem


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("results", type=Path, nargs="+", help="apl_moe_kernel JSON results, oldest first")
    args = parser.parse_args(argv)
    data: dict[str, dict[tuple[str, int], float]] = {}
    try:
        for path in args.results:
            layer = json.loads(path.read_text())
            data[label(path, layer)] = over_byte_weighted(layer)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"plot_mixed_widths: cannot read the results: {exc}", file=sys.stderr)
        return 2
    shapes = sorted({s for points in data.values() for s in points})
    if not shapes:
        print("plot_mixed_widths: no result holds a mixed layer's byte-weighted ratio", file=sys.stderr)
        return 2
    top = max(max(points.values(), default=0.0) for points in data.values())

    def target(ax, x_of):
        ax.axhline(TARGET, color="k", linestyle="dashed", linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_ylim(0.9, max(TARGET + 0.1, top + 0.05))

    save_grouped_bars(data, shapes, lambda s: f"{s[0].split('-')[0]}\n{s[1]} tok", "mixed time / byte-weighted time",
                      "Mixed bit-widths against their bytes (H200); dashed: the 1.2x target", args.out, target,
                      inches_per_shape=0.9)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
