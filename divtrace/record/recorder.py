"""The recorder seam: what observes a run, and the sink it hands every tensor to.

A :class:`Recorder` observes forward passes of a model and hands every tensor produced
at a site to a :class:`Sink`: the row store of a recorded run, or the meter of the
measured run. Module forward hooks (:class:`~divtrace.record.hooks.ModuleHooks`) are
one recorder; others (op-level, CUDA graphs) plug in beside it.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections import defaultdict
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import Site
from divtrace.compat import version

__all__ = ["Recorder", "Sink", "Tracker"]


@dataclass
class Tracker:
    """The state of one forward pass: call counts, the last site reached (for error
    notes), and which site produced which tensor (for telling sources from carriers)."""

    calls: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    last_site: str | None = None
    replaying: bool = False  # while set, the recorder ignores what runs
    lineage: bool = True  # note which site produced which tensor
    _made: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = field(default_factory=dict)

    def reset(self) -> None:
        self.calls.clear()
        self.last_site = None
        self._made.clear()

    def produced(self, key: str, tensor: torch.Tensor) -> None:
        """Notes that the site ``key`` output ``tensor`` (while ``lineage`` is on)."""
        if self.lineage:
            self._made[id(tensor)] = (weakref.ref(tensor), key, version(tensor))

    def producer(self, tensor: torch.Tensor, in_place: bool = False) -> str | None:
        """The site that output this very tensor, unchanged since, in this pass (or None).

        ``in_place``: the module being looked at returns ``tensor`` itself, so the change
        of its version is that module's own doing.
        """
        entry = self._made.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        if version(tensor) != entry[2] and not in_place:
            return None
        return entry[1]


class Sink:
    """Receives what a recorder observes. The defaults do nothing."""

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        """A pass over rows ``start:stop`` of the batch begins."""

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        """A leaf module call returned; called before its outputs reach :meth:`on_tensor`."""

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        """A tensor produced at ``site``. It must not be kept beyond the call (a later
        in-place op may change it): only copies of it, or figures made from it."""

    def end_chunk(self) -> bool:
        """The pass ended. False asks for the same pass again (see the row store)."""
        return True


class Recorder(ABC):
    """Observes forward passes of one model and hands every produced tensor to a sink."""

    @abstractmethod
    def observe(self, sink: Sink) -> AbstractContextManager[Tracker]:
        """A context inside which every forward pass is observed. On exit, the model is
        exactly as before (every hook or mode removed), also when a pass raised."""
