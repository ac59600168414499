"""Divergence metrics between the batched and split rows of one site.

Everything here works on device tensors and never synchronises with the host: the
statistics of a site are one small ``[samples, len(FIELDS)]`` float64 tensor, brought to
the host once, at the end of the run, by :func:`summarise`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.testing._comparison import default_tolerances

__all__ = [
    "FIELDS",
    "block_stats",
    "blocks",
    "combine",
    "lower_precision",
    "mixed_stats",
    "site_figures",
    "tolerances",
    "ulp_ordered",
]

#: Per-sample statistics, in column order. Counts and sums add across blocks; the
#: ``max_*`` fields take the maximum.
FIELDS = (
    "mismatch",  # elements not bit-identical (+0.0 vs -0.0 and NaN vs NaN excepted)
    "nonfinite",  # elements that are NaN or infinite in either run
    "exceed",  # elements beyond rtol/atol, as torch.testing.assert_close judges them
    "max_abs",  # max |batched - split| over finite pairs
    "sum_abs",  # sum |batched - split| over finite pairs
    "sq_diff",  # sum (batched - split)^2 over finite pairs
    "sq_ref",  # sum split^2
    "sq_out",  # sum batched^2
    "dot",  # sum batched * split
    "max_ulp",  # max distance in units in the last place, in the tensor's own dtype
)
_COL = {name: i for i, name in enumerate(FIELDS)}
_MAX_FIELDS = [_COL["max_abs"], _COL["max_ulp"]]

_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def tolerances(
    dtype: torch.dtype, rtol: float | None, atol: float | None
) -> tuple[float, float]:
    """``(rtol, atol)``: the given values, else ``torch.testing.assert_close``'s defaults."""
    if rtol is not None and atol is not None:
        return rtol, atol
    default_rtol, default_atol = default_tolerances(dtype)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def ulp_ordered(t: torch.Tensor) -> torch.Tensor:
    """Maps floats to int64 so that adjacent floats differ by 1 and -0.0 equals +0.0."""
    view = _INT_VIEW[t.dtype]
    bits = t.view(view).to(torch.int64)
    lowest = -(2 ** (torch.iinfo(view).bits - 1))
    return torch.where(bits < 0, lowest - bits, bits)


def _max_ulp(b: torch.Tensor, r: torch.Tensor, finite: torch.Tensor | None,
             host: bool) -> torch.Tensor:
    """Per-row max ULP distance of finite pairs (``finite=None``: all pairs are finite)."""
    view = _INT_VIEW[b.dtype]
    bits_b, bits_r = b.view(view), r.view(view)
    if view == torch.int16:  # room for the difference
        bits_b, bits_r = bits_b.int(), bits_r.int()
    # same sign: the distance is the difference of the bit patterns (no overflow)
    dist = (bits_b - bits_r).abs_()
    crossing = (bits_b ^ bits_r) < 0  # opposite signs: |b| and |r| steps to zero, added
    if not host or bool(crossing.any()):
        magnitude = torch.iinfo(view).max
        across = (bits_b & magnitude).double() + (bits_r & magnitude).double()
        dist = torch.where(crossing, across, dist.double())
    if finite is not None:
        dist = dist.masked_fill(~finite, 0)
    return dist.amax(1).double()


def _identical_stats(r: torch.Tensor) -> torch.Tensor:
    """Statistics of two bit-identical blocks (no NaN; the split block ``r`` for both)."""
    rows = r.shape[0]
    f64 = torch.float64
    square = torch.linalg.vector_norm(r, dim=1, dtype=f64).square()
    out = torch.zeros((rows, len(FIELDS)), dtype=f64)
    out[:, _COL["sq_ref"]] = out[:, _COL["sq_out"]] = out[:, _COL["dot"]] = square
    if not bool(square.isfinite().all()):  # infinities (or an overflowing sum)
        out[:, _COL["nonfinite"]] = r.isinf().sum(1, dtype=f64)
    return out


def _float_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    # On the CPU there is no device to keep busy, so shortcuts that branch on values are
    # free; on an accelerator every branch would be a host synchronisation, so none.
    host = b.device.type == "cpu"
    if host and torch.equal(b, r):
        return _identical_stats(r)
    f64 = torch.float64
    acc = f64 if b.dtype == f64 else torch.float32
    bf, rf = b.to(acc), r.to(acc)
    absdiff = (bf - rf).abs_()
    finite = absdiff.isfinite()  # false where either run is NaN or infinite
    nonfinite = finite.logical_not().sum(1, dtype=f64)
    odd = not host or bool(nonfinite.any())
    if odd:
        absdiff.masked_fill_(~finite, 0)
    max_abs = absdiff.amax(1).to(f64)
    mismatch = torch.count_nonzero(absdiff, dim=1).to(f64)  # b - r == 0 iff b == r
    if host and not odd and float(max_abs.max()) <= atol:
        exceed = torch.zeros_like(max_abs)
    else:  # as torch.isclose: |b - r| <= atol + rtol * |r|
        exceed = (absdiff > rf.abs().mul_(rtol).add_(atol)).sum(1, dtype=f64)
    if odd:  # non-finite pairs: inf == inf matches, NaN vs NaN matches but is never close
        differ = (b != r) & ~finite
        both_nan = b.isnan() & r.isnan()
        mismatch += (differ & ~both_nan).sum(1, dtype=f64)
        exceed += differ.sum(1, dtype=f64)
    cols = [
        mismatch,
        nonfinite,
        exceed,
        max_abs,
        absdiff.sum(1, dtype=f64),
        torch.linalg.vector_norm(absdiff, dim=1, dtype=f64).square(),
        torch.linalg.vector_norm(rf, dim=1, dtype=f64).square(),
        torch.linalg.vector_norm(bf, dim=1, dtype=f64).square(),
        torch.linalg.vecdot(bf, rf, dim=1).to(f64),
        _max_ulp(b, r, finite if odd else None, host) if b.dtype in _INT_VIEW
        else torch.full_like(max_abs, math.nan),  # float8 and other formats: no ULP
    ]
    return torch.stack(cols, dim=1)


def block_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Per-row statistics of two ``[rows, elements]`` blocks, as ``[rows, len(FIELDS)]``.

    Integer and bool tensors get the mismatch count only; their other fields are NaN.
    """
    if b.is_complex():
        b, r = torch.view_as_real(b).flatten(1), torch.view_as_real(r).flatten(1)
    if b.is_floating_point():
        return _float_stats(b, r, rtol, atol)
    out = torch.full((b.shape[0], len(FIELDS)), math.nan, dtype=torch.float64, device=b.device)
    out[:, 0] = (b != r).sum(1, dtype=torch.float64)
    out[:, 1] = 0
    out[:, 2] = out[:, 0]
    return out


def lower_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes (the one with the larger epsilon)."""
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def mixed_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Like :func:`block_stats` for two floating blocks of different dtypes: the errors in
    the more precise dtype, the ULP distance in the less precise one."""
    low = lower_precision(b.dtype, r.dtype)
    high = b.dtype if low == r.dtype else r.dtype
    out = block_stats(b.to(high), r.to(high), rtol, atol)
    b_low, r_low = b.to(low), r.to(low)
    if low in _INT_VIEW:
        finite = (b_low.to(high) - r_low.to(high)).isfinite()
        out[:, _COL["max_ulp"]] = _max_ulp(b_low, r_low, finite, b.device.type == "cpu")
    else:
        out[:, _COL["max_ulp"]] = math.nan
    return out


def combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Combines the statistics of column blocks of the same rows."""
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack(parts)
    total = stacked.sum(0)
    for field in _MAX_FIELDS:  # int indices: no index tensor to copy to the device
        total[:, field] = stacked[:, :, field].amax(0)
    return total


def blocks(rows: int, elements: int, budget: int) -> Iterator[tuple[int, int]]:
    """Column ranges that keep ``rows * width`` at or under ``budget`` elements."""
    width = max(1, budget // max(rows, 1))
    for start in range(0, elements, width):
        yield start, min(start + width, elements)


def site_figures(stats: np.ndarray, elements_per_sample: int) -> dict[str, float]:
    """The site-level figures of one site from its per-sample ``[S, len(FIELDS)]`` stats."""
    col = {name: stats[:, i] for i, name in enumerate(FIELDS)}
    numel = elements_per_sample * stats.shape[0]
    mismatch = col["mismatch"].sum()
    nonfinite = col["nonfinite"].sum()
    finite = numel - nonfinite
    diff_norm = math.sqrt(col["sq_diff"].sum())
    ref_norm = math.sqrt(col["sq_ref"].sum())
    out_norm = math.sqrt(col["sq_out"].sum())
    return {
        "numel": float(numel),
        "mismatch": mismatch / numel if numel else 0.0,
        "exceed": col["exceed"].sum() / numel if numel else 0.0,
        "max_abs": float(col["max_abs"].max()),
        "mean_abs": col["sum_abs"].sum() / finite if finite else math.nan,
        "rel_l2": rel_l2(diff_norm, ref_norm),
        "max_ulp": float(col["max_ulp"].max()),
        "cosine": 1.0 if mismatch == 0 else cosine(col["dot"].sum(), out_norm, ref_norm),
        "nonfinite": nonfinite,
    }


def rel_l2(diff_norm: float | np.ndarray, ref_norm: float | np.ndarray) -> np.ndarray | float:
    """‖batched − split‖ / ‖split‖: 0 when both are 0, inf when only the split is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.divide(diff_norm, ref_norm)
    ratio = np.where(np.asarray(diff_norm) == 0, 0.0, ratio)
    return float(ratio) if np.ndim(ratio) == 0 else ratio


def cosine(dot: float, out_norm: float, ref_norm: float) -> float:
    """Cosine similarity: 1 when both are zero, 0 when only one is."""
    if out_norm == 0 and ref_norm == 0:
        return 1.0
    if out_norm == 0 or ref_norm == 0:
        return 0.0
    return float(min(1.0, max(-1.0, dot / (out_norm * ref_norm))))
