"""Every picture of divtrace — comparisons and sweeps — drawn with matplotlib onto a given
(or new) Axes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from divtrace.errors import DivtraceValueError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.report.comparison import Comparison
    from divtrace.sweep import BatchSweep, Sweep

__all__ = ["log_heatmap", "overlay", "plot_batch_sweep", "plot_samples", "plot_snowball",
           "plot_sources", "plot_sweep"]

METRICS = ("rel_l2", "max_abs", "mean_abs", "max_ulp", "mismatch", "exceed")
_MARKERS = "osD^v<>pX*hP"
_FLOOR_LABEL = "bit-identical"


def _check_metric(metric: str, allowed: Sequence[str] = METRICS) -> None:
    if metric not in allowed:
        raise DivtraceValueError(
            f"metric {metric!r} cannot be plotted; choose one of {', '.join(allowed)}")


def _axes(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(10, 4.5))[1]


def _leaf_rows(result: Comparison) -> pd.DataFrame:
    table = result.table
    return table[table["leaf"] & (table["status"] == "ok")].reset_index(drop=True)


def _floor(values: list[np.ndarray]) -> float:
    """Where bit-identical sites are drawn: a decade below the smallest positive value."""
    positive = np.concatenate([v[v > 0] for v in values]) if values else np.array([])
    if positive.size == 0:
        return 1e-10
    return 10.0 ** (math.floor(math.log10(float(positive.min()))) - 1)


def _draw_floor(ax: Axes, floor: float) -> None:
    ax.axhspan(floor / 3, floor * 3, color="0.85", zorder=0, label=_FLOOR_LABEL)
    ax.set_yscale("log")


def plot_snowball(result: Comparison, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """``metric`` against depth (leaf sites in execution order), log scale.

    Bit-identical sites sit on a grey floor band instead of being dropped; each module
    type has its own marker; a dashed line marks the first divergent leaf site.
    """
    _check_metric(metric)
    ax = _axes(ax)
    rows = _leaf_rows(result)
    values = rows[metric].to_numpy(dtype=float)
    floor = _floor([values])
    shown = np.where(values > 0, values, floor)
    depth = np.arange(len(rows))
    _draw_floor(ax, floor)
    ax.plot(depth, shown, color="0.6", linewidth=1, zorder=1)
    for i, (kind, group) in enumerate(rows.groupby("module_type", sort=False)):
        ax.scatter(group.index, shown[group.index], marker=_MARKERS[i % len(_MARKERS)],
                   s=36, zorder=3, label=kind)
    if "local_rel_l2" in rows and metric == "rel_l2":
        local = rows["local_rel_l2"].to_numpy(dtype=float)
        own = local > 0
        ax.scatter(depth[own], local[own], s=90, facecolors="none", edgecolors="black",
                   linewidths=1, zorder=4, label="local (replayed on identical input)")
    if "batched_err_fp64" in rows and metric == "rel_l2":
        for column, style, label in (("batched_err_fp64", "--", "batched vs float64"),
                                     ("split_err_fp64", ":", "split vs float64")):
            values = rows[column].to_numpy(dtype=float)
            ax.plot(depth, np.where(values > 0, values, floor), linestyle=style,
                    color="0.3", linewidth=1, zorder=1, label=label)
    diverged = np.flatnonzero(rows["mismatch"].to_numpy() > 0)
    if diverged.size:
        at = int(diverged[0])
        ax.axvline(at, color="crimson", linestyle="--", linewidth=1, zorder=2,
                   label=f"first divergence: {rows['site'][at]}")
    if len(rows) <= 80:
        ax.set_xticks(depth, rows["site"], rotation=90, fontsize=7)
    ax.set_xlabel("depth (leaf sites in execution order)")
    ax.set_ylabel(f"{metric} (batched vs split)")
    ax.set_title(f"divtrace: {metric} by depth")
    ax.legend(fontsize=7, loc="upper left")
    return ax


def plot_sources(result: Comparison, ax: Axes | None = None) -> Axes:
    """The sources' rel_l2 as bars, labelled with the kernel families each run used."""
    from divtrace.explain.profiling import kernel_family

    ax = _axes(ax)
    sources = result.sources
    if sources.empty:
        ax.text(0.5, 0.5, "no sources: every leaf site is bit-identical or a carrier",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return ax
    labels = []
    for row in sources.itertuples():
        label = f"{row.site} ({row.module_type})"
        if "kernels_batched" in sources:
            def families(names: str) -> str:
                found = dict.fromkeys(kernel_family(k) for k in str(names).split("; ") if k)
                return ", ".join(found) or "-"
            label += (f"\nbatched: {families(row.kernels_batched)}"
                      f"\nsplit: {families(row.kernels_split)}")
        labels.append(label)
    position = np.arange(len(sources))
    ax.barh(position, sources["rel_l2"].to_numpy(dtype=float), color="crimson",
            label="rel_l2 (batched vs split)")
    if "local_rel_l2" in sources:
        ax.scatter(sources["local_rel_l2"].to_numpy(dtype=float), position, color="black",
                   zorder=3, label="local (replayed)")
    ax.set_yticks(position, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("rel_l2")
    ax.set_title("divtrace: sources of divergence")
    ax.legend(fontsize=7, loc="lower right")
    return ax


def log_heatmap(ax: Axes, values: np.ndarray, metric: str) -> None:
    """Draws log10(values) as a heatmap with a colour bar; zeros (bit-identical) grey."""
    import matplotlib as mpl

    with np.errstate(divide="ignore"):
        logged = np.log10(values)
    finite = logged[np.isfinite(logged)]
    low = float(finite.min()) if finite.size else -10.0
    high = float(finite.max()) if finite.size else low + 1
    cmap = mpl.colormaps["viridis"].with_extremes(under="0.9", bad="0.9")
    image = ax.imshow(np.where(np.isfinite(logged), logged, low - 1), aspect="auto",
                      cmap=cmap, vmin=low, vmax=max(high, low + 1e-9),
                      interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, label=f"log10 {metric} (grey: bit-identical)")


def plot_samples(result: Comparison, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """A sample × site heatmap of log10(``metric``); bit-identical cells are light grey."""
    _check_metric(metric, ("rel_l2", "max_abs", "mismatch"))
    ax = _axes(ax)
    rows = _leaf_rows(result)
    samples = result.samples
    grid = samples.pivot(index="sample", columns="site", values=metric)
    grid = grid.reindex(columns=list(rows["site"]))
    log_heatmap(ax, grid.to_numpy(dtype=float), metric)
    if len(rows) <= 80:
        ax.set_xticks(np.arange(len(rows)), rows["site"], rotation=90, fontsize=7)
    if len(grid.index) <= 40:
        ax.set_yticks(np.arange(len(grid.index)), [str(s) for s in grid.index], fontsize=7)
    ax.set_xlabel("site (leaf, execution order)")
    ax.set_ylabel("sample")
    ax.set_title(f"divtrace: {metric} per sample")
    return ax


def overlay(
    comparisons: Sequence[Comparison],
    labels: Sequence[str] | None = None,
    ax: Axes | None = None,
    metric: str = "rel_l2",
) -> Axes:
    """Several snowball curves on one Axes, e.g. a whole network against one of its layers.

    Example:
        >>> import torch, divtrace
        >>> x = torch.randn(6, 4)
        >>> nets = [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4))]
        >>> found = [divtrace.compare(n, x, progress=False) for n in nets]
        >>> ax = divtrace.overlay(found, labels=["Linear", "Sequential"])
    """
    _check_metric(metric)
    if not comparisons:
        raise DivtraceValueError("overlay() needs at least one comparison")
    if labels is None:
        labels = [f"comparison {i}" for i in range(len(comparisons))]
    if len(labels) != len(comparisons):
        raise DivtraceValueError(
            f"overlay() got {len(comparisons)} comparisons but {len(labels)} labels; "
            f"give one label per comparison")
    ax = _axes(ax)
    series = [_leaf_rows(c) for c in comparisons]
    floor = _floor([s[metric].to_numpy(dtype=float) for s in series])
    _draw_floor(ax, floor)
    for i, (rows, label) in enumerate(zip(series, labels, strict=True)):
        values = rows[metric].to_numpy(dtype=float)
        # bit-identical points of different curves sit at slightly different heights
        # inside the floor band, so that one curve does not hide another
        lift = 1.4 ** (i - (len(series) - 1) / 2)
        shown = np.where(values > 0, values, floor * lift)
        noun = "site" if len(rows) == 1 else "sites"
        ax.plot(np.arange(len(rows)), shown, marker=_MARKERS[i % len(_MARKERS)],
                markersize=5, linewidth=1.2, label=f"{label} ({len(rows)} {noun})")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("depth (leaf sites in execution order)")
    ax.set_ylabel(f"{metric} (batched vs split)")
    ax.set_title(f"divtrace: {metric} by depth")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def plot_sweep(sweep: Sweep, ax: Axes | None = None, metric: str = "output_rel_l2") -> Axes:
    """One bar per setting of a sweep; bit-identical settings are drawn on a grey floor."""
    ax = _axes(ax)
    values = sweep.table[metric].to_numpy(dtype=float)
    floor = _floor([values])
    shown = np.where(values > 0, values, floor)
    colors = ["0.7" if v == 0 else "crimson" for v in values]
    position = np.arange(len(values))
    ax.barh(position, shown, color=colors)
    ax.set_yticks(position, list(sweep.table["setting"]), fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(floor * 3, color="0.6", linewidth=1, linestyle=":")
    ax.set_xlabel(f"{metric} (grey: bit-identical)")
    ax.set_title("divtrace: divergence of the output, per setting")
    return ax


def plot_batch_sweep(sweep: BatchSweep, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """A site × batch-size heatmap of log10(``metric``); grey where bit-identical."""
    ax = _axes(ax)
    sites = list(dict.fromkeys(sweep.table["site"]))
    grid = sweep.table.pivot(index="site", columns="batch_size", values=metric)
    grid = grid.reindex(index=sites)
    log_heatmap(ax, grid.to_numpy(dtype=float), metric)
    ax.set_xticks(np.arange(len(grid.columns)), [str(c) for c in grid.columns])
    if len(sites) <= 60:
        ax.set_yticks(np.arange(len(sites)), sites, fontsize=7)
    ax.set_xlabel("batch size of the batched run")
    ax.set_ylabel("site (execution order)")
    ax.set_title("divtrace: where each site starts to diverge")
    return ax
