"""Statistics of many small sites computed together: on the CPU, where each site's own
statistics would cost a few dozen tiny torch calls (:class:`StatsQueue`), and on CUDA,
where each would cost a kernel launched from Python (:class:`FusedQueue`; float64 sites,
taken again at their scale, :class:`WideQueue`).

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

from divtrace.devices import upload
from divtrace.measure import fused
from divtrace.measure.host import Deferred, Host
from divtrace.measure.scale import (
    SCALE,
    SUMS_AT,
    WIDE,
    common,
    common_many,
    exponents,
    finite_magnitudes,
    rescaled,
    within,
)
from divtrace.measure.stats import block_stats

__all__ = ["FUSED_ELEMENTS", "QUEUE_WIDTH", "FusedQueue", "StatsQueue", "WideQueue",
           "budget_for"]

#: Rows wider than this are measured at once, as before (their work is not overhead).
QUEUE_WIDTH = 1 << 14
#: Queued blocks are flushed when they hold ``share`` of the recorded rows' bytes, but
#: never less than this (memory stays a small part of what the reference run stores).
_MIN_BUDGET = 8 << 20
#: Elements of one block computed at a flush (whole sites; see :func:`_parts`), as many
#: as the per-site path's blocks.
_FLUSH_ELEMENTS = 1 << 18

#: Elements of one part of a float64 flush on CUDA (:class:`WideQueue`): its temporaries
#: are a few copies of a part (at most half the extra peak of parts of 2**20, measured in
#: docs/performance.md).
_WIDE_ELEMENTS = 1 << 18

#: On CUDA, sites of at most this many compared elements are queued (a copy of their
#: compared rows waits); wider ones are measured at once, in place (their launch is not
#: what they cost).
FUSED_ELEMENTS = 1 << 20

#: The alignment in bytes of the start of a block the CPU's allocator makes.
_ALIGNED = 64

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
    #: the only fields computed on the CPU (the others NaN; None: all of them)
    reads: frozenset[str] | None = None
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
        dtype, rtol, atol, _width, same = key
        for part in _parts(pairs):
            measured = _joined([b for _, b, _ in part])
            reference = _joined([r for _, _, r in part])
            # (every pair of a group was found bit-identical, or every pair not)
            fields = block_stats(measured, reference, rtol, atol, self.reads, same)
            # float64: rows beyond the squares' range measured again at their scale (row
            # by row, as alone), then each such site's rows brought to one scale
            scaled = dtype in WIDE and bool((fields := rescaled(
                fields, measured, reference,
                partial(block_stats, rtol=rtol, atol=atol, reads=self.reads)))[:, SCALE].any())
            at = 0
            for place, b, _ in part:
                rows = (at, at + b.shape[0])
                if scaled:
                    self.host.put(place, common(fields[rows[0]:rows[1]]))
                else:
                    self.host.put(place, fields, rows)
                at += b.shape[0]


def _joined(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Blocks one after the other in one tensor; a block alone as it is where it lies as
    a copy of it would (contiguous, its start aligned as the CPU's allocator aligns)."""
    if len(blocks) == 1 and blocks[0].is_contiguous() and (
            blocks[0].data_ptr() % _ALIGNED == 0):
        return blocks[0]
    return torch.cat(blocks)


def _parts(pairs: _Pairs, elements: int = _FLUSH_ELEMENTS) -> list[_Pairs]:
    """The pairs of a group in runs of whole sites of at most ``elements`` elements (one
    site alone when wider): blocks that stay in the CPU's caches (ResNet18's
    flush, 16 × 3×64×64, samples [0, 1]: 10.1 ms in one block per group, 7.7 ms in these).
    Rows are measured along themselves alone, so the parts give the figures of the whole
    group; a part holds whole sites, so a part of differing sites is not bit-identical as
    a whole."""
    parts: list[_Pairs] = []
    held = 0
    for pair in pairs:
        if parts and held + pair[1].numel() <= elements:
            parts[-1].append(pair)
            held += pair[1].numel()
        else:
            parts.append([pair])
            held = pair[1].numel()
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


class WideQueue(FusedQueue):
    """Small CUDA float64 sites, measured as :class:`FusedQueue`'s; where their fields do
    not show every row within the range (:func:`~divtrace.measure.scale.within`, one wait
    for the device a part), taken again at their scale (:mod:`~divtrace.measure.scale`)
    in a few launches for all of them: every row's largest finite magnitude in one
    segmented maximum over the queued rows end to end, their copies times ``2**-e`` in one
    product, the fused kernel once more, and each site's rows brought to one scale
    (:func:`~divtrace.measure.scale.common_many`). Each step is exact and row by row, so
    each site's fields are those the per-site path on a device gives it (a row within the
    range keeps its sums at ``2**0`` on either). Flushed in parts of whole sites of at
    most :data:`_WIDE_ELEMENTS` elements (the temporaries are a few copies of a part)."""

    def _measure(self, key: tuple[Any, ...], pairs: _Pairs) -> None:
        device, _dtype, rtol, atol = key
        for part in _parts(pairs, _WIDE_ELEMENTS):
            self._measure_part(part, device, rtol, atol)

    def _measure_part(self, pairs: _Pairs, device: torch.device, rtol: float, atol: float
                      ) -> None:
        shapes = [(b.shape[0], b.numel() // b.shape[0]) for _, b, _ in pairs]
        # copies of every pair end to end, each starting 16 bytes aligned (a zero after a
        # block of an odd count, counted in its last row): one kind of layout per width
        odd = [n * w % 2 for n, w in shapes]
        pad = torch.zeros(1, dtype=pairs[0][1].dtype, device=device)
        blocks = [(b, r) for _, b, r in pairs]
        flat_b, flat_r = (torch.cat([t for block, extra in zip(blocks, odd, strict=True)
                                     for t in (block[side].reshape(-1), pad)[:1 + extra]])
                          for side in (0, 1))
        views = _views(flat_b, flat_r, shapes, odd)
        launch = fused.ManyLaunch(views, rtol, atol)  # planned once, launched twice
        fields = launch.gathered()
        if within(fields):  # (one wait for the device) every row at 2**0: as they are
            self._put(pairs, shapes, fields)
            return
        # every row's length in the copies, then every site's count of rows: one upload
        counts = upload(torch.tensor([w + (extra and row == n - 1) for (n, w), extra in zip(
            shapes, odd, strict=True) for row in range(n)] + [n for n, _ in shapes]), device)
        lengths, rows = counts[:-len(shapes)], counts[-len(shapes):]
        top = torch.segment_reduce(torch.maximum(
            finite_magnitudes(flat_b), finite_magnitudes(flat_r)), "max", lengths=lengths,
            unsafe=True)  # (checking the lengths would wait for the device)
        e = exponents(top)
        factor = torch.ldexp(torch.ones_like(top), -e).repeat_interleave(
            lengths, output_size=flat_b.numel())
        flat_b.mul_(factor)  # (after the first launch has read them: stream order)
        flat_r.mul_(factor)
        del factor
        # (the views run along the copies: nothing was copied again, so the plan reads the
        # scaled values)
        fields[:, SUMS_AT] = launch.gathered()[:, SUMS_AT]
        fields[:, SCALE] = e.to(fields.dtype)
        self._put(pairs, shapes, common_many(fields, rows))

    def _put(self, pairs: _Pairs, shapes: list[tuple[int, int]], fields: torch.Tensor
             ) -> None:
        """Each pair's rows of ``fields`` (the pairs' rows end to end) to the host."""
        at = 0
        for (place, _, _), (n, _) in zip(pairs, shapes, strict=True):
            self.host.put(place, fields, (at, at + n))
            at += n


def _views(flat_b: torch.Tensor, flat_r: torch.Tensor, shapes: list[tuple[int, int]],
           odd: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs of ``shapes`` in two copies end to end (``odd``: a zero after the pair)."""
    views, at = [], 0
    for (n, w), extra in zip(shapes, odd, strict=True):
        views.append((flat_b[at:at + n * w].view(n, w), flat_r[at:at + n * w].view(n, w)))
        at += n * w + extra
    return views
