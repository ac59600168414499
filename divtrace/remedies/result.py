"""``Remedies``: which settings make the runs bit-identical, at what cost, and the best."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
from torch import nn

from divtrace.errors import DivtraceValueError
from divtrace.remedies.remedy import Remedy
from divtrace.report import html, saved
from divtrace.report.comparison import Comparison
from divtrace.report.result import Result, rows_of
from divtrace.words import sci, the, whose

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["COLUMNS", "Remedies", "Saved"]

#: The table's columns, in order.
COLUMNS = ("remedy", "kind", "modules", "identical", "identical_sites", "sites",
           "output_rel_l2", "output_ratio", "verdict", "cost", "a_cost", "output_change",
           "note")


class Saved(Remedy):
    """A remedy read back from a file: named, but not applicable (build it again)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return str(self.spec.get("name", "remedy"))

    @property
    def kind(self) -> str:  # type: ignore[override]
        return str(self.spec.get("kind", "remedy"))

    def applied(self, model: nn.Module) -> AbstractContextManager[None]:  # type: ignore[override]
        raise DivtraceValueError(
            f"the remedy {self.name!r} was read from a file and holds no code; build it "
            f"again (divtrace.remedies.{_CLASSES.get(self.kind, 'Remedy')}(...)) or run "
            f"result.remedies() again")

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        raise DivtraceValueError("a remedy read from a file cannot be applied")


_CLASSES = {"cudnn": "CudnnOff", "float64": "Float64", "fixed-batch": "FixedBatch",
            "precision": "PrecisionOff", "math-attention": "MathAttention",
            "deterministic": "Deterministic", "float32-head": "Float32Head",
            "inductor": "InductorSettings", "dynamic": "DynamicShapes",
            "eager-region": "EagerRegions",
            "custom": "Custom"}


#: The remedies' table: names and notes read as text.
_CSS = (".remedies td{white-space:nowrap}"
        ".remedies td.col7{white-space:normal;text-align:left;min-width:28em;"
        "font-family:system-ui,sans-serif}")


def _yes(value: Any) -> bool:
    """Whether a cell of ``identical`` says True (<NA>: not tried)."""
    return not pd.isna(value) and bool(value)


def _no(value: Any) -> bool:
    return not pd.isna(value) and not bool(value)


def _apart(row: pd.Series) -> str:
    """Where a remedy leaves the output bit-identical but not every site: how many sites
    are still apart ("" otherwise)."""
    if row["output_rel_l2"] != 0 or pd.isna(row["sites"]) or pd.isna(row["identical_sites"]):
        return ""
    return (f", with {int(row['sites'] - row['identical_sites'])} of its {int(row['sites'])} "
            f"compared sites still apart")


def _times(value: float) -> str:
    return "not measured" if value != value else f"{value:.3g}×"


@dataclass(frozen=True)
class Remedies(Result):
    """The remedies tried on a comparison, each verified by running it again under the
    remedy, and costed.

    Attributes:
        table: One row per candidate, in the order tried: ``remedy`` (its name and
            scope), ``kind``, ``modules`` (how many it acts in; <NA>: everywhere),
            ``identical`` (every compared site bit-identical; <NA>: not tried),
            ``identical_sites`` of ``sites``, ``output_rel_l2`` and ``output_ratio`` (over
            the unremedied run's), ``verdict``, ``cost`` (run b's passes under the
            remedy over the same passes without it; for the default pair, the batched
            pass), ``a_cost`` (likewise run a's passes), ``output_change`` (the rel_l2
            of run b's first output under the remedy against the same output without it:
            how far the remedy moves the results), ``note`` (what it trades away, or why
            it was not tried).
        candidates: The remedy objects, in the table's order.
        comparisons: The comparison run under each tried remedy, by its name.
        before: The output's rel_l2 without a remedy.
        names: How the runs are called (``meta.names`` of the comparison).
        reason: Why nothing was tried, when the runs differ for reasons that are not
            numerical (None otherwise).
        needed: False when the runs were already bit-identical.
        verdict: The comparison's verdict without a remedy.
    """

    table: pd.DataFrame
    candidates: tuple[Remedy, ...]
    comparisons: dict[str, Comparison] = field(default_factory=dict)
    before: float = math.nan
    names: tuple[str, str] = ("split run", "batched run")
    reason: str | None = None
    needed: bool = True
    verdict: str = "rounding"
    document: ClassVar[str] = "remedies"
    title: ClassVar[str] = "divtrace remedies"

    @classmethod
    def untried(cls, base: Comparison, reason: str | None) -> Remedies:
        """No remedy tried: the runs are identical already (``reason`` None) or differ
        for ``reason``."""
        out = base.output
        return cls(pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS}), (), {},
                   math.nan if out is None else float(out["rel_l2"]), base.meta.names,
                   reason, needed=reason is not None, verdict=base.verdict)

    def _ranked(self) -> Iterator[tuple[float, int]]:
        """The identical candidates' (price, position): price is the slower of the two
        runs' costs, since a remedy is paid in every call."""
        for position, row in enumerate(self.table.itertuples()):
            if _yes(row.identical):
                price = max(row.cost, row.a_cost)
                yield (math.inf if price != price else price), position

    @property
    def best(self) -> Remedy | None:
        """The cheapest candidate that makes the runs bit-identical (by the slower of
        ``cost`` and ``a_cost``), or None."""
        ranked = sorted(self._ranked())
        return self.candidates[ranked[0][1]] if ranked else None

    def _costs(self, row: pd.Series) -> str:
        """``batched 1.02×, split 1.3×``: both costs, each named by its run."""
        a, b = (n.removesuffix(" run") for n in self.names)
        return f"{b} {_times(row['cost'])}, {a} {_times(row['a_cost'])}"

    def summary(self) -> str:
        """What to do: the best remedy and its cost, or why there is none."""
        a, b = self.names
        if not self.needed:
            return (f"No remedy is needed: {the(a)} and {the(b)} are already bit-identical "
                    f"at every compared site.")
        if self.reason is not None:
            return (f"No remedy is tried: the runs differ for a reason that is not "
                    f"numerical, so no setting of kernels, precision or batch shape is the "
                    f"fix — {self.reason}")
        return "\n".join(self._lines(a, b))

    def _lines(self, a: str, b: str) -> list[str]:
        table, lines = self.table, []
        best = self.best
        if best is not None:
            row = table.iloc[self.candidates.index(best)]
            lines.append(
                f"Best: {row['remedy']} — the runs become bit-identical at all "
                f"{row['sites']} compared sites; {whose(b, 'passes')} take "
                f"{_times(row['cost'])} as long, {whose(a, 'passes')} "
                f"{_times(row['a_cost'])}; it moves {whose(b, 'output')} by "
                f"rel_l2 {sci(row['output_change'])}.")
        else:
            tried = table[table["identical"].notna()]
            closest = tried.loc[tried["output_rel_l2"].fillna(math.inf).idxmin()] if (
                not tried.empty) else None
            lines.append("No candidate makes the runs bit-identical." + ("" if closest is None
                         else f" The closest, {closest['remedy']}, leaves the output's "
                              f"rel_l2 at {sci(closest['output_rel_l2'])}{_apart(closest)} "
                              f"(without a remedy: {sci(self.before)}).") + " "
                         + self._without())
        others = [r for _, r in table.iterrows() if _yes(r["identical"])
                  and (best is None or r["remedy"] != best.name)]
        if others:
            lines.append("Also bit-identical: " + "; ".join(
                f"{r['remedy']} ({self._costs(r)})"
                for r in others) + ".")
        apart = [r for _, r in table.iterrows() if _no(r["identical"])]
        if apart:
            lines.append("Not bit-identical: " + "; ".join(
                f"{r['remedy']} (output rel_l2 {sci(r['output_rel_l2'])}{_apart(r)})"
                for r in apart)
                + ".")
        skipped = table[table["identical"].isna()]
        if not skipped.empty:
            lines.append("Not tried: " + "; ".join(
                f"{r['remedy']} ({r['note'].removeprefix('not tried: ')})"
                for _, r in skipped.iterrows()) + ".")
        return lines

    def _without(self) -> str:
        """What the verdict without a remedy means when none works."""
        if self.verdict == "rounding":
            return ("Without a remedy the verdict is rounding: the runs differ by floating "
                    "point, not by a bug; compare them within a tolerance "
                    "(divtrace.testing.assert_batch_invariant), or try a remedy of your own "
                    "(candidates=[...]).")
        return (f"Without a remedy the verdict is {self.verdict}: the comparison's summary "
                f"says why.")

    def __repr__(self) -> str:
        best = self.best
        tail = "none needed" if not self.needed else (
            f"best: {best.name}" if best is not None else "no remedy")
        return f"<divtrace.Remedies: {len(self.table)} candidates, {tail}>"

    def _shade(self) -> str:
        return "identical" if not self.needed else (
            "rounding" if self.best is not None else "not rounding")

    @property
    def sites(self) -> pd.DataFrame:
        """The compact view: each candidate, whether it makes the runs bit-identical (and
        at how many of the compared sites), the output's rel_l2, both costs, how far it
        moves the output, and its note."""
        table = self.table
        frame = table[["remedy", "identical", "output_rel_l2", "cost", "a_cost",
                       "output_change", "note"]].astype(object)
        frame = frame.where(frame.notna(), None)
        frame.insert(2, "sites", [None if pd.isna(n) else f"{s} of {n}" for s, n in
                                  zip(table["identical_sites"], table["sites"], strict=True)])
        for column in ("cost", "a_cost"):
            frame[column] = [None if v is None else _times(v) for v in frame[column]]
        return frame

    def rows(self) -> pd.DataFrame:
        """A row per candidate: the output's figures under it (status ``skipped`` where it
        was not tried)."""
        table = self.table
        outputs = [None if name not in self.comparisons else self.comparisons[name].output
                   for name in table["remedy"]]
        mismatch = [math.nan if out is None else out["mismatch"] for out in outputs]
        return rows_of(table.assign(mismatch=mismatch), "{remedy}",
                       module_type=table["kind"].to_numpy(),
                       status=["skipped" if pd.isna(v) else "ok" for v in table["identical"]],
                       rel_l2="output_rel_l2")

    def _shown(self, title: str = "") -> str:
        head = f"<h4>{html.escape(title)}</h4>" if title else ""
        words = html.said(self.summary(), self._shade())
        if self.table.empty:
            return f'<style>{html.CSS}</style><div class="divtrace">{head}{words}</div>'
        best = self.best
        kinds = ["first" if best is not None and name == best.name else
                 "skipped" if pd.isna(same) else "identical" if same else "diverged"
                 for name, same in zip(self.table["remedy"], self.table["identical"],
                                       strict=True)]
        return (f'<style>{html.CSS}{_CSS}</style><div class="divtrace remedies">{head}{words}'
                f"{html.styled(self.sites, kinds)}</div>")

    def plot(self, ax: Axes | None = None) -> Axes:
        """Cost against output error, one point per tried remedy (see
        :func:`divtrace.remedies.plot.plot_remedies`)."""
        from divtrace.remedies.plot import plot_remedies

        return plot_remedies(self, ax=ax)

    def _parts(self) -> list[str]:
        return [] if self.table.empty else [html.drawn(self.plot, (8, 5))]

    def _fields(self) -> dict[str, Any]:
        """The remedies (read back, they hold no code), their table and the comparison
        under each."""
        return {
            "table": saved.frame_to_json(self.table),
            "candidates": [remedy.to_dict() for remedy in self.candidates],
            "comparisons": [[name, saved.comparison_fields(c)]
                            for name, c in self.comparisons.items()],
            "before": saved.plain(self.before), "names": list(self.names),
            "reason": self.reason, "needed": self.needed, "verdict": self.verdict}

    @classmethod
    def _restored(cls, doc: dict[str, Any],
                  comparison: Callable[[dict[str, Any]], Comparison]) -> Remedies:
        return cls(saved.frame_from_json(doc["table"]),
                   tuple(Saved(spec) for spec in doc["candidates"]),
                   {name: comparison(value) for name, value in doc["comparisons"]},
                   saved.number(doc["before"]), tuple(doc["names"]), doc["reason"],
                   doc["needed"], doc["verdict"])
