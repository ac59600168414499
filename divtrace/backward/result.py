"""The result of ``compare_backward()``: the loss, the output gradients and the
parameters' gradients of one backward over the batch against gradient accumulation, the
weights test, the forward comparison, and the verdict on all of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd

from divtrace.backward.verdict import judge
from divtrace.backward.weights import Weights
from divtrace.report.result import Result, rows_of
from divtrace.report.verdict import Verdict
from divtrace.words import readable, sci

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.report.comparison import Comparison

__all__ = ["Backward"]

_SHOWN = ("site", "kind", "type", "dtype", "status", "mismatch", "rel_l2", "max_abs", "max_ulp")


@dataclass(frozen=True)
class Backward(Result):
    """One backward over the batch (the batched run) against gradient accumulation over
    chunks (the split run).

    Attributes:
        table: One row per compared thing, with ``kind``: ``loss`` (the batched loss
            against the chunks' weighted losses summed), ``grad`` (a module output's
            gradient, the compared samples' rows, in the order the batched backward
            reached them) and ``param`` (a parameter's gradient, whole); the figures of
            :data:`divtrace.COLUMNS` (``mismatch``, ``rel_l2``, ``max_abs``, ``max_ulp``,
            ...), batched against split.
        steps: One row per pass: ``run``, ``start``, ``stop``, ``loss``, ``weight``.
        weights: The weights test (:class:`~divtrace.backward.weights.Weights`).
        forward: The forward sites, as :func:`divtrace.compare` finds them on the loss's
            forward pass (None when not compared: ``forward_why`` says why).
        settings: ``batch_size``, ``chunk``, ``samples``, ``weight`` (how the chunks
            were weighted), ``batch_dim``.
    """

    table: pd.DataFrame
    steps: pd.DataFrame
    weights: Weights
    forward: Comparison | None
    settings: dict[str, Any]
    forward_why: str | None = None
    document: ClassVar[str] = "backward"
    title: ClassVar[str] = "divtrace backward"

    @cached_property
    def verdict(self) -> Verdict:
        """identical, rounding or not rounding, and why (see
        :mod:`divtrace.backward.verdict`)."""
        return judge(self.table, self.weights, self.forward, self.forward_why)

    def of(self, kind: str) -> pd.DataFrame:
        """The rows of one kind: ``"loss"``, ``"grad"`` or ``"param"``."""
        return self.table[self.table["kind"] == kind].reset_index(drop=True)

    @property
    def parameters(self) -> pd.DataFrame:
        """One row per named parameter: its gradient, batched against accumulated."""
        return self.of("param")

    @property
    def gradients(self) -> pd.DataFrame:
        """The output gradients, per compared sample, in backward order."""
        return self.of("grad")

    @property
    def first_divergence(self) -> pd.Series | None:
        """The first output gradient, in backward order, that differs (None: none)."""
        grads = self.of("grad")
        moved = grads[(grads["status"] == "ok") & (grads["mismatch"] > 0)]
        return None if moved.empty else moved.iloc[0]

    @property
    def sites(self) -> pd.DataFrame:
        """The table, compact and formatted as the sentences are."""
        return readable(self.table[[c for c in _SHOWN if c in self.table]])

    def summary(self) -> str:
        """The verdict first, then the loss, the gradients, the weights test and the
        forward pass, in plain sentences."""
        s = self.settings
        chunks = len(self.steps[self.steps["run"] == "split"])
        weighting = s["weight"]
        lines = [f"One backward over the batch of {s['batch_size']} against gradient "
                 f"accumulation over {chunks} chunks of {s['chunk']} (each weighted by "
                 f"{weighting}); {len(s['samples'])} sample(s) compared.",
                 self.verdict.sentence]
        loss = self.of("loss").iloc[0]
        lines.append(f"The loss: batched {self.steps.iloc[-1]['loss']:.9g}, the weighted "
                     f"losses summed {self.split_loss:.9g} (rel {sci(loss['rel_l2'])}).")
        lines.append(self._grads_sentence())
        if self.forward is not None:
            first = self.forward.first_divergence
            lines.append("The forward pass: " + (
                "every compared site is bit-identical." if first is None else
                f"the runs part first at {first['site']} (rel_l2 {sci(first['rel_l2'])}); "
                f"its own summary is Backward.forward.summary()."))
        return "\n".join(lines)

    def _grads_sentence(self) -> str:
        grads = self.of("grad")
        ok = grads[grads["status"] == "ok"]
        first = self.first_divergence
        if ok.empty:
            return "No output gradient could be compared."
        if first is None:
            return f"All {len(ok)} compared output gradients are bit-identical."
        last = ok.iloc[-1]
        return (f"{int((ok['mismatch'] > 0).sum())} of {len(ok)} output gradients differ; "
                f"the first the backward pass reached is {first['site']} (rel_l2 "
                f"{sci(first['rel_l2'])}), the last {last['site']} (rel_l2 "
                f"{sci(last['rel_l2'])}).")

    @property
    def split_loss(self) -> float:
        """The split run's weighted losses summed (float64)."""
        split = self.steps[self.steps["run"] == "split"]
        return float((split["loss"] * split["weight"]).sum())

    def plot(self, ax: Axes | None = None, kind: str = "grad") -> Axes:
        """rel_l2 of the output gradients in backward order (``kind="grad"``) or of the
        parameters' gradients in the model's order (``"param"``), log scale; bit-identical
        ones on a lane of their own."""
        from divtrace.backward.plot import plot_backward

        return plot_backward(self, kind, ax)

    def _fields(self) -> dict[str, Any]:
        from divtrace.report import saved

        w = self.weights
        return {
            "table": saved.frame_to_json(self.table),
            "steps": saved.frame_to_json(self.steps),
            "weights": {"site": w.site, "dtype": w.dtype, "limit": w.limit, "why": w.why,
                        "table": saved.frame_to_json(w.table)},
            "forward": None if self.forward is None else saved.comparison_fields(
                self.forward),
            "forward_why": self.forward_why, "settings": saved.plain(self.settings)}

    @classmethod
    def _restored(cls, doc: dict[str, Any],
                  comparison: Callable[[dict[str, Any]], Comparison]) -> Backward:
        from divtrace.report import saved

        w = doc["weights"]
        weights = Weights(w["site"], w["dtype"], saved.number(w["limit"]),
                          saved.frame_from_json(w["table"]), w["why"])
        forward = None if doc["forward"] is None else comparison(doc["forward"])
        return cls(saved.frame_from_json(doc["table"]), saved.frame_from_json(doc["steps"]),
                   weights, forward, dict(doc["settings"]), doc["forward_why"])

    def rows(self) -> pd.DataFrame:
        """A row per loss, gradient and parameter, named ``kind:site``."""
        table = self.table
        return rows_of(table, "{kind}:{site}", module_type=table["type"].to_numpy(),
                       status=table["status"].to_numpy())

    def __repr__(self) -> str:
        grads = self.of("grad")
        return (f"<divtrace.Backward: B={self.settings['batch_size']} vs chunks of "
                f"{self.settings['chunk']}, {len(grads)} gradient sites, "
                f"{len(self.of('param'))} parameters — {self.verdict.kind}>")

    def _shade(self) -> str:
        return self.verdict.kind

    def _parts(self) -> list[str]:
        """Both plots and the weights test."""
        from divtrace.report.html import drawn, section

        parts = [drawn(partial(self.plot, kind=kind), (10, 4))
                 for kind in ("grad", "param")]
        if not self.weights.table.empty:
            parts.append(section(f"The weights test (at {self.weights.site})",
                                 readable(self.weights.table)))
        return parts
