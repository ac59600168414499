"""The remedies' picture: what each costs against how far apart it leaves the runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from divtrace.words import sci

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.remedies.result import Remedies

__all__ = ["plot_remedies"]


def plot_remedies(remedies: Remedies, ax: Axes | None = None) -> Axes:
    """One row per tried remedy: its cost in run b (filled) and in run a (open), on a log
    axis of time over the bare passes; bit-identical remedies in green, the others in red
    with the output's rel_l2 they leave."""
    import matplotlib.pyplot as plt

    table = remedies.table[remedies.table["identical"].notna()].reset_index(drop=True)
    if ax is None:
        ax = plt.subplots(figsize=(8, 1.2 + 0.45 * max(len(table), 1)))[1]
    a, b = remedies.names
    if table.empty:
        ax.text(0.5, 0.5, remedies.summary().splitlines()[0][:90], ha="center",
                va="center", transform=ax.transAxes, fontsize=9, wrap=True)
        ax.set_axis_off()
        return ax
    rows = np.arange(len(table))
    colours = ["seagreen" if same else "crimson" for same in table["identical"]]
    costs, a_costs = table["cost"].to_numpy(float), table["a_cost"].to_numpy(float)
    for y, (low, high) in enumerate(zip(costs, a_costs, strict=True)):
        ax.plot([low, high], [y, y], color="0.75", linewidth=1, zorder=1)
    ax.scatter(costs, rows, color=colours, s=45, zorder=3, label=f"{b}'s passes")
    ax.scatter(a_costs, rows, facecolors="none", edgecolors=colours, s=45, zorder=3,
               label=f"{a}'s passes")
    for y, row in table.iterrows():
        said = "bit-identical" if row["identical"] else f"rel_l2 {sci(row['output_rel_l2'])}"
        ax.annotate(said, (max(row["cost"], row["a_cost"]), y), textcoords="offset points",
                    xytext=(8, -3), fontsize=7, color="0.3")
    best = remedies.best
    if best is not None:
        at = list(table["remedy"]).index(best.name)
        ax.scatter([table["cost"][at]], [at], marker="*", s=160, color="gold",
                   edgecolors="0.3", zorder=4, label="best")
    low = np.nanmin([*costs, *a_costs, 1.0])
    high = np.nanmax([*costs, *a_costs, 1.0])
    ax.set_xlim(low / 1.25, high * 2.5)  # room for the words on the right
    ax.axvline(1.0, color="0.6", linestyle="--", linewidth=0.8)
    ax.set_yticks(rows, list(table["remedy"]), fontsize=8)
    ax.set_ylim(len(table) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.grid(axis="x", color="0.92", linewidth=0.8)
    ax.set_xlabel("time under the remedy ÷ time without it (log scale; dashed: no cost)")
    ax.set_title(f"divtrace: remedies (without one, the output's rel_l2 is "
                 f"{sci(remedies.before)})", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    return ax
