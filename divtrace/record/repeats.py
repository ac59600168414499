"""Sites that hand on the very tensor of the site before them.

A container returns its last child's output as it is (``nn.Sequential``, a torchvision
``Conv2dNormActivation`` or inverted-residual block, ``nn.Identity``): its hook sees the
same tensor object, unchanged, that the child's hook saw just before. Its rows are that
site's rows, bit for bit, in that run; when both runs hand the tensor on alike, its
figures are that site's figures. The row store and the meter use this to copy and to
measure such a tensor once (in mobilenet_v3_small, 84 of 209 sites hand their tensor on).

:meth:`~divtrace.record.recorder.Tracker.producer` answers a wider question for the
lineage (which site made any tensor), but only while the tracker notes the lineage (the
row store's first chunk) and without the recorder's count of writes; the sinks need the
answer in every pass, for the one tensor they took last.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

import torch

from divtrace.compat import version

__all__ = ["LastTensor"]

T = TypeVar("T")


class LastTensor(Generic[T]):
    """The last tensor a sink took at a site: its key, what the sink made of it
    (``payload``), and its version, to tell whether the next site's tensor is that very
    tensor, unchanged since (not a copy, not changed in place: its version counter and
    the recorder's count of writes through aliases both unmoved)."""

    __slots__ = ("_key", "_ref", "_version", "_writes", "payload")

    def __init__(self) -> None:
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._key = ""
        self._version = self._writes = 0
        self.payload: T | None = None

    def note(self, key: str, tensor: torch.Tensor, writes: int, payload: T | None = None
             ) -> None:
        """The site ``key`` took ``tensor`` (``writes``: the recorder's count of writes to
        its memory so far)."""
        self._ref, self._key = weakref.ref(tensor), key
        self._version, self._writes, self.payload = version(tensor), writes, payload

    def repeats(self, tensor: torch.Tensor, writes: int) -> str | None:
        """The key of the last site, if ``tensor`` is its very tensor, unchanged since."""
        ref = self._ref
        if ref is None or ref() is not tensor:
            return None
        if version(tensor) != self._version or writes != self._writes:
            return None
        return self._key

    def forget(self) -> None:
        """A new pass: nothing taken yet."""
        self._ref, self.payload = None, None
