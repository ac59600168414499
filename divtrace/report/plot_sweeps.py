"""The pictures of sweeps: the output's divergence per setting, and where each site starts
to diverge as the batch grows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import pandas as pd

from divtrace.report.canvas import IDENTICAL, axes, empty, lane, log_heatmap

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Tabled", "plot_batch_sweep", "plot_sweep"]


class Tabled(Protocol):  # a sweep (divtrace.Sweep, divtrace.BatchSweep): drawn from its table
    @property
    def table(self) -> pd.DataFrame: ...


def plot_sweep(sweep: Tabled, ax: Axes | None = None, metric: str = "output_rel_l2",
               model: str | None = None) -> Axes:
    """One point per setting on a log axis; bit-identical settings in the lane on the left."""
    ax = axes(ax, (8, 0.6 + 0.4 * len(sweep.table)))
    values = sweep.table[metric].to_numpy(dtype=float)
    position, positive = np.arange(len(values)), values > 0
    strip = lane(ax, side="left")
    ax.scatter(values[positive], position[positive], color="crimson", s=40, zorder=3)
    for x, y in zip(values[positive], position[positive], strict=True):
        ax.annotate(f"{x:.2g}", (x, y), textcoords="offset points", xytext=(6, -3), fontsize=7)
    strip.scatter(np.zeros(int((~positive).sum())), position[~positive], color="0.5", s=40)
    strip.set_yticks(position, list(sweep.table["setting"]), fontsize=8)
    strip.set_ylim(len(values) - 0.5, -0.5)
    if positive.any():
        ax.set_xscale("log")
        ax.grid(axis="x", color="0.9", linewidth=0.8)
    else:
        empty(ax, f"every setting is {IDENTICAL}")
    ax.set_xlabel(metric)
    ax.set_title(f"{model or 'divtrace'}: the output's {metric.removeprefix('output_')} per "
                 f"setting", fontsize=10)
    return ax


def plot_batch_sweep(sweep: Tabled, ax: Axes | None = None, metric: str = "rel_l2",
                     model: str | None = None) -> Axes:
    """A site × batch-size heatmap of ``metric``; grey where bit-identical."""
    ax = axes(ax)
    sites = list(dict.fromkeys(sweep.table["site"]))
    grid = sweep.table.pivot(index="site", columns="batch_size", values=metric)
    grid = grid.reindex(index=sites)
    log_heatmap(ax, grid.to_numpy(dtype=float), metric)
    ax.set_xticks(np.arange(len(grid.columns)), [str(c) for c in grid.columns], fontsize=8)
    step = max(1, len(sites) // 60)
    ax.set_yticks(np.arange(0, len(sites), step), sites[::step], fontsize=7)
    ax.set_xlabel("batch size of the batched run")
    ax.set_ylabel("site (execution order)")
    ax.set_title(f"{model or 'divtrace'}: where each site starts to diverge as the batch "
                 f"grows", fontsize=10)
    return ax
