"""A model sharded over ranks (tensor parallel, DTensor) compared with itself, batched
against split: every pass hands on every rank's part of each tensor, so that each rank
measures all of them and every rank gives the same figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from divtrace.kinds.kind import Paired
from divtrace.plan.make import Plan
from divtrace.record.recorder import Sink
from divtrace.record.sharded import Stacked, sharded

__all__ = ["OnRanks"]


@dataclass(frozen=True)
class OnRanks(Paired):
    """The sharded model's batched run against its split run, every rank's parts
    measured; ``rows``: the kind whose row stores and meters read the input."""

    name: ClassVar[str] = "on ranks"

    @staticmethod
    def claims(plan: Plan) -> bool:
        return (plan.b.other_model is None and plan.walk is not None
                and sharded(plan.walk.model))

    def wrap(self, sink: Sink) -> Sink:
        return Stacked(self.rows.wrap(sink))
