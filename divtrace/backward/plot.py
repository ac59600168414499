"""The pictures of a backward comparison: output gradients in backward order, and the
parameters' gradients in the model's order."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from divtrace.errors import DivtraceValueError
from divtrace.report.canvas import LEGEND, axes, empty, lane, log_axis, site_ticks, style
from divtrace.words import sci

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.backward.result import Backward

__all__ = ["plot_backward"]

_TITLES = {"grad": "output gradients, in the order the batched backward reached them",
           "param": "parameters' gradients, in the model's order"}


def plot_backward(found: Backward, kind: str, ax: Axes | None = None) -> Axes:
    """rel_l2 (batched against accumulated) of one kind of row, log scale; bit-identical
    rows on the lane below; one marker and colour per module type."""
    if kind not in _TITLES:
        raise DivtraceValueError(f"kind must be 'grad' or 'param'; got {kind!r}")
    ax = axes(ax)
    rows = found.of(kind)
    rows = rows[rows["status"] == "ok"].reset_index(drop=True)
    verdict = found.verdict.kind
    ax.set_title(f"batch of {found.settings['batch_size']} vs accumulation over chunks of "
                 f"{found.settings['chunk']}: {_TITLES[kind]} — {verdict}", fontsize=9)
    if rows.empty:
        empty(ax, f"no {kind} row could be compared")
        return ax
    values = rows["rel_l2"].to_numpy(dtype=float)
    same = rows["mismatch"].to_numpy(dtype=float) == 0
    strip = lane(ax)
    for kind_of in rows["type"].fillna("").unique():
        mine = (rows["type"].fillna("") == kind_of).to_numpy()
        marker, colour = style(str(kind_of))
        x = np.flatnonzero(mine & ~same)
        ax.plot(x, values[x], marker, color=colour, markersize=4, linestyle="none",
                label=str(kind_of) or "(model)")
        x = np.flatnonzero(mine & same)
        strip.plot(x, np.zeros(len(x)), marker, color=colour, markersize=4,
                   linestyle="none")
    if (~same).any():
        log_axis(ax, values[~same])
    loss = found.of("loss").iloc[0]
    ax.set_ylabel(f"rel_l2 (loss: {sci(loss['rel_l2'])})")
    ax.legend(**LEGEND)
    site_ticks(strip, rows["site"].tolist())
    return ax
