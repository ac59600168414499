"""The picture of a generation: prompts × steps, how far the logits part, where tokens flip."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from divtrace.report.plot import log_heatmap

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.generate.result import Generation

__all__ = ["plot_generation"]


def plot_generation(found: Generation, ax: Axes | None = None) -> Axes:
    """Prompts × steps: the logits' rel_l2 on a log colour scale (grey: bit-identical),
    token flips marked ×, the first flip of each prompt ringed, steps after a prompt ended
    (or never taken) white."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if ax is None:
        _, ax = plt.subplots(figsize=(min(14.0, 3 + 0.18 * found.new_tokens),
                                      min(10.0, 1.5 + 0.28 * len(found.samples))))
    values = found.grid("logits_rel_l2")
    taken = ~np.isnan(values)
    log_heatmap(ax, np.where(taken, values, 0.0), "logits rel_l2")
    blank = np.where(taken, np.nan, 1.0)
    ax.imshow(blank, aspect="auto", cmap="Greys", vmin=0, vmax=100, interpolation="nearest")
    flips = found.grid("same_token") == 0
    first = found.first_divergence
    rows, steps = np.nonzero(flips)
    if len(rows):
        ax.scatter(steps, rows, marker="x", color="crimson", s=22, linewidths=1.2,
                   label="token differs")
        at = first.dropna(subset=["first_token_split"])
        ax.scatter(at["first_token_split"].astype(int),
                   [found.samples.index(int(p)) for p in at["prompt"]], facecolors="none",
                   edgecolors="crimson", s=90, linewidths=1.2, label="first flip")
        ax.legend(loc="upper left", bbox_to_anchor=(1.25, 1.0), fontsize=7, frameon=False)
    ax.set_yticks(range(len(found.samples)), [str(p) for p in found.samples], fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generation step (0: prefill)")
    ax.set_ylabel("prompt")
    ax.set_title("divtrace: logits of the batched vs the split run, step by step")
    return ax
