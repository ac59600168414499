"""One backward over the batch against gradient accumulation over chunks
(``compare_backward``): every pass is a training pass, run by the face's driver, and the
split run runs every chunk, as accumulation needs them all."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from divtrace.kinds.kind import Kind
from divtrace.plan.inputs import Driver
from divtrace.plan.make import Plan

__all__ = ["Accumulation"]


@dataclass(frozen=True)
class Accumulation(Kind):
    """The batched run's backward against the split run's accumulated one, the forward
    sites recorded in the training passes: ``driver`` turns a pass into a training pass,
    ``chunks`` are every chunk of the split run, in order."""

    driver: Driver
    chunks: tuple[tuple[int, int], ...]
    name: ClassVar[str] = "accumulation"
    cannot: ClassVar[Mapping[str, str]] = {
        "graphs": "every pass is a training pass, with autograd",
        "remedies": "compare_backward looks at the training passes; try a remedy on the "
                    "forward pass with divtrace.compare(...).remedies()"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        return False  # only ever given: compare_backward

    def prepared(self, plan: Plan) -> Plan:
        return replace(plan, batch=replace(plan.batch, driver=self.driver),
                       a_chunks=self.chunks)
