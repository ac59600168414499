"""Fingerprints: one 64-bit number per row that changes when any bit of the row does.

The independence test asks one yes-or-no question per site — did the compared rows stay
bit-identical when only the other samples changed? — and keeping the rows to answer it
would cost as much memory as the split run's stored rows. A fingerprint answers it with
eight bytes per row: the row's bytes read as 64-bit words, each word times a weight of its
position, summed modulo 2**64. Every weight is odd, so a change of one word always changes
the sum (an odd number is invertible modulo 2**64); changes of several words cancel only
by a coincidence of the hashed weights. Integer sums modulo 2**64 do not depend on the
order of addition, so a fingerprint is the same whatever the blocks it was summed in.

Fingerprints compare bits: ``-0.0`` and ``+0.0`` (or two NaNs) differ. A caller that
counts equal values as equal confirms a difference by comparing the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.measure import fused, printkernels

__all__ = ["Fingerprints"]

#: The weights repeat their pattern every this many words, each repetition's sum times
#: another odd number.
_PERIOD = 1 << 15
#: Rows of more words than this get their fingerprints without a weight per word.
_LONG_ROWS = 1 << 22
#: Off CUDA, blocks of at most this many words whose rows are alike in length are summed
#: together (one copy of them saves operations; a longer block is summed by itself).
_SHORT = 1 << 14


def _signed(value: int) -> int:
    """A 64-bit constant as the signed integer torch stores."""
    return value - (1 << 64) if value >= 1 << 63 else value


_K1, _K2, _K3 = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9),
                 _signed(0x94D049BB133111EB))


def _mix(i: torch.Tensor) -> torch.Tensor:
    """An odd 64-bit hash of each position (splitmix64's mixing; wrapping arithmetic)."""
    x = i * _K1 + _K2
    x = (x ^ (x >> 30)) * _K3
    x = (x ^ (x >> 27)) * _K2
    return (x ^ (x >> 31)) | 1


def _words(flat: torch.Tensor) -> torch.Tensor:
    """``[k, n]`` rows as ``[k, words]`` int64 words (zero bytes after a row whose length
    in bytes is not a multiple of eight; a copy where the rows do not start on a word)."""
    if not flat.is_contiguous():
        flat = flat.contiguous()
    data = flat.view(torch.uint8)
    size = data.shape[1]
    if size % 8 == 0 and data.storage_offset() % 8 == 0:
        return data.view(torch.int64)
    padded = torch.zeros(flat.shape[0], -(-size // 8) * 8, dtype=torch.uint8,
                         device=flat.device)
    padded[:, :size] = data
    return padded.view(torch.int64)


def _rows_at(block: torch.Tensor, held: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each row of a ``[k, ...]`` block as (the address of its words, their count): where
    it lies when the block is contiguous and its rows are whole words starting on a word,
    else in a copy by :func:`_words`, kept in ``held`` (empty rows: no words)."""
    k = block.shape[0]
    if not block.numel():
        return [(0, 0)] * k
    size = block.numel() // k * block.element_size()  # bytes a row
    if size % 8 == 0 and block.data_ptr() % 8 == 0 and block.is_contiguous():
        start = block.data_ptr()
        return [(start + i * size, size // 8) for i in range(k)]
    words = _words(block.reshape(k, -1))
    held.append(words)
    start, step = words.data_ptr(), words.stride(0) * 8
    return [(start + i * step, words.shape[1]) for i in range(k)]


def _dot(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row of ``words`` times ``weights``, summed along the row: on the CPU one
    matrix product (no temporary of the words' size; int64 products wrap modulo 2**64, so
    no order of addition changes the sum), elsewhere a product and a sum (CUDA has no
    int64 matrix product)."""
    if words.device.type == "cpu":
        return words @ weights
    return (words * weights).sum(-1)


def _period_sums(block: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[k, m]`` words (``m`` a multiple of the period) → ``[k, m // period]``: each
    period's words times ``table``, summed. Each product is of two dimensions: torch
    takes one of three over a block cut from longer rows to a batched product, some forty
    times slower on the CPU for int64 (2 rows of 65,536 words: 5.7 ms against 0.15)."""
    k = block.shape[0]
    if block.is_contiguous():
        return _dot(block.reshape(-1, _PERIOD), table).reshape(k, -1)
    return torch.stack([_dot(row.view(-1, _PERIOD), table) for row in block])


@dataclass
class Fingerprints:
    """Computes fingerprints of rows (holds each device's table of weights)."""

    _tables: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    _long: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def of(self, rows: torch.Tensor, width: int = 1 << 18) -> torch.Tensor:
        """``[k, ...]`` rows → ``[k]`` int64 fingerprints, on the rows' device; ``width``:
        off the CPU, about the most words one step of the sum takes at once (its temporary
        holds eight bytes per word). On the CPU the sum is one matrix product with the
        held weights (no temporary, whatever the rows), except for rows of more than
        ``_LONG_ROWS`` words."""
        k = rows.shape[0]
        total = torch.zeros(k, dtype=torch.int64, device=rows.device)
        if not k or not rows.numel():
            return total
        words = _words(rows.reshape(k, -1))
        if words.is_cuda and fused.AVAILABLE:  # one kernel, no temporaries
            return printkernels.fused_prints(words, _PERIOD)
        n = words.shape[1]
        if n <= _LONG_ROWS and (words.device.type == "cpu" or k * n <= width):
            return _dot(words, self._weights(rows.device, n)[:n])  # one product summed
        step = max(_PERIOD, width // k // _PERIOD * _PERIOD)
        table = self._table(rows.device)
        for lo in range(0, n, step):
            block = words[:, lo:lo + step]
            m = block.shape[1]
            full = m // _PERIOD * _PERIOD
            sums = []
            if full:
                sums.append(_period_sums(block[:, :full], table))
            if m > full:
                sums.append(_dot(block[:, full:], table[:m - full]).unsqueeze(1))
            first = lo // _PERIOD
            odd = _mix(torch.arange(first, first - (-m // _PERIOD), dtype=torch.int64,
                                    device=rows.device) + (1 << 40))
            total += _dot(torch.cat(sums, 1), odd)
        return total

    def of_many(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The fingerprints of the rows of several ``[k, ...]`` blocks, one after the
        other, as :meth:`of` gives them block by block (sums modulo 2**64 do not depend on
        the grouping): on CUDA one kernel for every row; elsewhere the words of the blocks
        whose rows are alike in length, times the weights of their positions, summed along
        the rows (a few operations per length of row)."""
        device = blocks[0].device
        if printkernels.takes(device):
            held: list[torch.Tensor] = []  # copies, alive until the launch is queued
            return printkernels.prints_at([r for b in blocks for r in _rows_at(b, held)],
                                          device, _PERIOD)
        found: list[torch.Tensor | None] = [None] * len(blocks)
        alike: dict[int, list[int]] = {}  # blocks by the words of their rows
        for i, b in enumerate(blocks):
            width = -(-b.numel() // max(b.shape[0], 1) * b.element_size() // 8)  # words
            if not b.numel() or width > _LONG_ROWS:  # (of: without a weight per word)
                found[i] = self.of(b)
            else:  # short blocks of one length together (long ones: a copy costs more)
                alike.setdefault(width if b.shape[0] * width <= _SHORT else -i - 1,
                                 []).append(i)
        for members in alike.values():  # one product summed per row width
            words = [_words(blocks[i].reshape(blocks[i].shape[0], -1)) for i in members]
            width = words[0].shape[1]
            sums = _dot(words[0] if len(words) == 1 else torch.cat(words),
                        self._weights(device, width)[:width])
            for i, part in zip(members, sums.split([w.shape[0] for w in words]), strict=True):
                found[i] = part
        return torch.cat([f for f in found if f is not None])

    def _weights(self, device: torch.device, n: int) -> torch.Tensor:
        """The weight of each of the first ``n`` word positions of a row (at least):
        position ``j``'s table entry times its repetition's odd number, as :meth:`of`
        applies them."""
        held = self._long.get(device)
        if held is None or len(held) < n:
            size = max(n, 2 * len(held) if held is not None else _PERIOD)
            periods = -(-size // _PERIOD)
            odd = _mix(torch.arange(periods, dtype=torch.int64, device=device) + (1 << 40))
            held = self._long[device] = (self._table(device).repeat(periods)
                                         * odd.repeat_interleave(_PERIOD))
        return held

    def _table(self, device: torch.device) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = _mix(
                torch.arange(_PERIOD, dtype=torch.int64, device=device))
        return table
