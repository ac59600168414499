"""What a probe's hooks see of the comparison in progress: the :class:`Context`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from divtrace.kinds.kind import Kind
from divtrace.measure.host import Deferred, Host
from divtrace.measure.meter import Meter
from divtrace.measure.printcheck import PrintCheck
from divtrace.progress import Progress
from divtrace.record.loop import InputCopies
from divtrace.record.recorder import Sink
from divtrace.record.rows import RowStore
from divtrace.record.runner import RecorderFactory, Runner, module_hooks

if TYPE_CHECKING:
    from divtrace.explain.probe import Probe
    from divtrace.plan.inputs import BatchedInput
    from divtrace.plan.make import Plan

__all__ = ["Context"]


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

    def pick(self, tensor: torch.Tensor) -> torch.Tensor:
        """The compared samples' rows of ``tensor``, a tensor of run b over the whole
        batch (from the start hook on)."""
        return self.store.pick(tensor)

    def later(self, tensor: torch.Tensor) -> Deferred:
        """``tensor`` fetched with the comparison's one transfer to the host: its value is
        ``.get()`` from :meth:`Probe.fill` on (no wait for the device before that)."""
        return self.host.add(tensor)

    def rerun(self, sink: Sink, batch: BatchedInput | None = None, label: str = "") -> None:
        """One more pass of run b over the whole batch — the plan's, or ``batch``, another
        of the same shapes — told to ``sink``; one step of the progress bar."""
        batch = self.plan.batch if batch is None else batch
        said = label or f"{self.b.name}, once more"
        self.b.execute(sink, batch, [(0, batch.batch_size)], lambda _s, _e: said,
                       check=self.check, copies=self.copies)
        self.progress.advance()

    def measure(self, store: RowStore, batch: BatchedInput | None = None,
                host: Host | None = None, label: str = "",
                reads: frozenset[str] | None = None) -> Meter:
        """One more pass of run b (:meth:`rerun`), each site measured against ``store``'s
        rows; the figures go to ``host`` (default: the comparison's one transfer).
        ``reads``: the only fields computed (the others NaN; None: every field)."""
        meter = self.meter.over(store, host, reads)
        self.rerun(meter, batch, label)
        return meter

    def rows(self, batch: BatchedInput | None = None, label: str = "") -> dict[str, torch.Tensor]:
        """One more pass of run b (:meth:`rerun`; ``batch``: e.g. ``plan.batch.replaced
        (samples)[0]``, the other rows given other values): the compared samples' rows at
        every site it reached (by site key; batch dimension first, as :meth:`pick` gives
        them; prompts of different lengths: only sites whose rows share a shape)."""
        store = self.kind.store(self.plan, list(self.plan.samples), learn_lineage=False)
        self.rerun(store, batch, label)
        return {key: stored.rows for key, stored in store.rows.items()
                if stored.rows is not None}

    def held(self, group: list[int]) -> tuple[BatchedInput, list[int]]:
        """The batch with the rows of ``group`` held and every other sample given other
        valid data, as the kind lays it out (:meth:`Kind.held`), and the rows that could
        not be made to differ."""
        return self.kind.held(self.plan, group)

    def held_each(self, groups: list[list[int]]) -> Iterator[tuple[BatchedInput, list[int]]]:
        """:meth:`held` for each group in turn, made as asked for (:meth:`Kind.held_each`:
        one wait for the device for all of them)."""
        return self.kind.held_each(self.plan, groups)

    def moved(self, group: list[int], batch: BatchedInput, host: Host,
              label: str = "") -> dict[str, Deferred]:
        """One more pass of run b over ``batch`` (:meth:`rerun`), each site's rows of the
        samples ``group`` checked bit for bit against the measured pass's, by their
        fingerprints: per site key, whether they moved (a boolean tensor, after ``host``
        fetched; any element True: moved)."""
        meter = self.meter
        check = PrintCheck(meter, list(group), host, getattr(meter, "layout", None))
        self.rerun(check, batch, label)
        return check.moved

    def kept(self, samples: list[int], label: str = "") -> RowStore:
        """One more pass of run b over the unchanged batch (:meth:`rerun`), the rows of
        ``samples`` kept, in pinned memory where they go to the host."""
        store = self.kind.store(self.plan, samples, pinned=True, learn_lineage=False)
        self.rerun(store, label=label)
        return store

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
