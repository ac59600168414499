"""A model sharded over ranks (tensor parallel, DTensor) compared with itself, batched
against split: every pass hands on every rank's part of each tensor, so that each rank
measures all of them and every rank gives the same figures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from divtrace.kinds.kind import Kind
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.plan.inputs import BatchedInput
from divtrace.plan.make import Plan
from divtrace.record.recorder import Sink
from divtrace.record.rows import RowStore
from divtrace.record.sharded import Stacked, sharded

__all__ = ["OnRanks"]


@dataclass(frozen=True)
class OnRanks(Kind):
    """The sharded model's batched run against its split run, every rank's parts
    measured; ``rows``: the kind whose row stores and meters read the input."""

    rows: Kind = field(default_factory=Kind)
    name: ClassVar[str] = "on ranks"

    @staticmethod
    def claims(plan: Plan) -> bool:
        return (plan.b.other_model is None and plan.walk is not None
                and sharded(plan.walk.model))

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

    def wrap(self, sink: Sink) -> Sink:
        return Stacked(self.rows.wrap(sink))
