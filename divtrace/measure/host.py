"""The one host synchronisation: device tensors collected during the runs, fetched once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from divtrace.measure.scale import common_arrays

__all__ = ["Deferred", "Host", "Joined"]


class Deferred:
    """A device tensor whose host copy arrives with all the others (see :class:`Host`)."""

    __slots__ = ("_host", "_index")

    def __init__(self, host: Host, index: int) -> None:
        self._host, self._index = host, index

    @property
    def index(self) -> int:
        return self._index

    def get(self) -> np.ndarray:
        """The host copy (after :meth:`Host.fetch`)."""
        return self._host.array(self._index)

    def peek(self) -> torch.Tensor:
        """The device tensor itself, before :meth:`Host.fetch` (reading it waits for the
        device: a synchronisation of its own)."""
        return self._host.tensor(self._index)


class Joined(Deferred):
    """Several places' host copies, end to end along the first dimension (e.g. one site's
    rows, measured in several groups). ``scaled``: the places are a site's fields of a
    wide dtype, each row at its own scale; they come brought to one
    (:func:`~divtrace.measure.scale.common_arrays`)."""

    __slots__ = ("_parts", "_scaled")

    def __init__(self, parts: list[Deferred], scaled: bool = False) -> None:
        first = parts[0]
        super().__init__(first._host, first.index)
        self._parts, self._scaled = parts, scaled

    def get(self) -> np.ndarray:
        arrays = [part.get() for part in self._parts]
        if self._scaled:
            arrays = common_arrays(arrays)[0]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def peek(self) -> torch.Tensor:
        tensors = [part.peek() for part in self._parts]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class Host:
    """Collects device tensors during the runs, then brings them all to the host in one
    transfer (one synchronisation) per device."""

    def __init__(self) -> None:
        # per place: a tensor, and the range of its first dimension the place holds (None:
        # all of it); places that share a tensor are carried over together, sliced after
        self._tensors: list[tuple[torch.Tensor, tuple[int, int] | None] | None] = []
        self._arrays: list[np.ndarray] | None = None
        self._before: list[Callable[[], None]] = []

    def add(self, tensor: torch.Tensor) -> Deferred:
        """Schedules ``tensor`` for the transfer."""
        self._tensors.append((tensor, None))
        return Deferred(self, len(self._tensors) - 1)

    def reserve(self) -> Deferred:
        """A place for a tensor computed later (:meth:`put`), before :meth:`fetch`."""
        self._tensors.append(None)
        return Deferred(self, len(self._tensors) - 1)

    def put(self, deferred: Deferred, tensor: torch.Tensor,
            rows: tuple[int, int] | None = None) -> None:
        """Fills a place :meth:`reserve` made with ``tensor``, or with rows
        ``start:stop`` of it (no slice made on the device: many places may share one
        tensor)."""
        self._tensors[deferred.index] = (tensor, rows)

    def before_fetch(self, work: Callable[[], None]) -> None:
        """Runs ``work`` (e.g. statistics computed together) first when fetching."""
        self._before.append(work)

    def fetch(self) -> None:
        """Brings every scheduled tensor to the host."""
        for work in self._before:
            work()
        missing = [i for i, t in enumerate(self._tensors) if t is None]
        if missing:
            raise RuntimeError(f"{len(missing)} reserved tensor(s) were never put")
        placed = [t for t in self._tensors if t is not None]
        bases: dict[int, torch.Tensor] = {}  # each tensor once, by id
        for tensor, _ in placed:
            bases.setdefault(id(tensor), tensor)
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for tensor in bases.values():
            by_device[tensor.device].append(tensor)
        held: dict[int, np.ndarray] = {}
        for tensors in by_device.values():
            flat = torch.cat([t.reshape(-1) for t in tensors]).cpu().numpy()
            offset = 0
            for t in tensors:
                size = t.numel()
                held[id(t)] = flat[offset:offset + size].reshape(tuple(t.shape))
                offset += size
        self._arrays = [held[id(tensor)] if rows is None else held[id(tensor)][rows[0]:rows[1]]
                        for tensor, rows in placed]
        self._tensors = []

    def tensor(self, index: int) -> torch.Tensor:
        """The device tensor of a place, before the fetch (see :meth:`Deferred.peek`)."""
        placed = self._tensors[index] if index < len(self._tensors) else None
        if placed is None:
            raise RuntimeError("the place is empty, or Host.fetch() has run already")
        tensor, rows = placed
        return tensor if rows is None else tensor[rows[0]:rows[1]]

    def array(self, index: int) -> np.ndarray:
        if self._arrays is None:
            raise RuntimeError("Host.fetch() has not run yet")
        return self._arrays[index]
