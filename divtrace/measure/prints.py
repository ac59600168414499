"""Fingerprints: one 64-bit number per row that changes when any element of the row does.

The independence test asks one yes-or-no question per site — did the compared rows stay
bit-identical when only the other samples changed? — and keeping the rows to answer it
would cost as much memory as the split run's stored rows. A fingerprint answers it with
eight bytes per row: the sum, modulo 2**64, of each element's bits (as an integer) times
a weight of its position. Every weight is odd, so a change of one element always changes
the sum (an odd number is invertible modulo 2**64); changes of several elements cancel
only by a coincidence of the hashed weights. Integer sums modulo 2**64 do not depend on
the order of addition, so a fingerprint is the same whatever the blocks it was summed in.

Values that compare equal count as equal: ``-0.0`` and ``+0.0`` have one fingerprint, and
so does every NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Fingerprints"]

#: The weights repeat their pattern every this many positions, each repetition times
#: another odd number (see :meth:`Fingerprints._weights`).
_PERIOD = 1 << 16
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


@dataclass
class Fingerprints:
    """Computes fingerprints of rows (holds each device's table of weights)."""

    _tables: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def of(self, rows: torch.Tensor, width: int = 1 << 18) -> torch.Tensor:
        """``[k, ...]`` rows → ``[k]`` int64 fingerprints, on the rows' device; ``width``:
        the most elements one step of the sum takes at once (its temporaries are about
        30 bytes per element)."""
        k = rows.shape[0]
        if not k:
            return torch.zeros(0, dtype=torch.int64, device=rows.device)
        flat = rows.reshape(k, -1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(k, -1)  # its two parts
        if flat.dtype.is_floating_point and flat.element_size() == 1:
            flat = flat.float()  # float8: exact, and gives its values the operations below
        n = flat.shape[1]
        total = torch.zeros(k, dtype=torch.int64, device=rows.device)
        if not n:
            return total
        step = max(_PERIOD, width // k // _PERIOD * _PERIOD)
        for lo in range(0, n, step):
            block = self._bits(flat[:, lo:min(n, lo + step)])
            total += (block * self._weights(lo, block.shape[1], rows.device)).sum(1)
        return total

    @staticmethod
    def _bits(block: torch.Tensor) -> torch.Tensor:
        """The elements' bits as 64-bit integers, equal values alike (floats: every zero
        as +0.0, every NaN as one NaN)."""
        if block.dtype.is_floating_point:
            block = torch.where(block == 0, 0.0, block)
            block.masked_fill_(block.isnan(), float("nan"))
        elif block.dtype == torch.bool:
            block = block.to(torch.uint8)
        return block.contiguous().view(_INT[block.element_size()]).to(torch.int64)

    def _weights(self, lo: int, n: int, device: torch.device) -> torch.Tensor:
        """Weights of positions ``lo .. lo+n``: a hashed table of ``_PERIOD`` odd weights,
        each repetition of it times its own odd number (``lo``: a multiple of the period)."""
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = _mix(
                torch.arange(_PERIOD, dtype=torch.int64, device=device))
        periods = -(-n // _PERIOD)
        first = lo // _PERIOD
        odd = _mix(torch.arange(first, first + periods, dtype=torch.int64, device=device)
                   + (1 << 40))
        return (table.expand(periods, _PERIOD) * odd[:, None]).reshape(-1)[:n]
