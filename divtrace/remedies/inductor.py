"""Inductor settings as a remedy for compiled code (:class:`InductorSettings`): while in
force, code compiled under them is made with them (``compare_compiled``'s regions)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from divtrace.compat import inductor_settings
from divtrace.errors import DivtraceValueError
from divtrace.remedies.remedy import Remedy, Situation

__all__ = ["InductorSettings"]

#: What ``candidates=["inductor"]`` tries on each device: the setting that keeps a
#: reduction from being split by the batch's shape (the C++ backend's threads over one
#: reduction; Triton's split reductions).
DEFAULTS: dict[str, dict[str, Any]] = {"cpu": {"cpp.threads": 1},
                                     "cuda": {"split_reductions": False}}


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

    def __init__(self, settings: Mapping[str, Any]) -> None:
        if not isinstance(settings, Mapping) or not settings:
            raise DivtraceValueError(
                f"InductorSettings(settings) takes a dict of inductor settings, e.g. "
                f"{{'split_reductions': False}}; got {settings!r}")
        try:
            inductor_settings(settings)  # the names checked now, not when applied
        except ValueError as error:
            raise DivtraceValueError(f"{error}: give names of torch._inductor.config") from None
        self.settings = dict(settings)

    @classmethod
    def for_device(cls, on_cuda: bool) -> InductorSettings:
        """The settings tried by default on that device."""
        return cls(DEFAULTS["cuda" if on_cuda else "cpu"])

    @property
    def name(self) -> str:
        return "inductor " + ", ".join(f"{k}={v!r}" for k, v in self.settings.items())

    def unusable(self, situation: Situation) -> str | None:
        return None if situation.compiled else "the runs run no code compiled by divtrace"

    def caveat(self, situation: Situation) -> str:
        return f"a setting of torch {torch.__version__}'s inductor, in force when compiling"

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "settings": self.settings}

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        stack.enter_context(inductor_settings(self.settings))
