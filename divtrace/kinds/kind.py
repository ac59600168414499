"""The seam of a kind of comparison: :class:`Kind`.

A kind says how a comparison's two runs are carried out and read: the plan as it carries
it out, the row store that keeps run a's compared rows, the meter that measures run b
against them, the sink run b hands its tensors to, the compared samples run by themselves
(the float64 truth run), the part of a pass's output that holds results, the input of
the independence test's passes, a context around each pass of either run, and what the
kind cannot do, with the reason. Its defaults are those of the batched
run against the split run; a kind overrides what it does differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from divtrace.errors import DivtraceValueError
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.plan.inputs import BatchedInput
from divtrace.plan.make import Plan
from divtrace.plan.prompts import RaggedInput
from divtrace.plan.runs import Run
from divtrace.record.recorder import Sink
from divtrace.record.rows import RowStore

__all__ = ["CANNOT", "Kind", "Paired"]

#: What a kind may say it cannot do (:attr:`Kind.cannot`): replay chunked passes from a
#: CUDA graph, the precision test, remedies, every pass padded to one batch size (the
#: fixed-batch remedy).
CANNOT = ("graphs", "precision", "remedies", "padded")


class Kind:
    """One kind of comparison (the default: the batched run against the split run).

    Give a kind of one's own to ``compare(kind=...)``; override only what it does
    differently. ``name`` names it in ``meta.kind``; ``cannot`` maps what it cannot do
    (one of :data:`CANNOT`) to the reason, which the comparison says where that is left
    out.

    Example (the model under bfloat16 autocast against float32, both on the whole
    batch)::

        class Autocast(divtrace.Kind):
            name = "autocast"
            cannot = {"precision": "run b computes in bfloat16 by design"}

            def runs(self, a, b):
                return divtrace.Run(name="float32"), divtrace.Run(name="autocast")

            def around(self, which):
                return torch.autocast("cpu", torch.bfloat16) if which == "b" else (
                    contextlib.nullcontext())
    """

    name: ClassVar[str] = "batched"
    cannot: ClassVar[Mapping[str, str]] = {}

    @staticmethod
    def claims(plan: Plan) -> bool:
        """Whether a plan made without ``kind=`` is of this kind (the registry asks the
        built-in kinds in turn; this one, the default, takes any plan)."""
        return True

    def runs(self, a: Run | None, b: Run | None) -> tuple[Run | None, Run | None]:
        """Runs a and b of this kind, from those given (default: as given; None: the
        split run and the batched run)."""
        return a, b

    def prepared(self, plan: Plan) -> Plan:
        """``plan`` as this kind carries it out (default: as made): e.g. its input run by
        a driver, or other chunks of run a. Called before :meth:`check`."""
        return plan

    def check(self, plan: Plan) -> None:
        """Refuses a plan this kind cannot carry out (a :class:`DivtraceValueError` that
        names the fix); called before anything runs. This one reads a plain batch:
        prompts of different lengths need their own row stores."""
        if isinstance(plan.batch, RaggedInput):
            raise DivtraceValueError(
                f"the kind {self.name!r} reads a plain batch, and x is Prompts of different "
                f"lengths: derive the kind from divtrace.kinds.prompts.Ragged (its row "
                f"stores and meters compare each prompt's real tokens), or pass a padded "
                f"tensor")

    def store(self, plan: Plan, samples: list[int], *, offload: bool = False,
              pinned: bool = False, learn_lineage: bool = True) -> RowStore:
        """The row store that keeps ``samples``' rows of passes over ``plan.batch``."""
        return RowStore(samples, plan.batch.batch_dim, offload, learn_lineage=learn_lineage,
                        pinned=pinned)

    def meter(self, plan: Plan, store: RowStore, host: Host, **options: Any) -> Meter:
        """The meter that measures a pass over the whole batch against ``store``
        (``options``: the :class:`~divtrace.measure.meter.Meter`'s own)."""
        return Meter(store, plan.batch.batch_size, host, plan.rtol, plan.atol, **options)

    def sink(self, plan: Plan, meter: Meter, store: RowStore) -> Sink:
        """What run b's pass over the whole batch hands its tensors to (``meter``, or an
        adapter before it)."""
        return meter

    def alone(self, plan: Plan) -> tuple[BatchedInput, RowStore, list[tuple[int, int]]]:
        """The compared samples by themselves: their input, a row store of all its rows
        and the passes that run them (one)."""
        picked = plan.batch.select(list(plan.samples))
        count = len(plan.samples)
        return picked, RowStore(list(range(count)), picked.batch_dim, False,
                                learn_lineage=False), [(0, count)]

    def real(self, plan: Plan, chunk: tuple[int, int]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
        """What of a pass's output over ``chunk`` holds results (all of it)."""
        return lambda tensor: tensor

    def held(self, plan: Plan, group: list[int]) -> tuple[BatchedInput, list[int]]:
        """The input of an independence test's pass: ``plan.batch`` with the rows of
        ``group`` held where they are and every other sample given other valid data of
        the same shapes; and the rows that could not be made to differ."""
        return plan.batch.replaced(group)

    def held_each(self, plan: Plan, groups: list[list[int]]
                  ) -> Iterator[tuple[BatchedInput, list[int]]]:
        """:meth:`held` for each of the independence test's groups in turn, made as the
        test asks for it: the batch's own :meth:`~BatchedInput.replacements` (one wait for
        the device for every group) where :meth:`held` is this class's, else :meth:`held`
        group by group."""
        if type(self).held is not Kind.held:  # a kind's own layout
            return (self.held(plan, group) for group in groups)
        return plan.batch.replacements(groups)

    def around(self, which: str) -> AbstractContextManager[Any]:
        """A context around each pass of run ``which`` (``"a"`` or ``"b"``)."""
        return nullcontext()

    def wrap(self, sink: Sink) -> Sink:
        """What every pass of either run — the probes' too — hands its tensors to, before
        ``sink`` (``sink`` itself, or an adapter before it)."""
        return sink


@dataclass(frozen=True)
class Paired(Kind):
    """A kind that pairs the runs its own way and reads the input's rows as ``rows``
    does (prompts of different lengths, or a plain batch): its row stores, meters and
    checks are those of ``rows``."""

    rows: Kind = field(default_factory=Kind)

    def prepared(self, plan: Plan) -> Plan:
        return self.rows.prepared(plan)

    def check(self, plan: Plan) -> None:
        self.rows.check(plan)

    def store(self, plan: Plan, samples: list[int], *, offload: bool = False,
              pinned: bool = False, learn_lineage: bool = True) -> RowStore:
        return self.rows.store(plan, samples, offload=offload, pinned=pinned,
                               learn_lineage=learn_lineage)

    def meter(self, plan: Plan, store: RowStore, host: Host, **options: Any) -> Meter:
        return self.rows.meter(plan, store, host, **options)

    def alone(self, plan: Plan) -> tuple[BatchedInput, RowStore, list[tuple[int, int]]]:
        return self.rows.alone(plan)

    def real(self, plan: Plan, chunk: tuple[int, int]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.rows.real(plan, chunk)

    def held(self, plan: Plan, group: list[int]) -> tuple[BatchedInput, list[int]]:
        return self.rows.held(plan, group)

    def held_each(self, plan: Plan, groups: list[list[int]]
                  ) -> Iterator[tuple[BatchedInput, list[int]]]:
        if type(self).held is not Paired.held:  # a kind's own layout
            return (self.held(plan, group) for group in groups)
        return self.rows.held_each(plan, groups)
