"""Every pass padded to one batch size by the model's own hooks (the fixed-batch remedy,
:class:`divtrace.remedies.FixedBatch`, tried again): the padding is cut off before a
tensor is recorded."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from divtrace.kinds.kind import Kind
from divtrace.plan.make import Plan
from divtrace.record.padded import PaddedStore
from divtrace.record.rows import RowStore

__all__ = ["Padded"]


@dataclass(frozen=True)
class Padded(Kind):
    """The batched run against the split run, every pass padded to ``size`` rows."""

    size: int
    name: ClassVar[str] = "padded"
    cannot: ClassVar[Mapping[str, str]] = {
        "graphs": "every pass is padded by the model's own hooks"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        return False  # only ever given: a remedy's replay

    def store(self, plan: Plan, samples: list[int], *, offload: bool = False,
              pinned: bool = False, learn_lineage: bool = True) -> RowStore:
        return PaddedStore(samples, plan.batch.batch_dim, offload, learn_lineage=learn_lineage,
                           pinned=pinned, size=self.size)
