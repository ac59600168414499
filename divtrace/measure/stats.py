"""Per-sample statistics of two blocks of rows, computed eagerly with torch ops.

Everything here works on device tensors and never synchronises with the host (off the
CPU): a site's statistics stay on its device until the table is assembled.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from divtrace.compat import default_tolerances
from divtrace.devices import upload
from divtrace.measure.block import F64, INT_VIEW, Block, max_ulp
from divtrace.measure.fields import FIELDS, INDEX, MAX_FIELDS

__all__ = ["block_stats", "blocks", "combine", "lower_precision", "mixed_stats",
           "reduce_blocks", "tolerances", "ulp_ordered"]


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
    view = INT_VIEW[t.dtype]
    bits = t.view(view).to(torch.int64)
    lowest = -(2 ** (torch.iinfo(view).bits - 1))
    return torch.where(bits < 0, lowest - bits, bits)


def lower_precision(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two floating dtypes (the one with the larger epsilon)."""
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def block_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float,
                reads: frozenset[str] | None = None, same: bool | None = None
                ) -> torch.Tensor:
    """Per-row statistics of two ``[rows, elements]`` blocks, as ``[rows, len(FIELDS)]``.

    Integer and bool tensors get the fields that have an ``exact`` rule (mismatch);
    the others are NaN. ``reads``: the only fields computed (the others NaN; None: all),
    each exactly as with all of them. ``same``: on the CPU, whether the blocks are
    bit-identical (``torch.equal``), when the caller knows already (None: asked here).
    """
    block = Block(b, r, rtol, atol)
    if not b.is_floating_point() and not b.is_complex():
        nan = torch.full((b.shape[0],), math.nan, dtype=F64, device=b.device)
        return torch.stack([nan if f.exact is None else f.exact(block) for f in FIELDS], 1)
    if block.host and b.dtype != torch.complex32 and (
            torch.equal(b, r) if same is None else same):  # bit-identical:
        # one pass, most fields zero (torch.equal takes no complex32)
        zero = torch.zeros(b.shape[0], dtype=F64)
        return torch.stack([zero if f.same is None else f.same(block) for f in FIELDS], 1)
    if reads is None:
        return torch.stack([f.compute(block) for f in FIELDS], dim=1)
    unread = torch.full((b.shape[0],), math.nan, dtype=F64, device=b.device)
    return torch.stack([f.compute(block) if f.name in reads else unread for f in FIELDS],
                       dim=1)


def mixed_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float,
                reads: frozenset[str] | None = None) -> torch.Tensor:
    """Like :func:`block_stats` for two floating blocks of different dtypes: the errors in
    the more precise dtype, the ULP distance in the less precise one."""
    low = lower_precision(b.dtype, r.dtype)
    high = b.dtype if low == r.dtype else r.dtype
    out = block_stats(b.to(high), r.to(high), rtol, atol, reads)
    if reads is not None and "max_ulp" not in reads:
        return out
    b_low, r_low = b.to(low), r.to(low)
    if low in INT_VIEW:
        finite = (b_low.to(high) - r_low.to(high)).isfinite()
        out[:, INDEX["max_ulp"]] = max_ulp(b_low, r_low, finite, b.device.type == "cpu")
    else:
        out[:, INDEX["max_ulp"]] = math.nan
    return out


def reduce_blocks(stacked: torch.Tensor, dim: int, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Combines statistics of column blocks stacked along ``dim`` (the fields last): the
    sums add up, the maxima take the largest (three ops, whatever the fields); into
    ``out`` when given."""
    mask = _max_mask(stacked.device)
    if out is None:
        return torch.where(mask, stacked.amax(dim), stacked.sum(dim))
    return torch.where(mask, stacked.amax(dim), stacked.sum(dim), out=out)


_MASKS: dict[torch.device, torch.Tensor] = {}


def _max_mask(device: torch.device) -> torch.Tensor:
    """Per field, whether it combines by maximum, on ``device`` (made once per device)."""
    mask = _MASKS.get(device)
    if mask is None:
        mask = _MASKS[device] = upload(
            torch.tensor([i in MAX_FIELDS for i in range(len(FIELDS))]), device)
    return mask


def combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """Combines the statistics of column blocks of the same rows."""
    return parts[0] if len(parts) == 1 else reduce_blocks(torch.stack(parts), 0)


def blocks(rows: int, elements: int, budget: int) -> Iterator[tuple[int, int]]:
    """Column ranges that keep ``rows * width`` at or under ``budget`` elements."""
    width = max(1, budget // max(rows, 1))
    for start in range(0, elements, width):
        yield start, min(start + width, elements)
