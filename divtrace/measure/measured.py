"""What the measured run records of each site and each leaf call: :class:`Measured` (a
site's figures, on the host after the fetch), :class:`CallRecord` and :class:`LeafCall`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from divtrace.align.sites import Site
from divtrace.align.status import Status
from divtrace.measure.host import Deferred
from divtrace.record.lineage import InputPart, Origin
from divtrace.record.recorder import Tracker

__all__ = ["CallRecord", "LeafCall", "Measured"]


@dataclass
class Measured:
    """One site of the measured run: what it is and, if it could be compared, its stats."""

    site: Site
    status: Status
    shape: tuple[int, ...]
    dtype: torch.dtype
    stats: Deferred | None = None  # [samples, len(FIELDS)]
    flips: Deferred | None = None  # [samples] argmax flips, for 2-D model outputs
    #: for floating model outputs: the element-wise view (see :func:`elementwise`)
    elements_view: Deferred | None = None
    kept: torch.Tensor | None = None  # the measured run's rows, when kept
    #: for prompts of different lengths, the kept rows as one tensor per compared prompt
    kept_parts: list[torch.Tensor] | None = None
    #: compared elements per sample, where they differ from sample to sample (prompts of
    #: different lengths); None: the shape's elements over the batch
    elements: tuple[int, ...] | None = None
    #: the compared rows' fingerprints (:mod:`~divtrace.measure.prints`), when asked for
    prints: torch.Tensor | None = None
    #: for prompts of different lengths, the shape of each compared prompt's part
    part_shapes: tuple[tuple[int, ...], ...] | None = None

    def per_sample(self, batch: int) -> int | np.ndarray:
        """The compared elements of each sample (one number when all are equal)."""
        if self.elements is not None:
            return np.asarray(self.elements)
        return math.prod(self.shape) // batch


@dataclass
class CallRecord:
    """A leaf module call of the measured run: where each input came from, and, for an
    input no observed module made, its own comparison."""

    inputs: list[tuple[Origin, str | None, Measured | None]]


@dataclass(frozen=True)
class LeafCall:
    """A leaf call of the measured run, as its hook sees it: a leaf module's call (after
    it ran) or an op's (before it runs: ``output`` is None)."""

    site: Site
    run: Callable[..., Any]  # the module, or the op
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    parts: list[InputPart]
    tracker: Tracker
    training: bool = False  # the module is in train mode
