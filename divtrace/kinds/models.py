"""Two models on the same input (``compare_models``): run b runs the other model, its
modules named as run a's, so that their sites align."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from divtrace.kinds.kind import Kind
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.plan.inputs import BatchedInput
from divtrace.plan.make import Plan
from divtrace.record.rows import RowStore

__all__ = ["TwoModels"]


@dataclass(frozen=True)
class TwoModels(Kind):
    """Run a on the first model, run b on the other one, each site against its namesake;
    ``rows``: the kind whose row stores and meters read the input (prompts of different
    lengths, or a plain batch)."""

    rows: Kind = field(default_factory=Kind)
    name: ClassVar[str] = "two models"
    cannot: ClassVar[Mapping[str, str]] = {
        "remedies": "remedies() looks for a setting that makes two runs of one model agree; "
                    "this comparison ran two models (compare_models), whose difference no "
                    "setting of one of them removes"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        return plan.b.other_model is not None

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
