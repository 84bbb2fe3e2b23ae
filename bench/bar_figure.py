"""One grouped bar chart per call, the shape the bench figures share: for each shape on the x axis,
one bar per series (a variant, a commit), drawn with matplotlib's Agg backend (no screen) and saved
as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Hashable


def save_grouped_bars(series: dict[str, dict[Hashable, float]], shapes: list, tick: Callable[[Hashable], str],
                      ylabel: str, title: str, out: Path, decorate: Callable | None = None,
                      inches_per_shape: float = 1.1) -> Path:
    """Bars of series[name][shape] (missing shapes left out) over `shapes`, labelled by tick(shape);
    decorate(ax, x_of_shape) draws what the figure adds (targets, limits); writes and returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, inches_per_shape * len(shapes)), 4))
    width = 0.8 / len(series)
    for i, (name, points) in enumerate(series.items()):
        xs = [j + i * width for j, s in enumerate(shapes) if s in points]
        ax.bar(xs, [points[s] for s in shapes if s in points], width, label=name)
    if decorate is not None:
        decorate(ax, {s: j for j, s in enumerate(shapes)})
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([tick(s) for s in shapes], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
