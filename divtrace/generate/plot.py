"""The picture of a generation: prompts × steps, how far the logits part, where tokens flip."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from divtrace.report.canvas import log_heatmap

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.generate.result import Generation

__all__ = ["plot_generation"]


def plot_generation(found: Generation, ax: Axes | None = None) -> Axes:
    """Prompts × steps: the logits' rel_l2 on a log colour scale (grey: bit-identical)
    while both runs still see the same tokens; after a prompt's first flip (ringed) its
    runs see different inputs: those cells are beige, flips marked ×; steps after a
    prompt ended (or never taken) white."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if ax is None:
        _, ax = plt.subplots(figsize=(min(14.0, 3 + 0.18 * found.new_tokens),
                                      min(10.0, 1.5 + 0.28 * len(found.samples))))
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    values = found.grid("logits_rel_l2")
    taken = ~np.isnan(values)
    same = found.grid("same_prefix") == 1
    log_heatmap(ax, np.where(taken & same, values, 0.0), "logits rel_l2 (same inputs)")
    apart = np.where(taken & ~same, 1.0, np.nan)
    ax.imshow(apart, aspect="auto", cmap=ListedColormap(["#f3e3c3"]), vmin=0, vmax=1,
              interpolation="nearest")
    ax.imshow(np.where(taken, np.nan, 1.0), aspect="auto", cmap=ListedColormap(["white"]),
              vmin=0, vmax=1, interpolation="nearest")
    flips = found.grid("same_token") == 0
    first = found.per_prompt
    rows, steps = np.nonzero(flips)
    if len(rows):
        ax.scatter(steps, rows, marker="x", color="crimson", s=22, linewidths=1.2,
                   label="token differs")
        at = first.dropna(subset=["first_token_split"])
        ax.scatter(at["first_token_split"].astype(int),
                   [found.samples.index(int(p)) for p in at["prompt"]], facecolors="none",
                   edgecolors="crimson", s=90, linewidths=1.2, label="first flip")
        handles, _ = ax.get_legend_handles_labels()
        handles.append(Patch(color="#f3e3c3", label="after a flip: inputs differ"))
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12),
                  ncol=3, fontsize=7, frameon=False)
    ax.set_yticks(range(len(found.samples)), [str(p) for p in found.samples], fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generation step (0: prefill)")
    ax.set_ylabel("prompt")
    ax.set_title("divtrace: logits of the batched vs the split run, step by step")
    return ax
