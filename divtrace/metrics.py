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
_MAX_FIELDS = [FIELDS.index("max_abs"), FIELDS.index("max_ulp")]

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


def _float_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    acc = torch.float64 if b.dtype == torch.float64 else torch.float32
    bf, rf = b.to(acc), r.to(acc)
    f64 = torch.float64
    diff = bf - rf
    finite = torch.isfinite(diff)  # false where either run is NaN or infinite
    differ = b != r
    unequal = differ & ~(b.isnan() & r.isnan())
    absdiff = diff.abs_().masked_fill_(~finite, 0)
    # as torch.isclose: |b - r| <= atol + rtol * |r|, inf == inf, NaN never close
    exceed = (absdiff > atol + rtol * rf.abs()) | (differ & ~finite)
    cols = [
        unequal.sum(1, dtype=f64),
        (~finite).sum(1, dtype=f64),
        exceed.sum(1, dtype=f64),
        absdiff.amax(1).to(f64),
        absdiff.sum(1, dtype=f64),
        absdiff.square().sum(1, dtype=f64),
        rf.square().sum(1, dtype=f64),
        bf.square().sum(1, dtype=f64),
        (bf * rf).sum(1, dtype=f64),
    ]
    if b.dtype in _INT_VIEW:
        ulp = ulp_ordered(b) - ulp_ordered(r)
        ulp = ulp.to(f64) if b.dtype == torch.float64 else ulp
        cols.append(ulp.abs_().masked_fill_(~finite, 0).amax(1).to(f64))
    else:  # float8 and other exotic formats: no ULP figure
        cols.append(torch.full_like(cols[0], math.nan))
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


def combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Combines the statistics of column blocks of the same rows."""
    if len(parts) == 1:
        return parts[0]
    stacked = torch.stack(parts)
    total = stacked.sum(0)
    total[:, _MAX_FIELDS] = stacked[:, :, _MAX_FIELDS].amax(0)
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
