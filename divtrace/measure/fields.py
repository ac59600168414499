"""The registry of per-sample fields: what the measured run accumulates at every site.

A site's statistics are one ``[samples, len(FIELDS)]`` float64 tensor, in the order of
:data:`FIELDS`. Each field says how blocks of the same rows combine (``sum`` or ``max``)
and how it is computed from a :class:`~divtrace.measure.block.Block`; the table's
figures (:mod:`~divtrace.measure.figures`) are made from these fields, and the fused CUDA
kernel (:mod:`~divtrace.measure.fused`) writes them at the positions given here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from divtrace.measure.block import (
    F64,
    INT_VIEW,
    Block,
    count_above,
    max_ulp,
    nonzero_count,
    norm_square,
    true_count,
)

__all__ = ["FIELDS", "INDEX", "MAX_FIELDS", "Field"]

Compute = Callable[[Block], torch.Tensor]


@dataclass(frozen=True)
class Field:
    """One per-sample accumulator.

    Attributes:
        name: Its name (the statistics' column).
        reduce: How the values of column blocks of the same rows combine.
        compute: Per row, from a floating block of both runs.
        same: Per row, when both blocks are bit-identical (None: zero).
        exact: Per row, for integer and bool blocks (None: NaN, not measured).
        doc: What it counts.
    """

    name: str
    reduce: Literal["sum", "max"]
    compute: Compute
    same: Compute | None = None
    exact: Compute | None = None
    doc: str = ""


def _mismatch(block: Block) -> torch.Tensor:
    count = nonzero_count(block.absdiff)  # b - r == 0 iff b == r
    if block.odd:  # non-finite pairs: inf == inf matches, NaN vs NaN matches too
        both_nan = block.b.isnan() & block.r.isnan()
        count += true_count(block.differ & ~both_nan)
    return count


def _exceed(block: Block) -> torch.Tensor:
    if block.host and not block.odd and float(block.max_abs.max()) <= block.atol:
        return torch.zeros_like(block.max_abs)
    # as torch.isclose: |b - r| <= atol + rtol * |r|
    limit = block.rf.abs().mul_(block.rtol).add_(block.atol)
    count = count_above(block.absdiff, limit)
    if block.odd:  # a non-finite pair that is not equal is never close
        count += true_count(block.differ)
    return count


def _unscaled(block: Block) -> torch.Tensor:
    return torch.zeros(block.b.shape[0], dtype=F64, device=block.b.device)


def _unequal(block: Block) -> torch.Tensor:
    return true_count(block.b != block.r)


def _nonfinite_same(block: Block) -> torch.Tensor:
    if block.all_finite:
        return torch.zeros_like(block.square)
    return true_count(block.r.isfinite().logical_not())  # infinities


def _max_ulp(block: Block) -> torch.Tensor:
    b, r, finite = block.b, block.r, block.finite if block.odd else None
    if b.is_complex():  # each part on its own; the larger distance counts
        b, r = torch.view_as_real(b).flatten(1), torch.view_as_real(r).flatten(1)
        finite = None if finite is None else finite.repeat_interleave(2, dim=1)
    if b.dtype not in INT_VIEW:  # float8 and other formats: no ULP
        return torch.full_like(block.max_abs, math.nan)
    return max_ulp(b, r, finite, block.host)


#: The fields, in the order of the statistics' columns.
FIELDS: tuple[Field, ...] = (
    Field("mismatch", "sum", _mismatch, exact=_unequal,
          doc="elements not bit-identical (+0.0 vs -0.0 and NaN vs NaN excepted)"),
    Field("nonfinite", "sum", lambda b: b.nonfinite, _nonfinite_same,
          lambda b: torch.zeros(b.b.shape[0], dtype=F64, device=b.b.device),
          doc="elements that are NaN or infinite in either run"),
    Field("exceed", "sum", _exceed, exact=_unequal,
          doc="elements beyond rtol/atol, as torch.testing.assert_close judges them"),
    Field("max_abs", "max", lambda b: b.max_abs, doc="max |batched - split| over finite pairs"),
    Field("sum_abs", "sum", lambda b: b.absdiff64.sum(1),
          doc="sum |batched - split| over finite pairs"),
    Field("sq_diff", "sum", lambda b: norm_square(b.absdiff64),
          doc="sum (batched - split)^2 over finite pairs"),
    Field("sq_ref", "sum", lambda b: norm_square(b.finite_r), lambda b: b.square,
          doc="sum split^2 over finite pairs"),
    Field("sq_out", "sum", lambda b: norm_square(b.finite_b), lambda b: b.square,
          doc="sum batched^2 over finite pairs"),
    # No figure reads `dot` (cosine comes from the norms); it stays because without it the
    # CUDA kernel's other sums compile to another order (rel_l2 moved in its 8th digit).
    Field("dot", "sum", lambda b: torch.linalg.vecdot(b.finite_b, b.finite_r, dim=1).real.to(F64),
          lambda b: b.square, doc="sum batched * split over finite pairs (real part)"),
    Field("max_ulp", "max", _max_ulp,
          doc="max distance in units in the last place, in the tensor's own dtype"),
    Field("scale", "max", _unscaled, exact=_unscaled,
          doc="e: the four sums of squares and products are those of the values times "
              "2**-e (float64 values beyond about 2**±400; see measure.scale)"),
)

#: The column of each field.
INDEX: dict[str, int] = {f.name: i for i, f in enumerate(FIELDS)}
#: The columns that combine by maximum.
MAX_FIELDS: tuple[int, ...] = tuple(i for i, f in enumerate(FIELDS) if f.reduce == "max")
