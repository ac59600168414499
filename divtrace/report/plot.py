"""Every picture of divtrace — comparisons and sweeps — drawn with matplotlib onto a given
(or new) Axes.

Zero is never drawn as a number: bit-identical sites sit in a lane of their own, beside the
log axis, and a comparison where every site is identical says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pandas as pd

from divtrace.errors import DivtraceValueError
from divtrace.words import versus

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.report.comparison import Comparison

__all__ = ["log_heatmap", "overlay", "plot_batch_sweep", "plot_samples", "plot_snowball",
           "plot_sources", "plot_sweep"]

class Tabled(Protocol):  # a sweep (divtrace.Sweep, divtrace.BatchSweep): drawn from its table
    @property
    def table(self) -> pd.DataFrame: ...


METRICS = ("rel_l2", "max_abs", "mean_abs", "max_ulp", "mismatch", "exceed")
_MARKERS = "osD^v<>pX*hP"
IDENTICAL = "bit-identical"
_LEGEND = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0),
           "frameon": False, "borderaxespad": 0.0}


def _check_metric(metric: str, allowed: Sequence[str] = METRICS) -> None:
    if metric not in allowed:
        raise DivtraceValueError(
            f"metric {metric!r} cannot be plotted; choose one of {', '.join(allowed)}")


def _axes(ax: Axes | None, size: tuple[float, float] = (10, 4.5)) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)[1]


def _lane(ax: Axes, side: str = "bottom") -> Axes:
    """A strip beside ``ax`` (sharing its site axis) where bit-identical sites are drawn."""
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    divider = make_axes_locatable(ax)
    if side == "bottom":
        lane = divider.append_axes("bottom", size="14%", pad=0.06, sharex=ax)
        lane.set_yticks([0], [IDENTICAL], fontsize=7)
        lane.set_ylim(-1, 1)
        ax.tick_params(labelbottom=False)
    else:
        lane = divider.append_axes("left", size="16%", pad=0.06, sharey=ax)
        lane.set_xticks([0], [IDENTICAL], fontsize=7)
        lane.set_xlim(-1, 1)
        ax.tick_params(labelleft=False)
    lane.set_facecolor("0.95")
    return lane


def _leaf_rows(result: Comparison) -> pd.DataFrame:
    table = result.table
    return table[table["leaf"] & (table["status"] == "ok")].reset_index(drop=True)


def _site_ticks(axis: Axes, names: list[str]) -> None:
    """Site names under the sites, thinned out when there are too many to read."""
    step = max(1, len(names) // 60)
    ticks = np.arange(0, len(names), step)
    axis.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize=7)


def _log_axis(ax: Axes, values: np.ndarray, axis: str = "y") -> None:
    """A log axis spanning at least two decades around the positive values."""
    positive = values[np.isfinite(values) & (values > 0)]
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    if positive.size:
        low, high = np.log10(positive.min()), np.log10(positive.max())
        middle = (low + high) / 2
        limits = (10 ** min(low - 0.3, middle - 1), 10 ** max(high + 0.3, middle + 1))
        (ax.set_ylim if axis == "y" else ax.set_xlim)(*limits)


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10)
    ax.set_yticks([])


def plot_snowball(result: Comparison, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """``metric`` against depth (leaf sites in execution order) on a log axis.

    Bit-identical sites sit in the lane below; each module type has its own marker, and
    op sites (``ops=True``) one of their own; a dashed line marks the first divergence;
    rings mark the layers that add error of their own (with the ``"local"`` probe, whose own
    error is drawn as small dots).
    """
    _check_metric(metric)
    ax = _axes(ax)
    rows = _leaf_rows(result)
    values = rows[metric].to_numpy(dtype=float)
    depth, positive = np.arange(len(rows)), values > 0
    lane = _lane(ax)
    kinds = rows["module_type"].where(rows["op"] == "", "op sites (ATen)")
    for i, (kind, group) in enumerate(rows.groupby(kinds, sort=False)):
        marker = _MARKERS[i % len(_MARKERS)]
        at = group.index.to_numpy()
        shown = at[positive[at]]
        dot = ax.scatter(depth[shown], values[shown], marker=marker, s=34, zorder=3, label=kind)
        still = at[~positive[at]]
        lane.scatter(depth[still], np.zeros(len(still)), marker=marker, s=28, zorder=3,
                     color=dot.get_facecolor()[0] if len(shown) else f"C{i % 10}")
    if positive.any():
        ax.plot(depth[positive], values[positive], color="0.75", linewidth=1, zorder=1)
        _extras(ax, rows, depth, metric, result.meta.names)
        extra = [rows[c].to_numpy(dtype=float) for c in ("local_rel_l2", "b_err_fp64",
                                                         "a_err_fp64")
                 if c in rows and metric == "rel_l2"]
        _log_axis(ax, np.concatenate([values, *extra]))
    else:
        _empty(ax, f"all {len(rows)} leaf sites are bit-identical in both runs")
    diverged = np.flatnonzero(rows["mismatch"].to_numpy() > 0)
    if diverged.size:
        at = int(diverged[0])
        for axis in (ax, lane):
            axis.axvline(at, color="crimson", linestyle="--", linewidth=1, zorder=2,
                         label=f"first divergence: {rows['site'][at]}" if axis is ax else None)
    _site_ticks(lane, list(rows["site"]))
    lane.set_xlabel("depth (leaf sites in execution order)")
    ax.set_ylabel(f"{metric} ({versus(result.meta.names)})")
    ax.set_title(f"divtrace: {metric} by depth")
    ax.legend(**_LEGEND)
    return ax


def _extras(ax: Axes, rows: pd.DataFrame, depth: np.ndarray, metric: str,
            names: tuple[str, str]) -> None:
    """The layers that add error, their own error, and the float64 lines."""
    values = rows[metric].to_numpy(dtype=float)
    if "adds_error" in rows:
        adds = ((rows["adds_error"] == True).fillna(False).to_numpy(dtype=bool)  # noqa: E712
                & (values > 0))  # (<NA>: not replayed)
        ax.scatter(depth[adds], values[adds], s=110, facecolors="none", edgecolors="black",
                   linewidths=1.2, zorder=4, label="adds error of its own")
    if "local_rel_l2" in rows and metric == "rel_l2":
        local = rows["local_rel_l2"].to_numpy(dtype=float)
        own = local > 0
        ax.scatter(depth[own], local[own], s=10, color="black", zorder=5,
                   label="local (replayed on identical input)")
    if "b_err_fp64" in rows and metric == "rel_l2":
        for column, style, label in (("b_err_fp64", "--", f"{names[1]} vs float64"),
                                     ("a_err_fp64", ":", f"{names[0]} vs float64")):
            error = rows[column].to_numpy(dtype=float)
            ax.plot(depth, np.where(error > 0, error, np.nan), linestyle=style, color="0.3",
                    linewidth=1, zorder=1, label=label)


def plot_sources(result: Comparison, ax: Axes | None = None) -> Axes:
    """Where error enters: every layer that adds error of its own (the sources, and with
    ``"local"`` every layer whose replay on identical inputs differs), its own error
    beside the divergence at its output, labelled with the kernel families each run
    launched (with ``"kernels"``)."""
    from divtrace.explain.profiling import kernel_family

    ax = _axes(ax)
    table = result.table
    ok = table[table["leaf"] & (table["status"] == "ok")]
    local = "adds_error" in table
    rows = (ok[(ok["adds_error"] == True) | (ok["role"] == "source")] if local  # noqa: E712
            else ok[ok["role"] == "source"])
    if rows.empty:
        _empty(ax, "no layer adds error: every leaf site is bit-identical or only carries")
        ax.set_axis_off()
        return ax
    own = (rows["local_rel_l2"] if local else rows["rel_l2"]).to_numpy(dtype=float)
    labels = []
    for row in rows.itertuples():
        label = f"{row.site} ({row.module_type})"
        if "kernels_b" in rows:
            def families(names: str) -> str:
                found = dict.fromkeys(kernel_family(k) for k in str(names).split("; ") if k)
                return ", ".join(found) or "-"
            label += (f"\n{result.meta.names[1]}: {families(row.kernels_b)}"
                      f"\n{result.meta.names[0]}: {families(row.kernels_a)}")
        labels.append(label)
    position = np.arange(len(rows))
    ax.scatter(own, position, color="crimson", s=36, zorder=3,
               label="error of its own (replayed on identical input)" if local
               else "divergence at the source")
    if local:
        ax.scatter(rows["rel_l2"].to_numpy(dtype=float), position, facecolors="none",
                   edgecolors="black", s=36, zorder=3, label="divergence at its output")
    ax.set_yticks(position, labels, fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    _log_axis(ax, np.concatenate([own, rows["rel_l2"].to_numpy(dtype=float)]), axis="x")
    ax.grid(axis="x", color="0.9", linewidth=0.8)
    ax.set_xlabel("rel_l2")
    ax.set_title("divtrace: where error enters")
    ax.legend(**_LEGEND)
    return ax


def _decades(values: np.ndarray) -> tuple[np.ndarray, float, float]:
    """log10 of the positive values, and a colour range of at least two decades."""
    with np.errstate(divide="ignore"):
        logged = np.log10(values)
    finite = logged[np.isfinite(logged)]
    low = float(finite.min()) if finite.size else -8.0
    high = float(finite.max()) if finite.size else low
    if high - low < 2:  # never stretch a sliver of noise over the whole scale
        middle = (high + low) / 2
        low, high = middle - 1, middle + 1
    return logged, low, high


def log_heatmap(ax: Axes, values: np.ndarray, metric: str) -> None:
    """Draws ``values`` on a log colour scale of at least two decades, with a colour bar
    labelled in powers of ten; zeros (bit-identical) light grey."""
    import matplotlib as mpl
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    logged, low, high = _decades(values)
    cmap = mpl.colormaps["viridis"].with_extremes(under="0.88", bad="0.88")
    image = ax.imshow(np.where(np.isfinite(logged), logged, low - 1), aspect="auto",
                      cmap=cmap, vmin=low, vmax=high, interpolation="nearest")
    if not np.isfinite(logged).any():  # nothing to colour: say so, no scale of nothing
        ax.text(0.5, 0.5, f"every cell is {IDENTICAL}", ha="center", va="center",
                transform=ax.transAxes, fontsize=10)
        return
    bar = ax.figure.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"1e{int(v)}"))
    bar.set_label(f"{metric} (grey: {IDENTICAL})", fontsize=8)
    bar.ax.tick_params(labelsize=7)


def plot_samples(result: Comparison, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """A sample × site heatmap of ``metric`` over the leaf sites; bit-identical cells grey."""
    _check_metric(metric, ("rel_l2", "max_abs", "mismatch"))
    ax = _axes(ax)
    rows = _leaf_rows(result)
    grid = result.per_sample.pivot(index="sample", columns="site", values=metric)
    grid = grid.reindex(columns=list(rows["site"]))
    log_heatmap(ax, grid.to_numpy(dtype=float), metric)
    _site_ticks(ax, list(rows["site"]))
    step = max(1, len(grid.index) // 40)
    ax.set_yticks(np.arange(0, len(grid.index), step),
                  [str(s) for s in grid.index[::step]], fontsize=7)
    ax.set_xlabel("site (leaf, execution order)")
    ax.set_ylabel("sample")
    ax.set_title(f"divtrace: {metric} per sample")
    return ax


def overlay(comparisons: Sequence[Comparison], labels: Sequence[str] | None = None,
            ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """Several snowball curves on one Axes, e.g. a whole network against one of its layers;
    each curve's bit-identical sites in its own row of the lane below.

    Example:
        >>> import torch, divtrace
        >>> x = torch.randn(6, 4)
        >>> nets = [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4))]
        >>> found = [divtrace.compare(n, x, progress=False) for n in nets]
        >>> ax = divtrace.overlay(found, labels=["Linear", "Sequential"])
    """
    from matplotlib.ticker import MaxNLocator

    _check_metric(metric)
    if not comparisons:
        raise DivtraceValueError("overlay() needs at least one comparison")
    labels = [f"comparison {i}" for i in range(len(comparisons))] if labels is None else labels
    if len(labels) != len(comparisons):
        raise DivtraceValueError(
            f"overlay() got {len(comparisons)} comparisons but {len(labels)} labels; "
            f"give one label per comparison")
    ax = _axes(ax)
    lane = _lane(ax)
    lane.set_ylim(-0.7, len(comparisons) - 0.3)
    lane.set_yticks([(len(comparisons) - 1) / 2], [IDENTICAL], fontsize=7)
    drawn: list[np.ndarray] = []
    for i, (result, label) in enumerate(zip(comparisons, labels, strict=True)):
        rows = _leaf_rows(result)
        values = rows[metric].to_numpy(dtype=float)
        depth, positive = np.arange(len(rows)), values > 0
        marker, noun = _MARKERS[i % len(_MARKERS)], "site" if len(rows) == 1 else "sites"
        line = ax.plot(depth[positive], values[positive], marker=marker, markersize=5,
                       linewidth=1.2, label=f"{label} ({len(rows)} {noun})")[0]
        lane.scatter(depth[~positive], np.full(int((~positive).sum()), i), marker=marker,
                     s=22, color=line.get_color())
        drawn.append(values[positive])
    if any(v.size for v in drawn):
        _log_axis(ax, np.concatenate(drawn))
    else:
        _empty(ax, f"every site of every comparison is {IDENTICAL}")
    lane.xaxis.set_major_locator(MaxNLocator(integer=True))
    lane.set_xlabel("depth (leaf sites in execution order)")
    names = {result.meta.names for result in comparisons}  # the same two runs in all?
    ax.set_ylabel(f"{metric} ({versus(names.pop() if len(names) == 1 else ('run a', 'run b'))})")
    ax.set_title(f"divtrace: {metric} by depth")
    ax.legend(**_LEGEND)
    return ax


def plot_sweep(sweep: Tabled, ax: Axes | None = None, metric: str = "output_rel_l2") -> Axes:
    """One point per setting on a log axis; bit-identical settings in the lane on the left."""
    ax = _axes(ax, (8, 0.6 + 0.4 * len(sweep.table)))
    values = sweep.table[metric].to_numpy(dtype=float)
    position, positive = np.arange(len(values)), values > 0
    lane = _lane(ax, side="left")
    ax.scatter(values[positive], position[positive], color="crimson", s=40, zorder=3)
    for x, y in zip(values[positive], position[positive], strict=True):
        ax.annotate(f"{x:.2g}", (x, y), textcoords="offset points", xytext=(6, -3), fontsize=7)
    lane.scatter(np.zeros(int((~positive).sum())), position[~positive], color="0.5", s=40)
    lane.set_yticks(position, list(sweep.table["setting"]), fontsize=8)
    lane.set_ylim(len(values) - 0.5, -0.5)
    if positive.any():
        ax.set_xscale("log")
        ax.grid(axis="x", color="0.9", linewidth=0.8)
    else:
        _empty(ax, f"every setting is {IDENTICAL}")
    ax.set_xlabel(metric)
    ax.set_title("divtrace: divergence of the output, per setting")
    return ax


def plot_batch_sweep(sweep: Tabled, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """A site × batch-size heatmap of ``metric``; grey where bit-identical."""
    ax = _axes(ax)
    sites = list(dict.fromkeys(sweep.table["site"]))
    grid = sweep.table.pivot(index="site", columns="batch_size", values=metric)
    grid = grid.reindex(index=sites)
    log_heatmap(ax, grid.to_numpy(dtype=float), metric)
    ax.set_xticks(np.arange(len(grid.columns)), [str(c) for c in grid.columns], fontsize=8)
    step = max(1, len(sites) // 60)
    ax.set_yticks(np.arange(0, len(sites), step), sites[::step], fontsize=7)
    ax.set_xlabel("batch size of the batched run")
    ax.set_ylabel("site (execution order)")
    ax.set_title("divtrace: where each site starts to diverge")
    return ax
