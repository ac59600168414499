"""The fields of one pair of ``[rows, elements]`` blocks: the fused kernel where it
applies, eager blocks elsewhere, and float64 sums taken at a scale where they need it."""

from __future__ import annotations

from functools import partial

import torch

from divtrace.devices import upload
from divtrace.measure import fused
from divtrace.measure.scale import WIDE, rescaled
from divtrace.measure.stats import block_stats, blocks, combine, mixed_stats

__all__ = ["pair_fields"]


def _fields(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float, width: int,
            reads: frozenset[str] | None = None) -> torch.Tensor:
    if b.shape[1] == 0:  # rows without elements (e.g. an op's empty saved statistics):
        # bit-identical, their fields those of an empty pair on the host
        empty = block_stats(torch.empty(b.shape, dtype=b.dtype),
                            torch.empty(r.shape, dtype=r.dtype), rtol, atol, reads)
        return upload(empty, b.device)
    if fused.supports(b) and b.dtype == r.dtype:  # one pass, no temporaries beyond a row
        return fused.fused_stats(b, r, rtol, atol)
    stats = mixed_stats if b.dtype != r.dtype else block_stats  # two configurations
    return combine([stats(b[:, lo:hi], r[:, lo:hi], rtol, atol, reads)
                    for lo, hi in blocks(len(b), b.shape[1], width)])


def pair_fields(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float, width: int,
                reads: frozenset[str] | None = None) -> torch.Tensor:
    """Per-row fields of ``b`` (the measured run's rows) against ``r`` (the reference
    run's), in blocks of about ``width`` elements on the eager path. ``reads``: the only
    fields the eager path computes (see :func:`~divtrace.measure.stats.block_stats`; the
    fused kernel makes every field in its one pass)."""
    found = _fields(b, r, rtol, atol, width, reads)
    if b.dtype not in WIDE or b.dtype != r.dtype:
        return found
    return rescaled(found, b, r, partial(_fields, rtol=rtol, atol=atol, width=width,
                                            reads=reads))
