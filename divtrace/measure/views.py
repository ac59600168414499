"""The measured run's compared rows read in place, for the small sites of one pass.

A queued site's compared rows are usually a copy of them (one op per site, launched from
Python: on a GPU, most of what a small site costs). When the reference run's first pass
showed that no later op changes a site's tensor in place (:attr:`RowStore.steady`), the
queue may hold a view of the rows instead. Every viewed tensor is checked unchanged
(version counter and write count) before its block is read and at the end of the pass;
if one changed, the pass is measured again, with copies, and its first measurement is
dropped. The stored rows are then released at the end of the pass, not site by site, so
views are taken only while they are few bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from divtrace.compat import version
from divtrace.measure.host import Host
from divtrace.measure.queue import Queue, Viewed
from divtrace.record.recorder import Tracker, writes
from divtrace.record.rows import RowStore
from divtrace.record.stored import runs_of

__all__ = ["VIEW_BYTES", "VIEW_DEVICES", "PassViews"]

#: Views are taken while the stored rows hold at most this many bytes, and while the
#: tensors they hold (whole, all rows) hold at most as many in the pass.
VIEW_BYTES = 64 << 20
#: The devices where views are taken: on a CPU a copy of a few rows costs no more than
#: the view's checks, and memory held longer costs fresh pages.
VIEW_DEVICES = frozenset({"cuda"})


@dataclass
class PassViews:
    """Views of the measured run's rows for one pass at a time (see the module)."""

    store: RowStore
    host: Host
    #: no views for good (a pass found a viewed tensor changed, or none may be taken)
    off: bool = False
    on: bool = False  # views in the pass under way
    _first: int | None = None  # the first compared row, when they are one run of rows
    _tracker: Tracker | None = None
    _mark: tuple[int, int] = (0, 0)  # the host's places and the sites, at the pass start
    _calls: dict[str, Any] = field(default_factory=dict)
    _later: list[str] = field(default_factory=list)  # sites whose rows wait for the end
    _held: int = 0  # bytes of the tensors viewed in the pass

    def __post_init__(self) -> None:
        runs = runs_of(list(self.store.samples))
        self._first = runs[0][1] if len(runs) == 1 else None

    def begin(self, allowed: bool, tracker: Tracker, sites: int, calls: dict[str, Any]
              ) -> None:
        """A pass begins (``allowed``: nothing else needs the rows copied)."""
        device = next((stored.rows.device.type for stored in self.store.rows.values()
                       if stored.rows is not None), None)
        self.on = (allowed and not self.off and self._first is not None
                   and device in VIEW_DEVICES and bool(self.store.steady)
                   and self.store.batch_dim == 0 and self.store.stored_bytes <= VIEW_BYTES)
        self._tracker, self._held = tracker, 0
        if self.on:
            self._mark = (self.host.mark(), sites)
            self._calls = dict(calls)

    def view(self, key: str, tensor: torch.Tensor, wrote: int
             ) -> tuple[torch.Tensor, Viewed] | None:
        """The compared rows of ``tensor`` (batch first) as a view, and what to check
        before it is read; None where they must be copied."""
        if (not self.on or key not in self.store.steady or self._first is None
                or tensor.device.type not in VIEW_DEVICES):
            return None
        rows = tensor.narrow(0, self._first, len(self.store.samples))
        size = tensor.numel() * tensor.element_size()
        if not rows.is_contiguous() or self._held + size > VIEW_BYTES:
            return None
        self._held += size
        return rows, (tensor, version(tensor), wrote)

    def unchanged(self, viewed: list[Viewed]) -> bool:
        """Whether every viewed tensor is as it was when its rows were queued."""
        return all(version(t) == seen and writes(self._tracker, t) == wrote
                   for t, seen, wrote in viewed)

    def measured(self, key: str) -> None:
        """The pass is done with a site's stored rows: released now, or at its end."""
        if self.on:
            self._later.append(key)
        else:
            self.store.measured(key)

    def end(self, queues: Sequence[Queue], sites: list[Any], calls: dict[str, Any]) -> bool:
        """The pass ended: ``queues`` are flushed (their views checked first). True: its
        measurement stands; False: a viewed tensor changed, the measurement was dropped
        and the pass must run again, with copies."""
        if not self.on:
            return True
        self.on = False
        for queue in queues:
            queue.flush()
        stale = any(queue.stale for queue in queues)
        for queue in queues:
            queue.stale = False
        if not stale:
            for key in self._later:
                self.store.measured(key)
            self._later.clear()
            return True
        self._later.clear()
        self.off = True
        places, count = self._mark
        self.host.rollback(places)
        del sites[count:]
        calls.clear()
        calls.update(self._calls)
        return False
