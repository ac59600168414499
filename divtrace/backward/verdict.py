"""The verdict on one backward over the batch against gradient accumulation.

* **not rounding** when the weights test fails (the chunks' weighted losses are not the
  batched loss: see :mod:`divtrace.backward.weights`), or when the forward comparison's
  verdict is not rounding (batch mixing, error beyond the rounding budget);
* **identical** when the loss, every compared output gradient, every parameter's gradient
  and every forward site are bit-identical;
* **rounding** otherwise: the same objective in both runs (the weights test), each sample
  computed alone in the forward pass (the independence test), so what is left is the
  order of operations: kernels picked for other shapes, and the chunks' gradients summed
  one after the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from divtrace.report.verdict import Verdict
from divtrace.report.verdict import judge as judged
from divtrace.words import sci

if TYPE_CHECKING:
    from divtrace.backward.weights import Weights
    from divtrace.report.comparison import Comparison

__all__ = ["HINT", "judge"]

#: What to do when each chunk's gradient is the batched one scaled.
HINT = ("Weight each chunk by its share of what the loss averages over: for a mean over "
        "tokens, weight=lambda part: its tokens / the batch's tokens (what Hugging Face "
        "passes as num_items_in_batch); for a summed loss, weight=lambda part: 1. A "
        "token-mean loss accumulated with row weights is the known gradient-accumulation "
        "bug.")


def _weights_failed(weights: Weights) -> Verdict:
    worst = weights.worst
    rows = f"rows {int(worst['start'])}:{int(worst['stop'])}"
    scaled = worst["residual"] <= weights.limit
    said = (f"Verdict: not rounding — the chunks' weighted losses are not the batched "
            f"loss. With the split run's very outputs of '{weights.site}' put into "
            f"the batched run, the gradient that the weighted loss of {rows} (weight "
            f"{worst['weight']:.4g}) sends into them is {worst['ratio']:.6g}× the batched "
            f"loss's")
    if scaled:
        said += (f", where a few roundings allow 1 ± {sci(weights.limit)} "
                 f"({(~weights.table['passed']).sum()} of {len(weights.table)} chunks "
                 f"are off). The runs optimise different objectives: a bug in the loss or "
                 f"its weights, not in a layer. {HINT}")
    else:
        said += (f", and {sci(worst['residual'])} of it is no scaling at all (a few "
                 f"roundings allow {sci(weights.limit)}): a chunk's loss is not a share of "
                 f"the batched loss. The loss mixes the samples of its batch (a statistic "
                 f"over the batch, samples paired with each other), so accumulation cannot "
                 f"reproduce it.")
    return Verdict("not rounding", said)


def _grads_line(table: pd.DataFrame) -> str:
    params = table[(table["kind"] == "param") & (table["status"] == "ok")]
    if params.empty:
        return "No parameter's gradient could be compared."
    moved = params[params["mismatch"] > 0]
    if moved.empty:
        return f"All {len(params)} parameters' gradients are bit-identical."
    worst = moved.loc[moved["rel_l2"].fillna(0).idxmax()]
    return (f"{len(moved)} of {len(params)} parameters' gradients differ, by up to rel_l2 "
            f"{sci(worst['rel_l2'])} ({worst['site']}).")


def judge(table: pd.DataFrame, weights: Weights, forward: Comparison | None,
          forward_why: str | None) -> Verdict:
    """The verdict (see the module's text)."""
    if weights.passed is False:
        return _weights_failed(weights)
    seen = (judged(forward.table, forward.meta, forward.probes) if forward is not None
            else None)
    if seen is not None and seen.kind == "not rounding":
        return Verdict("not rounding", "Verdict: not rounding — in the forward pass: "
                       + seen.sentence.removeprefix("Verdict: not rounding — "))
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return Verdict("not rounding", "Verdict: not rounding — no gradient could be "
                                       "compared, so floating point cannot be shown to "
                                       "explain it.")
    if (ok["mismatch"] == 0).all() and (seen is None or seen.kind == "identical"):
        end = " and so is every forward site." if seen is not None else "."
        return Verdict("identical", "Verdict: identical — the loss, every compared output "
                                    "gradient and every parameter's gradient are "
                                    f"bit-identical in both runs{end}")
    if weights.passed:
        off = float((weights.table["ratio"] - 1).abs().max())
        ratio = ("exactly the batched one's" if off == 0 else
                 f"the batched one's times a ratio at most {sci(off)} from 1, within the "
                 f"{sci(weights.limit)} a few roundings allow")
        tested = (f"both runs optimise the same objective (weights test: with the split "
                  f"run's very outputs of '{weights.site}' put into the batched run, each "
                  f"chunk's gradient into them is {ratio})")
    else:
        tested = (f"the weights could not be tested ({weights.why}), so the loss's "
                  f"weighting is not shown to be right")
    if seen is None:
        fore = f"the forward pass was not compared ({forward_why})"
    else:
        fore = "in the forward pass, " + seen.sentence.removeprefix(
            f"Verdict: {seen.kind} — ").rstrip(".")
    return Verdict("rounding", f"Verdict: rounding — {tested}; {fore}. {_grads_line(table)}"
                               f" What is left is the order of operations: kernels picked "
                               f"for other shapes, and the chunks' gradients summed one "
                               f"after another.")
