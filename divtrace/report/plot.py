"""The pictures of a comparison (the sweeps' are in :mod:`divtrace.report.plot_sweeps`),
drawn with matplotlib onto a given (or new) Axes.

Zero is never drawn as a number: bit-identical sites sit in a lane of their own, beside the
log axis, and a comparison where every site is identical says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import numpy as np
import pandas as pd

from divtrace.errors import DivtraceValueError
from divtrace.explain.rounding import budget
from divtrace.report.canvas import (
    IDENTICAL,
    LEGEND,
    MARKERS,
    axes,
    check_metric,
    empty,
    lane,
    log_axis,
    log_heatmap,
    site_ticks,
    style,
)
from divtrace.words import versus

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.report.comparison import Comparison
    from divtrace.report.result import Result

__all__ = ["overlay", "plot_samples", "plot_snowball", "plot_sources"]


def _sited(result: Result) -> TypeGuard[Comparison]:
    """Whether ``result`` is a comparison (drawn over its leaf sites by depth)."""
    return result.document == "comparison"


def _ok(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[rows["status"] == "ok"].reset_index(drop=True)


def _leaf_rows(result: Comparison) -> pd.DataFrame:
    table = result.table
    return table[table["leaf"] & (table["status"] == "ok")].reset_index(drop=True)


def plot_snowball(result: Comparison, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """``metric`` against depth (leaf sites in execution order) on a log axis.

    Bit-identical sites sit in the lane below; each module type has its own marker, and
    op sites (``ops=True``) one of their own; a dashed line marks the first divergence;
    rings mark the layers that add error of their own (with the ``"local"`` probe, whose own
    error is drawn as small dots).
    """
    check_metric(metric)
    ax = axes(ax)
    rows = _leaf_rows(result)
    values = rows[metric].to_numpy(dtype=float)
    depth, positive = np.arange(len(rows)), values > 0
    # a site that differs with no value of the metric (integers: chosen experts, indices)
    # is no bit-identical one: it is marked apart in the lane
    unvalued = ~positive & (rows["mismatch"].to_numpy(dtype=float) > 0)
    strip = lane(ax)
    kinds = rows["module_type"].where(rows["op"] == "", "op sites (ATen)")
    for kind, group in rows.groupby(kinds, sort=False):
        marker, colour = style(str(kind))
        at = group.index.to_numpy()
        shown, still = at[positive[at]], at[~positive[at] & ~unvalued[at]]
        ax.scatter(depth[shown], values[shown], marker=marker, color=colour, s=34, zorder=3,
                   label=kind)
        strip.scatter(depth[still], np.zeros(len(still)), marker=marker, color=colour, s=28,
                      zorder=3)
    if unvalued.any():
        strip.scatter(depth[unvalued], np.zeros(int(unvalued.sum())), marker="X",
                      color="crimson", s=46, zorder=4)
        ax.scatter([], [], marker="X", color="crimson", s=46,
                   label=f"differs, no {metric} (integers): in the lane")
    if positive.any():
        ax.plot(depth[positive], values[positive], color="0.75", linewidth=1, zorder=1)
        _extras(ax, rows, depth, metric, result.meta.names)
        extra = [rows[c].to_numpy(dtype=float) for c in ("local_rel_l2", "b_err_fp64",
                                                         "a_err_fp64")
                 if c in rows and metric == "rel_l2"]
        scale = _scale(ax, rows, result) if metric == "rel_l2" else []
        log_axis(ax, np.concatenate([values, *extra, scale]))
    else:
        empty(ax, f"all {len(rows)} leaf sites are bit-identical in both runs")
    diverged = np.flatnonzero(rows["mismatch"].to_numpy() > 0)
    if diverged.size:
        at = int(diverged[0])
        for axis in (ax, strip):
            axis.axvline(at, color="crimson", linestyle="--", linewidth=1, zorder=2,
                         label=f"first divergence: {rows['site'][at]}" if axis is ax else None)
    _flips(ax, strip, rows, result)
    site_ticks(strip, list(rows["site"]))
    strip.set_xlabel("depth (leaf sites in execution order)")
    ax.set_ylabel(f"{metric} ({versus(result.meta.names)})")
    ax.set_title(_title(result, f"{metric} by depth"), fontsize=10)
    ax.legend(**LEGEND)
    return ax


def _flips(ax: Axes, strip: Axes, rows: pd.DataFrame, result: Comparison) -> None:
    """Dotted lines at the routers where tokens went to other experts (the ``"routing"``
    probe's flips), at each router's site of its chosen experts."""
    routers = (result.meta.notes.get("routing") or {}).get("routers") or {}
    sites = list(rows["site"])
    flipped = [(key, router["flips"]) for key, router in routers.items()
               if router["flips"] and f"{key}/2" in sites]
    total = sum(count for _, count in flipped)
    for index, (key, _) in enumerate(flipped):
        at = sites.index(f"{key}/2")
        for axis in (ax, strip):
            axis.axvline(at, color="darkorange", linestyle=":", linewidth=1.4, zorder=2,
                         label=(f"routing flips ({total} tokens), the first at {key}"
                                if axis is ax and index == 0 else None))


def _title(result: Comparison, what: str) -> str:
    """``Sequential: rel_l2 by depth — batch of 8 vs passes of 1; verdict: rounding``."""
    meta, out = result.meta, result.output
    model = "model" if out is None else str(out["module_type"])
    runs = (f"batch of {meta.batch_size} vs passes of {meta.a_chunk}" if meta.runs is None
            else versus(meta.names))
    return f"{model}: {what} — {runs}; verdict: {result.verdict}"


def _scale(ax: Axes, rows: pd.DataFrame, result: Comparison) -> list[float]:
    """Lines for the scale of rounding: the unit roundoff of the sites' dtype and the
    rounding budget of the verdict (where error may enter as rounding)."""
    limit, u_op, name = budget(str(rows["dtype"].iloc[0]), result.meta)
    drawn = []
    for value, text, dash in ((u_op, f"{name} unit roundoff ({u_op:.2g})", ":"),
                              (limit, f"rounding budget ({limit:.2g})", "-.")):
        if np.isfinite(value) and value > 0:
            ax.axhline(value, color="0.45", linestyle=dash, linewidth=1, zorder=1, label=text)
            drawn.append(value)
    return drawn


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

    ax = axes(ax)
    table = result.table
    ok = table[table["leaf"] & (table["status"] == "ok")]
    local = "adds_error" in table
    rows = (ok[(ok["adds_error"] == True) | (ok["role"] == "source")] if local  # noqa: E712
            else ok[ok["role"] == "source"])
    if rows.empty:
        empty(ax, "no layer adds error: every leaf site is bit-identical or only carries")
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
    log_axis(ax, np.concatenate([own, rows["rel_l2"].to_numpy(dtype=float)]), axis="x")
    ax.grid(axis="x", color="0.9", linewidth=0.8)
    ax.set_xlabel("rel_l2")
    ax.set_title(_title(result, "where error enters"), fontsize=10)
    ax.legend(**LEGEND)
    return ax


def plot_samples(result: Comparison, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """A sample × site heatmap of ``metric`` over the leaf sites; bit-identical cells grey."""
    check_metric(metric, ("rel_l2", "max_abs", "mismatch"))
    ax = axes(ax)
    rows = _leaf_rows(result)
    grid = result.per_sample.pivot(index="sample", columns="site", values=metric)
    grid = grid.reindex(columns=list(rows["site"]))
    log_heatmap(ax, grid.to_numpy(dtype=float), metric)
    site_ticks(ax, list(rows["site"]))
    step = max(1, len(grid.index) // 40)
    ax.set_yticks(np.arange(0, len(grid.index), step),
                  [str(s) for s in grid.index[::step]], fontsize=7)
    ax.set_xlabel("site (leaf, execution order)")
    ax.set_ylabel("sample")
    ax.set_title(_title(result, f"{metric} per sample"), fontsize=10)
    return ax


def overlay(comparisons: Sequence[Result], labels: Sequence[str] | None = None,
            ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
    """Several snowball curves on one Axes, e.g. a whole network against one of its layers;
    each curve's bit-identical sites in its own row of the lane below. Results other than
    comparisons are drawn over their rows (:meth:`~divtrace.report.result.Result.rows`)
    in order.

    Example:
        >>> import torch, divtrace
        >>> x = torch.randn(6, 4)
        >>> nets = [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4))]
        >>> found = [divtrace.compare(n, x, progress=False) for n in nets]
        >>> ax = divtrace.overlay(found, labels=["Linear", "Sequential"])
    """
    from matplotlib.ticker import MaxNLocator

    check_metric(metric)
    if not comparisons:
        raise DivtraceValueError("overlay() needs at least one comparison")
    sites = all(_sited(result) for result in comparisons)
    verdicts = [result._shade() for result in comparisons]  # each judged once
    labels = [f"comparison {i}" for i in range(len(comparisons))] if labels is None else labels
    if len(labels) != len(comparisons):
        raise DivtraceValueError(
            f"overlay() got {len(comparisons)} comparisons but {len(labels)} labels; "
            f"give one label per comparison")
    ax = axes(ax)
    strip = lane(ax)
    strip.set_ylim(-0.7, len(comparisons) - 0.3)
    strip.set_yticks([(len(comparisons) - 1) / 2], [IDENTICAL], fontsize=7)
    drawn: list[np.ndarray] = []
    for i, (result, label, verdict) in enumerate(zip(comparisons, labels, verdicts,
                                                     strict=True)):
        rows = _leaf_rows(result) if _sited(result) else _ok(result.rows())
        values = rows[metric].to_numpy(dtype=float)
        depth, positive = np.arange(len(rows)), values > 0
        marker = MARKERS[i % len(MARKERS)]
        noun = ("site" if sites else "row") + ("" if len(rows) == 1 else "s")
        line = ax.plot(depth[positive], values[positive], marker=marker, markersize=5,
                       linewidth=1.2, label=f"{label} ({len(rows)} {noun}"
                       f"{'' if verdict is None else '; ' + verdict})")[0]
        strip.scatter(depth[~positive], np.full(int((~positive).sum()), i), marker=marker,
                     s=22, color=line.get_color())
        drawn.append(values[positive])
    if any(v.size for v in drawn):
        log_axis(ax, np.concatenate(drawn))
    else:
        empty(ax, f"every site of every comparison is {IDENTICAL}")
    strip.xaxis.set_major_locator(MaxNLocator(integer=True))
    strip.set_xlabel("depth (leaf sites in execution order)" if sites else "rows in order")
    names = {result.meta.names for result in comparisons  # the same two runs in all?
             if _sited(result)}
    ax.set_ylabel(f"{metric} ({versus(names.pop() if len(names) == 1 else ('run a', 'run b'))})")
    noun, said = ("comparison" if sites else "result"), " (each one's verdict in the legend)"
    ax.set_title(f"divtrace: {metric} by {'depth' if sites else 'row'}, {len(comparisons)} "
                 f"{noun}{'s' if len(comparisons) > 1 else ''}"
                 f"{said if any(verdicts) else ''}", fontsize=10)
    ax.legend(**LEGEND)
    return ax


