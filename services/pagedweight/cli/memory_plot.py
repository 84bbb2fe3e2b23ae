"""Draws a `MemoryTimeline` to a PNG: the picture of the memory split for people without
Grafana (the same bands as the Grafana "Memory split" panel).

Top: bytes over time, stacked up to the budget: expert weights by committed bit-width (8
bits at the bottom), dense weights, workspace, copies in transit, KV holding tokens, KV kept
free, free space; a red tick on the top edge for every preemption. Bottom: mean committed
bits and the cumulative page moves. matplotlib is imported here only, so the rest of the
CLI does not need it.
"""

from __future__ import annotations

from pathlib import Path

from pagedweight.cli.memory_timeline import MemoryTimeline
from pagedweight.common.errors import UserError
from pagedweight.format.apl_format import BIT_WIDTHS

MIB = float(1 << 20)


def check_plot_path(path: str | Path) -> Path:
    """A PNG name in an existing folder; checked before a run, so a typo costs no load."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot {path}: expected a .png file name")
    if not path.parent.is_dir():
        raise UserError(f"--plot {path}: folder {path.parent} does not exist")
    return path


def plot_memory_timeline(timeline: MemoryTimeline, path: str | Path, title: str) -> Path:
    path = check_plot_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'pagedweight[plot]'") from None
    samples = timeline.samples
    if len(samples) < 2:
        raise UserError("--plot: the run took fewer than two engine steps; nothing to draw")

    t = [s.t_s for s in samples]
    bands = [(f"experts {b}-bit", [s.expert_bytes_by_bits[b] / MIB for s in samples], plt.cm.viridis(i / len(BIT_WIDTHS)))
             for i, b in enumerate(sorted(BIT_WIDTHS, reverse=True))]
    bands += [
        ("dense weights", [s.dense_bytes / MIB for s in samples], "#7f7f7f"),
        ("workspace", [s.workspace_bytes / MIB for s in samples], "#c7c7c7"),
        ("in transit", [s.transit_bytes / MIB for s in samples], "#ff7f0e"),
        ("KV used", [s.kv_used_bytes / MIB for s in samples], "#1f77b4"),
        ("KV free", [s.kv_free_bytes / MIB for s in samples], "#aec7e8"),
        ("free", [s.free_bytes / MIB for s in samples], "#f7f7f7"),
    ]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.stackplot(t, *[values for _, values, _ in bands], labels=[name for name, _, _ in bands],
                  colors=[color for _, _, color in bands], linewidth=0)
    top.axhline(timeline.budget_bytes / MIB, color="black", linestyle="--", linewidth=1, label="budget")
    preemptions = timeline.event_times("num_preemptions")
    if preemptions:
        top.plot(preemptions, [timeline.budget_bytes / MIB] * len(preemptions), marker="v", color="red",
                 linestyle="none", markersize=7, clip_on=False, label=f"preemption ({len(preemptions)})")
    top.set_ylabel("MiB")
    top.set_ylim(0, timeline.budget_bytes / MIB * 1.02)
    top.set_title(title)
    top.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)

    bottom.plot(t, [s.mean_bits for s in samples], color="#2ca02c", label="mean expert bits")
    bottom.set_ylabel("mean bits")
    bottom.set_ylim(min(BIT_WIDTHS) - 0.2, max(BIT_WIDTHS) + 0.2)
    moves = bottom.twinx()
    moves.step(t, [s.num_page_moves - samples[0].num_page_moves for s in samples], where="post", color="#9467bd",
               label="page moves (cumulative)")
    moves.set_ylabel("page moves")
    lines = bottom.get_lines() + moves.get_lines()
    bottom.legend(lines, [line.get_label() for line in lines], loc="center left", bbox_to_anchor=(1.08, 0.5), fontsize=8)
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
