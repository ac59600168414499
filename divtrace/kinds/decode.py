"""One step of greedy decoding (``Generation.at(step)``): each pass of either run is the
model's own ``generate()`` up to the step, run by the face's driver, and only that step's
forward call is observed; each prompt's real tokens are compared, as for prompts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from divtrace.kinds.prompts import Ragged
from divtrace.plan.inputs import Driver
from divtrace.plan.make import Plan
from divtrace.plan.prompts import RaggedInput

__all__ = ["DecodeStep"]


@dataclass(frozen=True)
class DecodeStep(Ragged):
    """The padded prompts' decoding against each prompt's alone (or in chunks), compared
    at step ``step`` (0: the prefill); ``driver`` runs ``generate()`` up to it."""

    step: int
    driver: Driver
    name: ClassVar[str] = "decode step"
    cannot: ClassVar[Mapping[str, str]] = {
        **Ragged.cannot,
        "remedies": "remedies() reruns one forward pass; a decode step is reached through "
                    "generate(): try the remedy on compare(model, Prompts(...)) or around "
                    "compare_generate"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        return False  # only ever given: Generation.at

    def prepared(self, plan: Plan) -> Plan:
        batch = plan.batch
        assert isinstance(batch, RaggedInput)  # checked by make_plan: Prompts are given
        return replace(plan, batch=replace(batch, driver=self.driver, step=self.step))
