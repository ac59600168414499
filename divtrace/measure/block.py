"""A block of the two runs' rows at one site, with the temporaries its fields share."""

from __future__ import annotations

import math
from functools import cached_property

import torch

__all__ = ["INT_VIEW", "Block", "bit_equal", "count_above", "max_ulp", "nonzero_count",
           "norm_square", "true_count"]

F64 = torch.float64

#: The integer type of the same width as each float type with a ULP distance.
INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def max_ulp(b: torch.Tensor, r: torch.Tensor, finite: torch.Tensor | None,
            host: bool) -> torch.Tensor:
    """Per-row max ULP distance of finite pairs (``finite=None``: all pairs are finite)."""
    view = INT_VIEW[b.dtype]
    bits_b, bits_r = b.view(view), r.view(view)
    if view == torch.int16:  # room for the difference
        bits_b, bits_r = bits_b.int(), bits_r.int()
    # same sign: the distance is the difference of the bit patterns (no overflow)
    dist = (bits_b - bits_r).abs_()
    signs = bits_b ^ bits_r  # negative where the signs differ
    if host:  # opposite signs are few: those pairs alone, not a float64 copy of all
        if finite is not None:
            dist.masked_fill_(~finite, 0)
        if not (signs.numel() and bool(signs.amin() < 0)):
            return dist.amax(1).double()
        crossing = signs < 0
        if finite is not None:
            crossing &= finite
        rows, cols = crossing.nonzero(as_tuple=True)
        top = dist.masked_fill_(crossing, 0).amax(1).double()
        return top.scatter_reduce_(0, rows, _across(bits_b[rows, cols], bits_r[rows, cols],
                                                    view), "amax")
    crossing = signs < 0  # opposite signs: |b| and |r| steps to zero, added
    dist = torch.where(crossing, _across(bits_b, bits_r, view), dist.double())
    if finite is not None:
        dist.masked_fill_(~finite, 0)
    return dist.amax(1)


def _across(bits_b: torch.Tensor, bits_r: torch.Tensor, view: torch.dtype) -> torch.Tensor:
    """The distance between values of opposite signs: the steps of each to zero, added
    (in float64: they may not fit the bits' own integer type)."""
    magnitude = torch.iinfo(view).max
    return (bits_b & magnitude).double() + (bits_r & magnitude).double()


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (any dtype)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


#: Dtypes that torch.linalg.vector_norm takes as they are (others are upcast first).
_NORMED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                     torch.complex64, torch.complex128})


def true_count(mask: torch.Tensor) -> torch.Tensor:
    """Per row: the True elements of a boolean mask, in float64 (exact: counted as
    integers, without casting the whole mask to float64 first)."""
    return mask.sum(1).to(F64)


#: Below this many elements in a row, a float32 sum of zeros and ones is an exact count.
_EXACT_F32 = 1 << 24


def count_above(values: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """Per row: the elements of ``values`` above ``limits`` (a temporary of floating
    values, overwritten), in float64. Counted as a sum of ones and zeros in ``limits``
    itself where that sum is exact (a count as integers would first copy the mask to
    64-bit integers: on the CPU that copy cost more than the rest of the count)."""
    if values.shape[1] < _EXACT_F32 and limits.dtype in (torch.float32, F64):
        return limits.lt_(values).sum(1).to(F64)
    return true_count(values > limits)


def nonzero_count(magnitudes: torch.Tensor) -> torch.Tensor:
    """Per row: the nonzero elements of a tensor of magnitudes (no NaN, none negative), in
    float64. Counted as a float32 sum of their signs where that is exact (a third of
    ``count_nonzero``'s time on the CPU), else as integers."""
    if magnitudes.shape[1] < _EXACT_F32 and magnitudes.dtype == torch.float32:
        return magnitudes.sign().sum(1).to(F64)
    return torch.count_nonzero(magnitudes, dim=1).to(F64)


def norm_square(t: torch.Tensor) -> torch.Tensor:
    """Per row: the sum of squared magnitudes, in float64."""
    dtype = torch.complex128 if t.is_complex() else F64
    return torch.linalg.vector_norm(t, dim=1, dtype=dtype).square()


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are taken in: float64 (complex128) as is, else float32 (complex64)."""
    if dtype.is_complex:
        return torch.complex128 if dtype == torch.complex128 else torch.complex64
    return F64 if dtype == F64 else torch.float32


class Block:
    """``[rows, elements]`` of the batched run (``b``) and the reference run (``r``).

    The temporaries are made on first use and shared by every field that needs them. On
    the CPU there is no device to keep busy, so shortcuts that branch on values are free
    (``host``); on an accelerator every branch would be a host synchronisation, so none.
    Complex elements count as one element each: their difference is the modulus.
    """

    def __init__(self, b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> None:
        self.b, self.r, self.rtol, self.atol = b, r, rtol, atol
        self.host = b.device.type == "cpu"
        self._row_max: torch.Tensor | None = None  # per row max |b - r|, all finite

    @cached_property
    def bf(self) -> torch.Tensor:
        """``b`` in the accumulation dtype."""
        return self.b.to(_accumulation(self.b.dtype))

    @cached_property
    def rf(self) -> torch.Tensor:
        """``r`` in the accumulation dtype."""
        return self.r.to(_accumulation(self.b.dtype))

    @cached_property
    def _diff(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool]:
        difference = self.bf - self.rf
        absdiff = difference.abs() if difference.is_complex() else difference.abs_()
        if self.host and absdiff.numel():
            row_max = absdiff.amax(1)
            if bool(row_max.amax() < math.inf):
                # every pair finite (a maximum is NaN or inf otherwise): no mask to make
                # or count, and the rows' maxima are max_abs
                self._row_max = row_max
                return absdiff, None, torch.zeros(absdiff.shape[0], dtype=F64), False
        # false where either run is NaN or infinite (as isfinite on a magnitude, in one op)
        finite = absdiff < math.inf
        nonfinite = (absdiff.shape[1] - finite.sum(1)).to(F64)
        odd = not self.host or bool(nonfinite.any())
        if odd:
            absdiff.masked_fill_(~finite, 0)
        return absdiff, finite, nonfinite, odd

    @property
    def absdiff(self) -> torch.Tensor:
        """|b - r| where both are finite, else 0."""
        return self._diff[0]

    @cached_property
    def absdiff64(self) -> torch.Tensor:
        """``absdiff`` in float64, made once for the sums that read it (each sum in
        float64 would otherwise copy it so by itself first)."""
        return self.absdiff.to(F64)

    @property
    def finite(self) -> torch.Tensor:
        """Where both runs are finite."""
        finite = self._diff[1]
        return torch.ones_like(self.absdiff, dtype=torch.bool) if finite is None else finite

    @property
    def nonfinite(self) -> torch.Tensor:
        """Per row: elements that are NaN or infinite in either run."""
        return self._diff[2]

    @property
    def odd(self) -> bool:
        """Whether non-finite pairs may be present (always True off the host)."""
        return self._diff[3]

    @cached_property
    def finite_b(self) -> torch.Tensor:
        """``bf`` where both runs are finite, else 0 (for norms and products)."""
        return self.bf.masked_fill(~self.finite, 0) if self.odd else self.bf

    @cached_property
    def finite_r(self) -> torch.Tensor:
        """``rf`` where both runs are finite, else 0."""
        return self.rf.masked_fill(~self.finite, 0) if self.odd else self.rf

    @cached_property
    def differ(self) -> torch.Tensor:
        """Non-finite pairs that are not equal (NaN never equals anything)."""
        return (self.b != self.r) & ~self.finite

    @cached_property
    def max_abs(self) -> torch.Tensor:
        absdiff = self.absdiff  # (made first: it may find the rows' maxima)
        row_max = self._row_max
        return (absdiff.amax(1) if row_max is None else row_max).to(F64)

    @cached_property
    def _same(self) -> tuple[torch.Tensor, bool]:
        r = self.r if self.r.dtype in _NORMED else self.rf  # float8: no norm of its own
        square = norm_square(r)
        if bool(square.isfinite().all()):  # the shortcut runs on the host only
            return square, True
        return norm_square(r.masked_fill(~r.isfinite(), 0)), False

    @property
    def square(self) -> torch.Tensor:
        """Per row: ‖r‖² over its finite elements, for two bit-identical blocks."""
        return self._same[0]

    @property
    def all_finite(self) -> bool:
        """For two bit-identical blocks: whether every element is finite."""
        return self._same[1]
