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
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from divtrace.align.sites import Site
from divtrace.compat import version

if TYPE_CHECKING:
    from divtrace.record.lineage import InputPart

__all__ = ["OP_RANGE", "Gate", "Recorder", "Sink", "Tracker", "writes"]

#: Between the prefix and the key in the name of an op call's profiler range (an op
#: runs inside its module call's range; the kernels it launches count for both).
OP_RANGE = "op::"


@dataclass
class Tracker:
    """The state of one forward pass: call counts, the last site reached (for error
    notes), and which site produced which tensor (for telling sources from carriers)."""

    calls: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    last_site: str | None = None
    replaying: bool = False  # while set, the recorder ignores what runs
    lineage: bool = True  # note which site produced which tensor
    rows: int = 0  # the rows of the batch in the pass in progress
    _made: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = field(default_factory=dict)

    def reset(self, rows: int = 0) -> None:
        """A new pass over ``rows`` rows of the batch begins."""
        self.calls.clear()
        self.last_site = None
        self.rows = rows
        self._made.clear()

    def produced(self, key: str, tensor: torch.Tensor) -> None:
        """Notes that the site ``key`` output ``tensor`` (while ``lineage`` is on)."""
        if self.lineage:
            self._made[id(tensor)] = (weakref.ref(tensor), key, version(tensor))

    def sharing(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A site's output in this pass, unchanged since, that is ``tensor`` under another
        name: the same memory, shape, strides and dtype (a DTensor's local view of it)."""
        for ref, _key, seen in self._made.values():
            made = ref()
            if (made is not None and made.data_ptr() == tensor.data_ptr()
                    and made.shape == tensor.shape and made.stride() == tensor.stride()
                    and made.dtype == tensor.dtype and version(made) == seen):
                return made
        return None

    def writes_to(self, tensor: torch.Tensor) -> int:
        """How many in-place writes to ``tensor``'s memory the recorder saw in this pass
        (those its version counter may miss, made through an alias); 0 when not counted."""
        return 0

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


def writes(tracker: Tracker | None, tensor: torch.Tensor) -> int:
    """:meth:`Tracker.writes_to` of ``tensor`` (0 before a pass gave a tracker)."""
    return 0 if tracker is None else tracker.writes_to(tensor)


class Sink:
    """Receives what a recorder observes. The defaults do nothing."""

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        """A pass over rows ``start:stop`` of the batch begins."""

    def pass_rows(self, start: int, stop: int) -> int:
        """The rows the pass over ``start:stop`` really has: more when something pads
        every call to a fixed batch size (see :attr:`RowStore.padded`)."""
        return stop - start

    def piece(self, tokens: Any, rows: int) -> None:
        """A forward call of a pass laid out in several begins (a token layout's: a
        prefill chunk, a decode step): ``tokens`` (a ``TokenMap``) says where the pass's
        sequences lie in its ``rows`` rows."""

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        """A leaf module call returned; called before its outputs reach :meth:`on_tensor`."""

    def on_op(self, call: Site, op: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], parts: list[InputPart], tracker: Tracker) -> None:
        """An op call is about to run (its outputs reach :meth:`on_tensor` after it ran):
        ``parts`` says where each of its tensor inputs came from."""

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        """A tensor produced at ``site``. It must not be kept beyond the call (a later
        in-place op may change it): only copies of it, or figures made from it."""

    def end_chunk(self) -> bool:
        """The pass ended. False asks for the same pass again (see the row store)."""
        return True


@dataclass
class Gate(Sink):
    """Hands another sink what the recorder observes while ``active`` (a driver's pass
    that is not all observed); the pass's beginning and end always."""

    sink: Sink
    active: bool = False

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        self.sink.begin_chunk(start, stop, tracker)

    def pass_rows(self, start: int, stop: int) -> int:
        return self.sink.pass_rows(start, stop)

    def piece(self, tokens: Any, rows: int) -> None:
        self.sink.piece(tokens, rows)

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        if self.active:
            self.sink.on_call(call, module, args, kwargs, output, tracker)

    def on_op(self, call: Site, op: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], parts: list[InputPart], tracker: Tracker) -> None:
        if self.active:
            self.sink.on_op(call, op, args, kwargs, parts, tracker)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        if self.active:
            self.sink.on_tensor(site, tensor)

    def end_chunk(self) -> bool:
        return self.sink.end_chunk()


class Recorder(ABC):
    """Observes forward passes of one model and hands every produced tensor to a sink."""

    @abstractmethod
    def observe(self, sink: Sink) -> AbstractContextManager[Tracker]:
        """A context inside which every forward pass is observed. On exit, the model is
        exactly as before (every hook or mode removed), also when a pass raised."""

    def ranges(self, prefix: str, rows: int) -> AbstractContextManager[None]:
        """A context inside which each site's work, in a pass over ``rows`` rows of the
        batch, runs in a profiler range named ``prefix`` + the site's call key (for the
        kernels each site launched); an op call's range: ``prefix + OP_RANGE + key``."""
        return nullcontext()
