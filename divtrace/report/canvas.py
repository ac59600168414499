"""What divtrace's pictures share: the Axes, the lane where bit-identical sites are drawn,
log axes, heatmaps, and one marker and colour per module type in every picture."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from divtrace.errors import DivtraceValueError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["IDENTICAL", "LEGEND", "MARKERS", "METRICS", "axes", "check_metric", "empty", "lane",
           "log_axis", "log_heatmap", "site_ticks", "style"]

METRICS = ("rel_l2", "max_abs", "mean_abs", "max_ulp", "mismatch", "exceed")
MARKERS = "osD^v<>pX*hP"
IDENTICAL = "bit-identical"
LEGEND = {"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0),
          "frameon": False, "borderaxespad": 0.0}
#: The usual module types, each with its own marker and colour; others get one from
#: their name (the same in every picture).
_KNOWN = ("Conv2d", "Linear", "ReLU", "MaxPool2d", "BatchNorm2d", "Dropout", "LayerNorm",
          "GELU", "Embedding", "Tanh", "SiLU", "AdaptiveAvgPool2d", "Conv1d", "Sigmoid",
          "Softmax", "Identity", "Flatten", "AvgPool2d", "Hardswish", "MultiheadAttention")
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def style(kind: str) -> tuple[str, str]:
    """The marker and colour of a module type: the same in every picture."""
    index = _KNOWN.index(kind) if kind in _KNOWN else zlib.crc32(kind.encode()) % 97
    return MARKERS[index % len(MARKERS)], _COLOURS[index % len(_COLOURS)]


def check_metric(metric: str, allowed: Sequence[str] = METRICS) -> None:
    if metric not in allowed:
        raise DivtraceValueError(
            f"metric {metric!r} cannot be plotted; choose one of {', '.join(allowed)}")


def axes(ax: Axes | None, size: tuple[float, float] = (10, 4.5)) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size)[1]


def lane(ax: Axes, side: str = "bottom") -> Axes:
    """A strip beside ``ax`` (sharing its site axis) where bit-identical sites are drawn."""
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    divider = make_axes_locatable(ax)
    if side == "bottom":
        strip = divider.append_axes("bottom", size="14%", pad=0.06, sharex=ax)
        strip.set_yticks([0], [IDENTICAL], fontsize=7)
        strip.set_ylim(-1, 1)
        ax.tick_params(labelbottom=False)
    else:
        strip = divider.append_axes("left", size="16%", pad=0.06, sharey=ax)
        strip.set_xticks([0], [IDENTICAL], fontsize=7)
        strip.set_xlim(-1, 1)
        ax.tick_params(labelleft=False)
    strip.set_facecolor("0.95")
    return strip


def site_ticks(axis: Axes, names: list[str]) -> None:
    """Site names under the sites, thinned out when there are too many to read."""
    step = max(1, len(names) // 60)
    ticks = np.arange(0, len(names), step)
    axis.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize=7)


def log_axis(ax: Axes, values: np.ndarray, axis: str = "y") -> None:
    """A log axis spanning at least two decades around the positive values."""
    positive = values[np.isfinite(values) & (values > 0)]
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    if positive.size:
        low, high = np.log10(positive.min()), np.log10(positive.max())
        middle = (low + high) / 2
        limits = (10 ** min(low - 0.3, middle - 1), 10 ** max(high + 0.3, middle + 1))
        (ax.set_ylim if axis == "y" else ax.set_xlim)(*limits)


def empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10)
    ax.set_yticks([])


def decades(values: np.ndarray) -> tuple[np.ndarray, float, float]:
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

    logged, low, high = decades(values)
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
