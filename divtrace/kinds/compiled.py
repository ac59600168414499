"""Compiled code module by module (``compare_compiled``): both runs, or run b only, run a
copy of the model compiled region by region (:class:`~divtrace.plan.compiled.Compiled`);
the sites are the regions' outputs and the eager modules between them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from divtrace.errors import DivtraceValueError
from divtrace.kinds.kind import Kind, Paired
from divtrace.kinds.prompts import Ragged
from divtrace.plan.make import Plan
from divtrace.plan.prompts import Prompts
from divtrace.plan.runs import Run

__all__ = ["CompiledRegions"]


@dataclass(frozen=True)
class CompiledRegions(Paired):
    """Run a (``first``) against run b (``second``), one or both compiled region by
    region; the rows read as ``rows`` reads them."""

    first: Run | None = None
    second: Run | None = None
    name: ClassVar[str] = "compiled"
    cannot: ClassVar[Mapping[str, str]] = {
        "graphs": "compiled code is not captured into CUDA graphs by divtrace"}

    @classmethod
    def of(cls, x: Any, first: Run, second: Run) -> CompiledRegions:
        """The kind for input ``x``: prompts of different lengths read as such."""
        rows: Kind = Ragged() if isinstance(x, Prompts) else Kind()
        return cls(rows, first, second)

    @staticmethod
    def claims(plan: Plan) -> bool:
        return False  # only ever given: compare_compiled

    def runs(self, a: Run | None, b: Run | None) -> tuple[Run | None, Run | None]:
        return self.first, self.second

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if plan.ops:
            raise DivtraceValueError(
                "ops= records the ATen ops of eager code, and a compiled region runs none "
                "that divtrace can see: leave ops out, or give that module eager "
                "(compare_compiled(..., regions=[...]) without it)")
