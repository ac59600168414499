"""The probe seam: one way of explaining a comparison, one class.

A probe is named in ``compare(..., explain=[...])`` — by its name, or as an instance
that holds its settings (``Repeat(3)``, a user's own probe). It checks that it can work
on the model (:meth:`Probe.check`), may run passes of its own before run a
(:meth:`Probe.before`) or after the measured run b (:meth:`Probe.after`), may watch the
measured run's sites and leaf calls (:meth:`Probe.on_site`, :meth:`Probe.on_call`),
fills its columns of the table (:meth:`Probe.fill`) and says what they mean
(:meth:`Probe.sentences`). Every method has a default that does nothing, so a probe
overrides only what it needs.

A probe instance holds its settings and, once a comparison runs, what it found there;
each comparison works on fresh copies of the probes it was given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import pandas as pd
import torch
from torch import nn

from divtrace.align.sites import CONSTANT, INPUT, ROOT, site_key
from divtrace.kinds.kind import Kind
from divtrace.measure.fields import INDEX
from divtrace.measure.host import Host
from divtrace.measure.measured import CallRecord, LeafCall, Measured
from divtrace.measure.meter import Meter
from divtrace.measure.scale import common_arrays
from divtrace.progress import Progress
from divtrace.record.lineage import Origin
from divtrace.record.loop import InputCopies
from divtrace.record.rows import RowStore
from divtrace.record.runner import RecorderFactory, Runner, module_hooks

if TYPE_CHECKING:
    from divtrace.plan.make import Plan

__all__ = ["Context", "Judged", "Probe", "Settings", "Sums", "TableView", "sums"]


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


class Judged(Protocol):
    """What a probe's sentences read of a result (a :class:`~divtrace.Comparison`): its
    table, its settings and the rows it picks out."""

    @property
    def table(self) -> pd.DataFrame: ...

    @property
    def meta(self) -> Settings: ...

    @property
    def output(self) -> pd.Series | None: ...

    @property
    def sources(self) -> pd.DataFrame: ...


@dataclass
class Context:
    """What a probe sees of the comparison in progress."""

    plan: Plan
    model: nn.Module  # the user's model, as given
    a: Runner  # run a, whose rows are stored (the split run by default)
    b: Runner  # run b, measured against them (the batched run by default)
    host: Host  # takes device tensors for the one transfer to the host
    progress: Progress
    #: called after every run with the run's name (refuses random draws)
    check: Callable[[str], object] | None = None
    #: the type of the measured run's output when it held no tensor
    output_type: str | None = None
    #: whether passes over the batch need copies of the input (learnt from the first)
    copies: InputCopies | None = None
    #: per chunked run (``a``, ``b``): how its passes ran (a CUDA graph, or eager and why)
    graphed: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: makes each run's recorder (for a probe's own runs)
    recorder: RecorderFactory = module_hooks
    #: the comparison's probes (what one found is its :meth:`Probe.note`)
    probes: tuple[Probe, ...] = ()
    #: the kind of comparison: its row stores and meters, what it cannot do
    kind: Kind = field(default_factory=Kind)
    _store: RowStore | None = None
    _meter: Meter | None = None

    def finding(self, label: str) -> Any:
        """What the probe of that label found so far (its note; None: no such probe)."""
        probe = next((p for p in self.probes if p.label == label), None)
        return None if probe is None else probe.note()

    @property
    def store(self) -> RowStore:
        """Run a's rows (from :meth:`Probe.start` on); ``store.pick(tensor)``: the compared
        samples' rows of a tensor of the measured run."""
        if self._store is None:
            raise RuntimeError("the reference run has not been recorded yet")
        return self._store

    @store.setter
    def store(self, store: RowStore) -> None:
        self._store = store

    @property
    def meter(self) -> Meter:
        """The measured run's meter (from :meth:`Probe.start` on)."""
        if self._meter is None:
            raise RuntimeError("the measured run has not been set up yet")
        return self._meter

    @meter.setter
    def meter(self, meter: Meter) -> None:
        self._meter = meter


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


class Probe:
    """One way of explaining a comparison: extra columns of the table and sentences of the
    summary. Subclasses set the class attributes and override the hooks they need.

    The built-in probes are :class:`~divtrace.Independence`, :class:`~divtrace.Local`,
    :class:`~divtrace.Fp64`, :class:`~divtrace.Repeat`, :class:`~divtrace.Kernels` and
    :class:`~divtrace.Observer` (:data:`divtrace.explain.registry.PROBES`, in column
    order); a probe of one's own is a subclass given to ``compare(explain=[...])``.
    """

    #: Its name in ``explain=`` and in ``Comparison.meta.explain`` ("" for the roles,
    #: which are always there).
    name: ClassVar[str] = ""
    #: It runs unless ``explain=`` turns it off (``"-name"``).
    default: ClassVar[bool] = False
    #: The table columns it adds, in order.
    columns: ClassVar[tuple[str, ...]] = ()
    #: Of those, the ones the HTML table shows.
    shown: ClassVar[tuple[str, ...]] = ()
    #: Its sentences come before those on the model's output.
    leads: ClassVar[bool] = False
    #: It needs the compared run to take the whole batch in one pass.
    whole_batch: ClassVar[bool] = False
    #: It needs the measured run's rows kept until :meth:`after`.
    keeps_batched: ClassVar[bool] = False
    #: It needs the fingerprints of the measured run's rows (``Measured.prints``).
    prints_batched: ClassVar[bool] = False
    #: Its columns' values in rows of sites that the measured run did not reach.
    blank: ClassVar[dict[str, Any]] = {}
    #: Forward passes of its own (for the progress bar).
    passes: int = 0

    @classmethod
    def by_default(cls) -> Probe:
        """The instance that runs when ``explain=`` does not name a default probe."""
        return cls()

    def check(self, model: nn.Module) -> bool:
        """Whether the probe has work to do on ``model`` (False: it is left out); raises
        a :class:`~divtrace.DivtraceValueError` for settings that cannot be used there.
        Called before anything runs."""
        return True

    def settings(self) -> dict[str, Any]:
        """Its settings, JSON-ready, as ``Comparison.meta.explain[name]`` records them."""
        return {}

    @property
    def label(self) -> str:
        """Its name, or its class's for a probe of one's own (the key of its settings and
        notes in the meta)."""
        return self.name or type(self).__name__

    def __repr__(self) -> str:
        given = ", ".join(f"{key}={value!r}" for key, value in self.settings().items())
        return f"{type(self).__name__}({given})"

    @property
    def watches_sites(self) -> bool:
        return type(self).on_site is not Probe.on_site

    @property
    def watches_calls(self) -> bool:
        return type(self).on_call is not Probe.on_call

    def before(self, ctx: Context) -> None:
        """Runs before the reference run."""

    def start(self, ctx: Context) -> None:
        """Runs after the reference run, before the measured run."""

    def on_site(self, ctx: Context, measured: Measured, tensor: torch.Tensor,
                rows: torch.Tensor) -> None:
        """A site of the measured run was measured (``tensor`` is the whole batch, ``rows``
        the stored rows of the compared samples)."""

    def on_call(self, ctx: Context, call: LeafCall, record: CallRecord) -> None:
        """A leaf call of the measured run returned (before its outputs are measured)."""

    def after(self, ctx: Context) -> None:
        """Runs after the measured run."""

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        """Writes the probe's columns into the table's rows (one dict per site)."""

    def note(self) -> Any:
        """What the probe found that is not a column (JSON-ready), for the comparison's
        ``meta.notes`` under the probe's name (or class name); None for nothing."""
        return None

    @classmethod
    def sentences(cls, result: Judged) -> list[str]:
        """What the probe's columns say about ``result``, in plain sentences."""
        return []

    @classmethod
    def findings(cls, table: pd.DataFrame, meta: Settings) -> Findings:
        """What the probe found that the verdict (:mod:`divtrace.report.verdict`) reads,
        from the comparison's table and settings (nothing, by default)."""
        return Findings()


@dataclass(frozen=True)
class Sums:
    """Mismatch and norms summed over several parts (e.g. the inputs of a call)."""

    mismatch: float  # fraction of elements not bit-identical
    diff: float  # ‖batched − split‖ times 2**-scale
    ref: float  # ‖split‖ times 2**-scale
    scale: int = 0  # see divtrace.measure.scale


def sums(parts: list[tuple[np.ndarray, int]]) -> Sums:
    """:class:`Sums` over ``(per-sample fields, compared elements)`` parts."""
    count = sum(float(a[:, INDEX["mismatch"]].sum()) for a, _ in parts)
    numel = sum(n for _, n in parts)
    arrays, scale = common_arrays([a for a, _ in parts])  # their sums at one scale
    diff = math.sqrt(sum(float(a[:, INDEX["sq_diff"]].sum()) for a in arrays))
    ref = math.sqrt(sum(float(a[:, INDEX["sq_ref"]].sum()) for a in arrays))
    return Sums(count / numel if numel else 0.0, diff, ref, scale)


class TableView:
    """What probes read while the table is filled: every site's fields (on the host) and
    the leaf calls' lineage."""

    def __init__(self, fields: dict[str, tuple[np.ndarray, int]], calls: dict[str, CallRecord],
                 batch: int, n_samples: int, call_keys: Mapping[str, str] | None = None
                 ) -> None:
        self.fields = fields  # site key -> (per-sample fields, compared elements)
        self.calls = calls
        self.batch, self.n_samples = batch, n_samples
        self.call_keys = call_keys or {}  # site key -> key of its call, where it differs
        self._inputs: dict[str, Sums | None] = {}

    def call(self, row: Mapping[str, Any]) -> CallRecord | None:
        """The leaf call a row belongs to (None for other rows)."""
        return self.calls.get(self.call_key(row)) if row["leaf"] else None

    def call_key(self, row: Mapping[str, Any]) -> str:
        """The key of the call a row belongs to: a module call, or an op call."""
        found = self.call_keys.get(row["site"])
        return found if found is not None else site_key(row["module"], row["call"], "")

    def inputs(self, call_key: str) -> Sums | None:
        """The call's inputs taken together (None when one of them is not known); the
        model's own input counts as identical."""
        if call_key not in self._inputs:
            self._inputs[call_key] = self._input_sums(self.calls[call_key])
        return self._inputs[call_key]

    def _input_sums(self, call: CallRecord) -> Sums | None:
        parts: list[tuple[np.ndarray, int]] = []
        for origin, key, measured in call.inputs:
            if origin == Origin.SITE and key in (INPUT, CONSTANT):
                continue  # the model's own input, or no per-sample data: the same in both
            if origin == Origin.SITE and key in self.fields:
                parts.append(self.fields[key])
            elif origin == Origin.INPUT and measured is not None and measured.stats is not None:
                count = np.broadcast_to(measured.per_sample(self.batch), self.n_samples).sum()
                parts.append((measured.stats.get(), int(count)))
            else:
                return None
        return sums(parts)
