"""A model sharded over ranks (tensor parallel, DTensor) against another model, usually
itself unsharded: each of run b's tensors reassembled into the unsharded model's whole
tensor before it is measured."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import ClassVar

from divtrace.kinds.models import TwoModels
from divtrace.measure.meter import Meter
from divtrace.plan.make import Plan
from divtrace.record.recorder import Sink
from divtrace.record.rows import RowStore
from divtrace.record.sharded import Reassembled, sharded

__all__ = ["Sharded"]


def _shape(store: RowStore, key: str) -> tuple[int, ...] | None:
    """The shape run a gave at site ``key`` (None: it has none)."""
    stored = store.rows.get(store.aliases.get(key, key))
    return None if stored is None else tuple(stored.shape)


class Sharded(TwoModels):
    """Run b on a model sharded over ranks, its tensors reassembled whole."""

    name: ClassVar[str] = "sharded"
    cannot: ClassVar[Mapping[str, str]] = {
        **TwoModels.cannot,
        "precision": "run b's model is sharded over ranks (its float64 copy is not made)"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        other = plan.b.other_model
        return other is not None and sharded(other)

    def sink(self, plan: Plan, meter: Meter, store: RowStore) -> Sink:
        return Reassembled(meter, partial(_shape, store))
