"""Figure of a real_shape result with --modes: output tokens/s per concurrency, each
decoder and mode against transformers and the HBM floors of the same run (log scale).

    .venv/bin/python -m bench.plot_real_shape bench/results/real_shape_qwen1.5-moe-a2.7b_cuda_graphs.json \\
        docs/real_shape_graphs.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(result: dict) -> dict[str, dict[int, float]]:
    """label -> {concurrency: output tokens/s} for every measured row of the result."""
    out: dict[str, dict[int, float]] = {}

    def add(label, rows):
        points = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if "output_tokens_per_s" in r}
        if points:
            out[label] = points

    add("transformers generate, bf16", result.get("transformers_generate", []))
    for mode, row in result.get("engine_bf16_dense", {}).items():
        add(f"engine bf16 dense, {mode}", row.get("loads", []))
    for policy, row in result.get("runtime_static", {}).items():
        for mode, loads in row.get("modes", {}).items():
            add(f"runtime {policy}, {mode}", loads)
    for name, floor in result.get("hbm_floor", {}).items():
        out[f"floor {name}"] = {int(c): v["floor_tokens_per_s"] for c, v in floor.items()}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, points in series(result).items():
        xs = sorted(points)
        style = dict(linestyle=":", marker=None) if label.startswith("floor") else dict(marker="o")
        if "eager" in label:
            style["linestyle"] = "--"
        ax.plot(xs, [points[x] for x in xs], label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result.get('model')} on {result.get('machine', {}).get('gpu', '?')}, commit {result.get('commit', '')[:7]}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    plot(json.loads(args.result.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
