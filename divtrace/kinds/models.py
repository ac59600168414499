"""Two models on the same input (``compare_models``): run b runs the other model, its
modules named as run a's, so that their sites align."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from divtrace.kinds.kind import Paired
from divtrace.plan.make import Plan

__all__ = ["TwoModels"]


@dataclass(frozen=True)
class TwoModels(Paired):
    """Run a on the first model, run b on the other one, each site against its namesake;
    ``rows``: the kind whose row stores and meters read the input (prompts of different
    lengths, or a plain batch)."""

    name: ClassVar[str] = "two models"
    cannot: ClassVar[Mapping[str, str]] = {
        "remedies": "remedies() looks for a setting that makes two runs of one model agree; "
                    "this comparison ran two models (compare_models), whose difference no "
                    "setting of one of them removes"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        return plan.b.other_model is not None

