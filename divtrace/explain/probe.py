"""The probe seam: one way of explaining a comparison, one class of eight members.

A probe is named in ``compare(..., explain=[...])`` — by its name, or as an instance
that holds its settings (``Repeat(3)``, a user's own probe). Its :class:`Spec` says what
it is (name, columns, needs); :meth:`Probe.check` whether it has work on the model;
:meth:`Probe.hooks` when it works while the comparison runs (before run a, at each site
or leaf call of run b, after run b), each hook given the :class:`Context`;
:meth:`Probe.fill` writes its columns; :meth:`Probe.note` keeps what it found besides;
:meth:`Probe.explain` says what its columns mean: sentences for the summary and the
:class:`Findings` the verdict reads. :meth:`Probe.settings` is how the meta records it.

The :class:`Context` is what a hook sees of the comparison: ``pick`` (the compared rows
of a tensor of run b), ``later`` (a value fetched with the one transfer to the host),
``rows``, ``rerun`` and ``measure`` (one more pass of run b), ``finding`` (another probe's note),
the plan and the progress bar; the built-in probes also reach the runs, the row store
and the meter there.

A probe instance holds its settings and, once a comparison runs, what it found there;
each comparison works on fresh copies of the probes it was given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import pandas as pd
import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.errors import DivtraceTypeError, DivtraceValueError

if TYPE_CHECKING:
    from divtrace.explain.context import Context
    from divtrace.explain.view import TableView
    from divtrace.measure.measured import CallRecord, LeafCall, Measured

__all__ = ["NEEDS", "Explained", "Findings", "Hooks", "Judged", "Probe", "Settings", "Spec",
           "output_rows"]


class Settings(Protocol):
    """What a probe's sentences read of a result's settings (a
    :class:`~divtrace.report.meta.Meta`, which the report builds after the probes)."""

    @property
    def batch_size(self) -> int: ...

    @property
    def samples(self) -> tuple[int, ...]: ...

    @property
    def explain(self) -> Mapping[str, Mapping[str, Any]]: ...

    @property
    def names(self) -> tuple[str, str]: ...

    @property
    def runs(self) -> tuple[str, str] | None: ...

    @property
    def a_chunk(self) -> int: ...

    @property
    def notes(self) -> Mapping[str, Any]: ...

    @property
    def settings(self) -> Mapping[str, Mapping[str, Any]]: ...


@dataclass(frozen=True)
class Findings:
    """What a probe found that the verdict reads; each field None (or empty) when it
    found nothing of that.

    Attributes:
        mixing: ``(where, why)``: the compared samples depend on the other samples — not
            rounding whatever the size (the independence test's).
        independent: How far the samples were shown independent: ``"independent"``,
            ``"inconclusive"`` or ``"untested"``.
        designed: ``(where, why)``: the runs differ by design, not by rounding (the
            difference kept its size in float64 — the precision test's).
        precise: Whether the difference was shown to shrink with the unit roundoff:
            ``"shrinks"``, ``"inconclusive"`` or ``"untested"``.
        entries: Where error enters besides the sources and the first divergent site:
            ``(row, its error, how it was seen)`` (``"own"``: a layer's own error on
            identical inputs, the local replay's).
        beyond: Once every error is within the rounding budget: why floating point still
            does not explain the output (the float64 run's).
    """

    mixing: tuple[str, str] | None = None
    independent: str | None = None
    designed: tuple[str, str] | None = None
    precise: str | None = None
    entries: tuple[tuple[pd.Series, float, str], ...] = ()
    beyond: str | None = None


def output_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the model's output tensors (every one, when it returns several)."""
    return table[(table["module"] == ROOT) & (table["call"] == 0) & (table["op"] == "")]


#: What a probe may need of the comparison (``Spec.needs``).
NEEDS: dict[str, str] = {
    "whole_batch": "run b takes the whole batch in one pass",
    "b_kept": "run b's compared rows are kept until the probe's after hook",
    "b_prints": "run b's compared rows are fingerprinted (Measured.prints)",
    "op_inputs": "with ops=, every op's inputs are sites of their own, views too (the op "
                 "recorder does not follow lineage through views)",
}


@dataclass(frozen=True)
class Spec:
    """What a probe is, read before anything runs.

    Attributes:
        name: Its name in ``explain=`` and in ``Comparison.meta.explain`` ("" for a
            probe of one's own, known by its class's name, and for the roles).
        default: It runs unless ``explain=`` turns it off (``"-name"``).
        columns: The table columns it adds, in order.
        shown: Of those, the ones the HTML table shows.
        leads: Its sentences come before those on the model's output.
        needs: What it needs of the comparison: names of :data:`NEEDS`.
        blank: Its columns' values in rows of sites that run b did not reach.
    """

    name: str = ""
    default: bool = False
    columns: tuple[str, ...] = ()
    shown: tuple[str, ...] = ()
    leads: bool = False
    needs: frozenset[str] = frozenset()
    blank: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.needs) - set(NEEDS))
        if unknown:
            raise DivtraceValueError(
                f"Spec(needs=...) takes {', '.join(map(repr, NEEDS))}; got {unknown}")
        if not set(self.shown) <= set(self.columns):
            raise DivtraceValueError(
                f"Spec(shown=...) must be among its columns {list(self.columns)}; got "
                f"{list(self.shown)}")
        object.__setattr__(self, "needs", frozenset(self.needs))


@dataclass(frozen=True)
class Hooks:
    """When a probe works while a comparison runs, in the order it runs; None: nothing
    then.

    Attributes:
        before: Before run a, ``before(ctx)``.
        start: After run a, before run b, ``start(ctx)``.
        site: A site of run b was measured: ``site(ctx, measured, tensor, rows)``
            (``tensor`` the whole batch, ``rows`` run a's stored rows of the compared
            samples).
        call: A leaf call of run b returned, before its outputs are measured:
            ``call(ctx, call, record)``.
        after: After run b, ``after(ctx)``.
        passes: Forward passes of its own (for the progress bar).
    """

    before: Callable[[Context], None] | None = None
    start: Callable[[Context], None] | None = None
    site: Callable[[Context, Measured, torch.Tensor, torch.Tensor], None] | None = None
    call: Callable[[Context, LeafCall, CallRecord], None] | None = None
    after: Callable[[Context], None] | None = None
    passes: int = 0


@dataclass(frozen=True)
class Explained:
    """What a probe's columns say about a comparison: plain sentences for the summary,
    and the :class:`Findings` the verdict reads."""

    sentences: tuple[str, ...] = ()
    findings: Findings = field(default_factory=lambda: Findings())


@dataclass(frozen=True)
class Judged:
    """A comparison as its probes explain it: its table and its settings (a
    :class:`~divtrace.report.meta.Meta`), and the rows they pick out."""

    table: pd.DataFrame
    meta: Settings

    @property
    def output(self) -> pd.Series | None:
        """The row of the model's first output tensor (None: no output row)."""
        rows = output_rows(self.table)
        return None if rows.empty else rows.iloc[0]

    @property
    def sources(self) -> pd.DataFrame:
        """The leaf sites where divergence starts: input bit-identical, output not."""
        return self.table[self.table["role"] == "source"].reset_index(drop=True)


#: The members a probe had before :class:`Spec`, :class:`Hooks` and :class:`Explained`,
#: and where each went (a subclass that sets one is refused with this).
_MOVED: dict[str, str] = {
    **{name: f"spec = Spec({name}=...)" for name in (
        "name", "default", "columns", "shown", "leads", "blank")},
    **{name: f"spec = Spec(needs={{{need!r}}})" for name, need in (
        ("whole_batch", "whole_batch"), ("keeps_batched", "b_kept"),
        ("prints_batched", "b_prints"))},
    **{name: f"hooks() returns Hooks({hook}=...)" for name, hook in (
        ("before", "before"), ("start", "start"), ("on_site", "site"), ("on_call", "call"),
        ("after", "after"), ("passes", "passes"))},
    "sentences": "explain(result) returns Explained(sentences=...)",
    "findings": "explain(result) returns Explained(findings=...)",
    "by_default": "a probe of one's own runs as the instance given to explain=",
}


class Probe:
    """One way of explaining a comparison: extra columns of the table and sentences of the
    summary. A subclass sets :attr:`spec` and overrides what it needs; every method has a
    default that does nothing.

    The built-in probes are :class:`~divtrace.Independence`, :class:`~divtrace.Precision`,
    :class:`~divtrace.Local`, :class:`~divtrace.Fp64`, :class:`~divtrace.Repeat`,
    :class:`~divtrace.Kernels` and :class:`~divtrace.Observer`
    (:data:`divtrace.explain.registry.PROBES`, in column order); a probe of one's own is a
    subclass given to ``compare(explain=[...])``.
    """

    #: What it is: its name, columns and needs.
    spec: ClassVar[Spec] = Spec()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        old = sorted(set(vars(cls)) & set(_MOVED))
        if old:
            moved = "; ".join(f"{name}: {_MOVED[name]}" for name in old)
            raise DivtraceTypeError(
                f"{cls.__name__} sets {', '.join(old)}, which a probe no longer has: "
                f"{moved}")

    def check(self, model: nn.Module) -> bool:
        """Whether the probe has work to do on ``model`` (False: it is left out); raises
        a :class:`~divtrace.DivtraceValueError` for settings that cannot be used there.
        Called before anything runs."""
        return True

    def settings(self) -> dict[str, Any]:
        """Its settings, JSON-ready, as ``Comparison.meta.explain[label]`` records them."""
        return {}

    @property
    def label(self) -> str:
        """Its name, or its class's for a probe of one's own (the key of its settings and
        notes in the meta)."""
        return self.spec.name or type(self).__name__

    def __repr__(self) -> str:
        given = ", ".join(f"{key}={value!r}" for key, value in self.settings().items())
        return f"{type(self).__name__}({given})"

    def hooks(self) -> Hooks:
        """When it works while the comparison runs (nothing, by default)."""
        return Hooks()

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        """Writes the probe's columns into the table's rows (one dict per site)."""

    def note(self) -> Any:
        """What the probe found that is not a column (JSON-ready), for the comparison's
        ``meta.notes`` under its label; None for nothing."""
        return None

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        """What the probe's columns say about ``result``: its sentences and what the
        verdict (:mod:`divtrace.report.verdict`) reads (nothing, by default)."""
        return Explained()
