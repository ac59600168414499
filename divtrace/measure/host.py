"""The one host synchronisation: device tensors collected during the runs, fetched once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["Deferred", "Host"]


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


class Host:
    """Collects device tensors during the runs, then brings them all to the host in one
    transfer (one synchronisation) per device."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor | None] = []
        self._arrays: list[np.ndarray] | None = None
        self._before: list[Callable[[], None]] = []

    def add(self, tensor: torch.Tensor) -> Deferred:
        """Schedules ``tensor`` for the transfer."""
        self._tensors.append(tensor)
        return Deferred(self, len(self._tensors) - 1)

    def reserve(self) -> Deferred:
        """A place for a tensor computed later (:meth:`put`), before :meth:`fetch`."""
        self._tensors.append(None)
        return Deferred(self, len(self._tensors) - 1)

    def put(self, deferred: Deferred, tensor: torch.Tensor) -> None:
        """Fills a place :meth:`reserve` made."""
        self._tensors[deferred.index] = tensor

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
        ready: list[torch.Tensor] = [t for t in self._tensors if t is not None]
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for i, t in enumerate(ready):
            by_device[t.device].append(i)
        arrays: list[np.ndarray] = [np.empty(0)] * len(ready)
        for indices in by_device.values():
            flat = torch.cat([ready[i].reshape(-1) for i in indices]).cpu().numpy()
            offset = 0
            for i in indices:
                size = ready[i].numel()
                arrays[i] = flat[offset:offset + size].reshape(tuple(ready[i].shape))
                offset += size
        self._arrays = arrays
        self._tensors = []

    def array(self, index: int) -> np.ndarray:
        if self._arrays is None:
            raise RuntimeError("Host.fetch() has not run yet")
        return self._arrays[index]
