"""The one host synchronisation: device tensors collected during the runs, fetched once."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

__all__ = ["Deferred", "Host"]


class Deferred:
    """A device tensor whose host copy arrives with all the others (see :class:`Host`)."""

    __slots__ = ("_host", "_index")

    def __init__(self, host: Host, index: int) -> None:
        self._host, self._index = host, index

    def get(self) -> np.ndarray:
        """The host copy (after :meth:`Host.fetch`)."""
        return self._host.array(self._index)


class Host:
    """Collects device tensors during the runs, then brings them all to the host in one
    transfer (one synchronisation) per device."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._arrays: list[np.ndarray] | None = None

    def add(self, tensor: torch.Tensor) -> Deferred:
        """Schedules ``tensor`` for the transfer."""
        self._tensors.append(tensor)
        return Deferred(self, len(self._tensors) - 1)

    def fetch(self) -> None:
        """Brings every scheduled tensor to the host."""
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for i, t in enumerate(self._tensors):
            by_device[t.device].append(i)
        arrays: list[np.ndarray] = [np.empty(0)] * len(self._tensors)
        for indices in by_device.values():
            flat = torch.cat([self._tensors[i].reshape(-1) for i in indices]).cpu().numpy()
            offset = 0
            for i in indices:
                size = self._tensors[i].numel()
                arrays[i] = flat[offset:offset + size].reshape(tuple(self._tensors[i].shape))
                offset += size
        self._arrays = arrays
        self._tensors = []

    def array(self, index: int) -> np.ndarray:
        if self._arrays is None:
            raise RuntimeError("Host.fetch() has not run yet")
        return self._arrays[index]
