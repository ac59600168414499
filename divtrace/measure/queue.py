"""Statistics of many small sites computed together: on the CPU, where each site's own
statistics would cost a few dozen tiny torch calls (:class:`StatsQueue`), and on CUDA,
where each would cost a kernel launched from Python (:class:`FusedQueue`).

Each queued pair of blocks (the measured run's compared rows, the reference run's) waits;
:meth:`StatsQueue.flush` stacks the pairs of one dtype, tolerance and row width into one
block and computes every row's fields in one call per block; bit-identical sites are
stacked apart from the others, so each takes the path it would take alone. A row's fields
are reduced along the row alone, so they are exactly those of the site measured on its own
(only pairs the per-site path would measure as one block are queued).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from divtrace.measure import fused
from divtrace.measure.host import Deferred, Host
from divtrace.measure.scale import SCALE, WIDE, common, rescaled
from divtrace.measure.stats import block_stats

__all__ = ["FUSED_ELEMENTS", "QUEUE_WIDTH", "FusedQueue", "StatsQueue", "budget_for"]

#: Rows wider than this are measured at once, as before (their work is not overhead).
QUEUE_WIDTH = 1 << 14
#: Queued blocks are flushed when they hold ``share`` of the recorded rows' bytes, but
#: never less than this (memory stays a small part of what the reference run stores).
_MIN_BUDGET = 8 << 20
#: Elements of one block computed at a flush (whole sites; see :func:`_parts`), as many
#: as the per-site path's blocks.
_FLUSH_ELEMENTS = 1 << 18

#: On CUDA, sites of at most this many compared elements are queued (a copy of their
#: compared rows waits); wider ones are measured at once, in place (their launch is not
#: what they cost).
FUSED_ELEMENTS = 1 << 20

_Pairs = list[tuple[Deferred, torch.Tensor, torch.Tensor]]


def budget_for(stored_bytes: int, share: float = 0.1) -> int:
    """The queue's budget: ``share`` of the reference run's stored bytes, at least 8 MiB."""
    return max(_MIN_BUDGET, int(share * stored_bytes))


@dataclass
class _Queue:
    """Pairs of ``[rows, elements]`` blocks (the measured run's compared rows, the
    reference run's) waiting in groups; flushed when they hold ``budget`` bytes, and
    before the host fetches. Neither block of a pair may change until then: ``b`` is a
    copy of the measured run's rows; ``r`` the reference run's rows (never written once
    recorded) or a copy of them."""

    host: Host
    budget: int = _MIN_BUDGET  # bytes held before a flush
    _groups: defaultdict[tuple[Any, ...], _Pairs] = field(
        default_factory=lambda: defaultdict(list))
    _bytes: int = 0

    def __post_init__(self) -> None:
        self.host.before_fetch(self.flush)

    def _add(self, key: tuple[Any, ...], b: torch.Tensor, r: torch.Tensor) -> Deferred:
        place = self.host.reserve()
        self._groups[key].append((place, b, r))
        self._bytes += 2 * b.numel() * b.element_size()
        if self._bytes > self.budget:
            self.flush()
        return place

    def flush(self) -> None:
        """Measures every queued pair and hands the fields to the host."""
        for key, pairs in self._groups.items():
            self._measure(key, pairs)
        self._groups.clear()
        self._bytes = 0

    def _measure(self, key: tuple[Any, ...], pairs: _Pairs) -> None:
        raise NotImplementedError


class StatsQueue(_Queue):
    """Small CPU sites, measured by one ``block_stats`` per dtype, tolerance and row width
    (in parts of whole sites; float64 rows taken again at their scale where their squares
    leave float64's range, :mod:`~divtrace.measure.scale`)."""

    def takes(self, device: torch.device, width: int, single: int,
              widest: int = QUEUE_WIDTH) -> bool:
        """Whether a pair of rows of ``width`` elements on ``device`` is one to queue: a
        CPU block of rows of at most ``widest`` elements that the per-site path would
        measure in one piece (rows of at most ``single`` elements)."""
        return device.type == "cpu" and 0 < width <= min(widest, single)

    def add(self, b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> Deferred:
        """Queues the pair (see :class:`_Queue`)."""
        # bit-identical sites apart: their block takes block_stats' one-pass path, as
        # each of them alone would (and the others the full one, as alone)
        same = b.dtype != torch.complex32 and torch.equal(b, r)
        return self._add((b.dtype, rtol, atol, b.shape[1], same), b, r)

    def _measure(self, key: tuple[Any, ...], pairs: _Pairs) -> None:
        dtype, rtol, atol, width, _same = key
        for part in _parts(pairs, width):
            measured = torch.cat([b for _, b, _ in part])
            reference = torch.cat([r for _, _, r in part])
            fields = block_stats(measured, reference, rtol, atol)
            # float64: rows beyond the squares' range measured again at their scale (row
            # by row, as alone), then each such site's rows brought to one scale
            scaled = dtype in WIDE and bool((fields := rescaled(
                fields, measured, reference,
                partial(block_stats, rtol=rtol, atol=atol)))[:, SCALE].any())
            at = 0
            for place, b, _ in part:
                rows = (at, at + b.shape[0])
                if scaled:
                    self.host.put(place, common(fields[rows[0]:rows[1]]))
                else:
                    self.host.put(place, fields, rows)
                at += b.shape[0]


def _parts(pairs: _Pairs, width: int) -> list[_Pairs]:
    """The pairs of a group in runs of whole sites of at most :data:`_FLUSH_ELEMENTS`
    elements (one site alone when wider): blocks that stay in the CPU's caches (ResNet18's
    flush, 16 × 3×64×64, samples [0, 1]: 10.1 ms in one block per group, 7.7 ms in these).
    Rows are measured along themselves alone, so the parts give the figures of the whole
    group; a part holds whole sites, so a part of differing sites is not bit-identical as
    a whole."""
    parts: list[_Pairs] = []
    rows = 0
    for pair in pairs:
        if parts and (rows + pair[1].shape[0]) * width <= _FLUSH_ELEMENTS:
            parts[-1].append(pair)
            rows += pair[1].shape[0]
        else:
            parts.append([pair])
            rows = pair[1].shape[0]
    return parts


class FusedQueue(_Queue):
    """Small CUDA sites, measured with one launch of the fused kernel per device, dtype
    and tolerance (:func:`~divtrace.measure.fused.fused_many`): each site's fields exactly
    those :func:`~divtrace.measure.fused.fused_stats` gives it alone."""

    @staticmethod
    def takes(rows: torch.Tensor) -> bool:
        """Whether a site whose compared rows are like ``rows`` is one to queue."""
        width = rows.numel() // max(rows.shape[0], 1)
        return width > 1 and rows.numel() <= FUSED_ELEMENTS and fused.supports(rows)

    def add(self, b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> Deferred:
        """Queues the pair (see :class:`_Queue`)."""
        return self._add((b.device, b.dtype, rtol, atol), b, r)

    def _measure(self, key: tuple[Any, ...], pairs: _Pairs) -> None:
        _device, _dtype, rtol, atol = key
        found = fused.fused_many_placed([(b, r) for _, b, r in pairs], rtol, atol)
        for (place, _, _), (fields, rows) in zip(pairs, found, strict=True):
            self.host.put(place, fields, rows)
