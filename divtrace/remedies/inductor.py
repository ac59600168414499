"""Remedies for compiled code (``compare_compiled``'s regions): inductor settings in force
while compiling (:class:`InductorSettings`), one kernel for every batch size
(:class:`DynamicShapes`), a region left eager (:class:`EagerRegions`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from divtrace.compat import inductor_settings
from divtrace.errors import DivtraceValueError
from divtrace.plan.compiled import Compiled
from divtrace.remedies.remedy import Remedy, Situation

__all__ = ["DynamicShapes", "EagerRegions", "InductorSettings"]

#: What ``candidates=["inductor"]`` tries on each device, one remedy each: the settings
#: that keep a reduction's strategy from following the batch's shape (the C++ backend's
#: threads over one reduction; Triton's split reductions, and its persistent reductions,
#: whose choice depends on the size of the reduced rows). ``max_autotune`` is off by
#: default, so it is not among them.
DEFAULTS: dict[str, tuple[dict[str, Any], ...]] = {
    "cpu": ({"cpp.threads": 1},),
    "cuda": ({"split_reductions": False}, {"triton.persistent_reductions": False})}


class InductorSettings(Remedy):
    """Inductor settings (``torch._inductor.config``, dotted names) in force while the
    compared code compiles: e.g. ``{"cpp.threads": 1}`` on the CPU,
    ``{"split_reductions": False}`` on CUDA. They are settings of this torch version;
    outside the block inductor's config is as it was.

    Example:
        >>> import divtrace
        >>> divtrace.remedies.InductorSettings({"split_reductions": False}).name
        'inductor split_reductions=False'
    """

    kind = "inductor"

    @property
    def reaches_copies(self) -> bool:
        return True

    def __init__(self, settings: Mapping[str, Any]) -> None:
        if not isinstance(settings, Mapping) or not settings:
            raise DivtraceValueError(
                f"InductorSettings(settings) takes a dict of inductor settings, e.g. "
                f"{{'split_reductions': False}}; got {settings!r}")
        self.settings = dict(settings)
        self.missing = _missing(self.settings)
        if self.missing is not None:  # the names checked now, not when applied
            raise DivtraceValueError(f"{self.missing}: give names of torch._inductor.config")

    @classmethod
    def defaults(cls, on_cuda: bool) -> list[InductorSettings]:
        """The settings tried by default on that device, one remedy each (not tried
        where this torch's inductor lacks them)."""
        made = []
        for settings in DEFAULTS["cuda" if on_cuda else "cpu"]:
            one = cls.__new__(cls)
            one.settings = dict(settings)
            one.missing = _missing(one.settings)
            made.append(one)
        return made

    @property
    def name(self) -> str:
        return "inductor " + ", ".join(f"{k}={v!r}" for k, v in self.settings.items())

    def unusable(self, situation: Situation) -> str | None:
        if not situation.compiled:
            return "the runs run no code compiled by divtrace"
        return self.missing

    def caveat(self, situation: Situation) -> str:
        return f"a setting of torch {torch.__version__}'s inductor, in force when compiling"

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "settings": self.settings}

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        stack.enter_context(inductor_settings(self.settings))


def _missing(settings: Mapping[str, Any]) -> str | None:
    """Why inductor cannot take ``settings`` (None: it can)."""
    try:
        inductor_settings(settings)
    except ValueError as error:
        return str(error)
    return None


def _recompiled(plan: Any, **settings: Any) -> Any:
    """``plan`` with its compiled runs compiled otherwise (one new copy shared by both)."""
    copies: dict[int, nn.Module] = {}
    runs = {which: replace(run, copies=copies, **settings) if isinstance(run, Compiled)
            else run for which, run in (("a", plan.a), ("b", plan.b))}
    return replace(plan, **runs)


class _Recompiling(Remedy):
    """A remedy that compiles the runs' copies otherwise: applied by compiling so."""

    @property
    def reaches_copies(self) -> bool:
        return True

    def unusable(self, situation: Situation) -> str | None:
        return None if situation.compiled else "the runs run no code compiled by divtrace"

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        """Nothing to put in force: the runs' copies are compiled otherwise
        (:meth:`replanned`)."""


class DynamicShapes(_Recompiling):
    """The regions compiled with ``dynamic=True``: one kernel for every batch size (apply
    it as ``torch.compile(..., dynamic=True)``, or ``torch._dynamo.mark_dynamic`` on the
    batch dimension)."""

    kind = "dynamic"

    @property
    def name(self) -> str:
        return "dynamic shapes"

    def caveat(self, situation: Situation) -> str:
        return "compiled with dynamic=True: every dimension may vary, not only the batch's"

    def replanned(self, plan: Any) -> Any:
        return _recompiled(plan, dynamic=True)


class EagerRegions(_Recompiling):
    """Some regions left eager, the others compiled (apply it by not compiling them).

    Args:
        modules: The regions left eager.
    """

    kind = "eager-region"

    def __init__(self, modules: Sequence[str]) -> None:
        self._modules = tuple([modules] if isinstance(modules, str) else modules)
        if not self._modules:
            raise DivtraceValueError("EagerRegions(modules) takes the regions to leave eager")

    @property
    def modules(self) -> tuple[str, ...]:
        return self._modules

    @property
    def name(self) -> str:
        shown = ", ".join(self._modules[:3])
        more = len(self._modules) - 3
        return f"eager in {shown}" + (f" (+{more} more)" if more > 0 else "")

    def unusable(self, situation: Situation) -> str | None:
        return super().unusable(situation) or (
            None if self._modules else "no compiled region parts the runs")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "modules": list(self._modules)}

    def replanned(self, plan: Any) -> Any:
        run = plan.b if isinstance(plan.b, Compiled) else plan.a
        kept = tuple(r for r in run.regions if r not in self._modules)
        return _recompiled(plan, regions=kept)
