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
        self.settings = dict(settings)
        self.missing = _missing(self.settings)
        if self.missing is not None:  # the names checked now, not when applied
            raise DivtraceValueError(f"{self.missing}: give names of torch._inductor.config")

    @classmethod
    def for_device(cls, on_cuda: bool) -> InductorSettings:
        """The settings tried by default on that device (not tried where this torch's
        inductor lacks them)."""
        made = cls.__new__(cls)
        made.settings = dict(DEFAULTS["cuda" if on_cuda else "cpu"])
        made.missing = _missing(made.settings)
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
