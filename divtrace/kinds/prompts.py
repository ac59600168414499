"""Prompts of different lengths (:class:`~divtrace.Prompts`): each compared prompt's real
tokens, recorded alone or in chunks, against the same tokens in the padded batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from divtrace.errors import DivtraceValueError
from divtrace.kinds.kind import Kind
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.measure.ragged import RaggedMeter
from divtrace.plan.inputs import BatchedInput
from divtrace.plan.make import Plan
from divtrace.plan.prompts import RaggedInput
from divtrace.record.ragged import RaggedStore
from divtrace.record.rows import RowStore

__all__ = ["Ragged"]


def _ragged(plan: Plan) -> RaggedInput:
    batch = plan.batch
    assert isinstance(batch, RaggedInput)
    return batch


class Ragged(Kind):
    """Prompts of different lengths, padded into one batch: only real tokens compared."""

    name: ClassVar[str] = "prompts"
    cannot: ClassVar[Mapping[str, str]] = {
        "graphs": "prompts of different lengths take passes of different shapes",
        "padded": "prompts of different lengths differ in length too, not only in rows"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        return isinstance(plan.batch, RaggedInput)

    def check(self, plan: Plan) -> None:
        if plan.b.chunk is not None:
            raise DivtraceValueError(
                "with Prompts, run b must take the whole batch in one pass (its padding is "
                "the layout the prompts are measured in); give a chunk to run a only")

    def store(self, plan: Plan, samples: list[int], *, offload: bool = False,
              pinned: bool = False, learn_lineage: bool = True) -> RowStore:
        return RaggedStore(samples, 0, offload, learn_lineage=learn_lineage, pinned=pinned,
                           ragged=_ragged(plan))

    def meter(self, plan: Plan, store: RowStore, host: Host, **options: Any) -> Meter:
        size = plan.batch.batch_size
        return RaggedMeter(store, size, host, plan.rtol, plan.atol,
                           layout=_ragged(plan).layout(0, size), **options)

    def alone(self, plan: Plan) -> tuple[BatchedInput, RowStore, list[tuple[int, int]]]:
        """Each compared prompt alone, unpadded (a float64 model may turn fully masked
        padding into NaN)."""
        picked = plan.batch.select(list(plan.samples))
        assert isinstance(picked, RaggedInput)
        count = len(plan.samples)
        store = RaggedStore(list(range(count)), 0, False, learn_lineage=False, ragged=picked)
        return picked, store, [(i, i + 1) for i in range(count)]

    def real(self, plan: Plan, chunk: tuple[int, int]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The prompts' tokens of a pass's output over ``chunk``."""
        layout = _ragged(plan).layout(*chunk)
        rows = range(chunk[1] - chunk[0])

        def real(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() < 2 or tensor.shape[0] != len(rows):
                return tensor
            return torch.cat([layout.tokens(tensor, row).flatten() for row in rows])
        return real
