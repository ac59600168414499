"""A comparison's figures per token (the ``"tokens"`` probe's): log-probabilities of the
next tokens in both runs, and each token's error at every block, as tables and a plot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from divtrace.errors import DivtraceValueError
from divtrace.report.canvas import log_heatmap
from divtrace.words import the

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from divtrace.report.comparison import Comparison

__all__ = ["TokenFigures", "token_figures"]

#: The columns of :attr:`TokenFigures.logprobs`, one row per (prompt, next token).
LOGPROB_COLUMNS = ("prompt", "position", "token", "logprob_a", "logprob_b", "delta",
                   "argmax_a", "argmax_b", "flip")


@dataclass(frozen=True)
class TokenFigures:
    """Per token: ``logprobs`` (one row per prompt and next token: its position in the
    sequence, its id, the log-probability each run gives it, ``delta`` = |a − b|, each
    run's most likely token and whether they differ) and ``layers`` (one row per block
    site, prompt and token: the token's rel_l2 there); ``names``: runs a and b."""

    logprobs: pd.DataFrame
    layers: pd.DataFrame
    tolerance: float
    names: tuple[str, str]

    def summary(self) -> str:
        """The figures a reinforcement-learning user watches, in a sentence."""
        table = self.logprobs
        if table.empty:
            return "No next token was compared (the output's logits were not compared)."
        delta = table["delta"].to_numpy()
        if not (delta > 0).any():
            return (f"Identical log-probabilities for all {len(table)} tokens in "
                    f"{the(self.names[0])} and {the(self.names[1])}.")
        over = int((delta > self.tolerance).sum())
        flips = int(table["flip"].sum())
        return (f"|Δlogprob| over {len(table)} tokens: max {delta.max():.3g}, mean "
                f"{delta.mean():.3g}; {over} ({over / len(table):.1%}) beyond "
                f"{self.tolerance:g}; {flips} argmax flip{'s' * (flips != 1)}.")

    def grid(self) -> tuple[np.ndarray, list[str], list[tuple[int, int]]]:
        """Blocks × tokens (every compared prompt's, end to end): the rel_l2 of each
        token at each block (NaN where a block holds no such token); the block names; per
        prompt, its first column and token count."""
        layers = self.layers
        if layers.empty:
            return np.zeros((0, 0)), [], []
        sites = list(dict.fromkeys(layers["site"]))
        spans: list[tuple[int, int]] = []
        columns: dict[tuple[int, int], int] = {}
        for prompt, rows in layers.groupby("prompt", sort=True):
            positions = sorted(set(rows["position"]))
            spans.append((len(columns), len(positions)))
            for position in positions:
                columns[int(prompt), int(position)] = len(columns)
        values = np.full((len(sites), len(columns)), np.nan)
        at = {site: i for i, site in enumerate(sites)}
        for site, prompt, position, rel in layers[["site", "prompt", "position",
                                                   "rel_l2"]].itertuples(index=False):
            values[at[site], columns[int(prompt), int(position)]] = rel
        return values, sites, spans

    def plot(self, path: Any = None) -> Figure:
        """Blocks × tokens, the rel_l2 of each token at each block (log colours; grey:
        bit-identical, white: no such token), over |Δlogprob| of each next token against
        the tolerance; saved to ``path`` when given."""
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap

        values, sites, spans = self.grid()
        figure, (top, bottom) = plt.subplots(
            2, 1, figsize=(11, 3 + 0.16 * max(len(sites), 8)),
            gridspec_kw={"height_ratios": [max(len(sites), 4), 4]}, constrained_layout=True)
        if values.size:
            log_heatmap(top, np.nan_to_num(values, nan=0.0), "token rel_l2")
            top.imshow(np.where(np.isnan(values), 1.0, np.nan), aspect="auto",
                       cmap=ListedColormap(["white"]), vmin=0, vmax=1, interpolation="nearest")
            top.set_yticks(range(len(sites)), sites, fontsize=6)
            for first, _count in spans[1:]:
                top.axvline(first - 0.5, color="white", linewidth=1.5)
        names = [str(p) for p in sorted(set(self.layers["prompt"]))] if spans else []
        top.set_xticks([first + count / 2 - 0.5 for first, count in spans], names,
                       fontsize=6 if len(names) > 8 else 7)
        top.set_xlabel("prompt (its tokens, end to end)", fontsize=8)
        top.set_title(f"divtrace: each token's error at each block, {self.names[1]} vs "
                      f"{self.names[0]}", fontsize=10)
        table = self.logprobs
        if not table.empty:
            delta = table["delta"].to_numpy()
            shown = np.where(delta > 0, delta, np.nan)
            bottom.scatter(range(len(table)), shown, s=8, color="#3b6ea8",
                           label="|Δlogprob| of the next token")
            zeros = np.flatnonzero(delta == 0)
            if zeros.size:
                low = np.nanmin(shown) / 10 if np.isfinite(shown).any() else self.tolerance / 10
                bottom.scatter(zeros, np.full(zeros.size, low), s=8, marker="|",
                               color="0.6", label="identical (drawn below the scale)")
            flips = np.flatnonzero(table["flip"].to_numpy())
            if flips.size:
                bottom.scatter(flips, np.where(np.isfinite(shown[flips]), shown[flips],
                                               self.tolerance), s=40, marker="x",
                               color="crimson", label="argmax flip")
            bottom.axhline(self.tolerance, color="crimson", linewidth=0.8, linestyle="--",
                           label=f"tolerance {self.tolerance:g}")
            bottom.set_yscale("log")
            starts = np.flatnonzero(np.diff(table["prompt"].to_numpy(), prepend=-1))
            for first in starts[1:]:
                bottom.axvline(first - 0.5, color="0.8", linewidth=0.8)
            bottom.set_xlim(-0.5, len(table) - 0.5)
            bottom.set_xlabel("next token (each prompt's generated tokens, end to end)",
                              fontsize=8)
            handles, labels = bottom.get_legend_handles_labels()
            figure.legend(handles, labels, fontsize=7, loc="outside lower center", ncol=4,
                          frameon=False)
        else:
            bottom.text(0.5, 0.5, "no next token compared", ha="center", va="center",
                        transform=bottom.transAxes)
        bottom.set_title(self.summary(), fontsize=8)
        if path is not None:
            figure.savefig(path, dpi=110)
        return figure


def token_figures(result: Comparison) -> TokenFigures:
    """The figures per token of ``result`` (a comparison that ran the ``"tokens"`` probe:
    ``compare_rollout``, or ``explain=["tokens"]``)."""
    found = result.meta.notes.get("tokens")
    if found is None:
        raise DivtraceValueError(
            "this comparison has no figures per token: run it with explain=['tokens'] "
            "(compare_rollout runs it by default)")
    empty = ("prompt", "position", "token", "logprob_a", "logprob_b", "argmax_a", "argmax_b")
    rows: dict[str, list[Any]] = found.get("logprobs") or {name: [] for name in empty}
    logprobs = pd.DataFrame({key: rows[key] for key in (
        "prompt", "position", "token", "logprob_a", "logprob_b", "argmax_a", "argmax_b")})
    logprobs.insert(5, "delta", (logprobs["logprob_a"] - logprobs["logprob_b"]).abs())
    logprobs["flip"] = logprobs["argmax_a"] != logprobs["argmax_b"]
    layers = pd.DataFrame(
        [(site, p, t, r) for site, figures in found["layers"].items()
         for p, t, r in zip(figures["prompt"], figures["position"], figures["rel_l2"],
                            strict=True)], columns=["site", "prompt", "position", "rel_l2"])
    return TokenFigures(logprobs[list(LOGPROB_COLUMNS)], layers, float(found["tolerance"]),
                        result.meta.names)
