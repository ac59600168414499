"""A fused Triton kernel for the per-row statistics of a site on a CUDA device.

The eager path in :mod:`divtrace.measure.stats` launches a few dozen small kernels per block;
on a GPU their launch cost, not the arithmetic, is what a comparison pays. This kernel
reads each pair of elements once and writes one partial row of statistics per program;
a few torch reductions combine the partials. Same figures as the eager path: the tests
check one against the other. The kernel writes each field at its position in the
registry (:data:`~divtrace.measure.fields.FIELDS`); a registry with a field this kernel
does not compute makes :func:`supports` false, and the eager path is used.
"""

from __future__ import annotations

import contextlib

import torch

from divtrace.measure.fields import FIELDS, INDEX
from divtrace.measure.stats import reduce_blocks

try:  # Triton ships with PyTorch's CUDA builds; without it the eager path is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

__all__ = ["AVAILABLE", "fused_stats", "supports"]

AVAILABLE = triton is not None
_BLOCK = 2048
#: The fields this kernel computes.
KERNEL_FIELDS = frozenset({"mismatch", "nonfinite", "exceed", "max_abs", "sum_abs", "sq_diff",
                           "sq_ref", "sq_out", "dot", "max_ulp"})
_ULP_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}

if AVAILABLE:

    @triton.jit
    def _stats_kernel(b_ptr, r_ptr, out_ptr, n_cols, stride_b, stride_r, n_blocks, rtol, atol,
                      BLOCK: tl.constexpr, BITS: tl.constexpr, N_FIELDS: tl.constexpr,
                      MISMATCH: tl.constexpr, NONFINITE: tl.constexpr, EXCEED: tl.constexpr,
                      MAX_ABS: tl.constexpr, SUM_ABS: tl.constexpr, SQ_DIFF: tl.constexpr,
                      SQ_REF: tl.constexpr, SQ_OUT: tl.constexpr, DOT: tl.constexpr,
                      MAX_ULP: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        b = tl.load(b_ptr + row * stride_b + cols, mask=inside, other=0)
        r = tl.load(r_ptr + row * stride_r + cols, mask=inside, other=0)
        if BITS == 64:
            bf = b.to(tl.float64)
            rf = r.to(tl.float64)
        else:
            bf = b.to(tl.float32)
            rf = r.to(tl.float32)
        equal = bf == rf  # exact upcast: as in the tensor's own dtype; -0.0 == +0.0
        both_nan = (bf != bf) & (rf != rf)
        absdiff = tl.abs(bf - rf)
        finite = absdiff < float("inf")  # false where either run is NaN or infinite
        clean = tl.where(finite, absdiff, 0.0)
        bf = tl.where(finite, bf, 0.0)  # norms and products over pairs finite in both runs
        rf = tl.where(finite, rf, 0.0)
        mismatch = (~equal) & (~both_nan) & inside
        nonfinite = (~finite) & inside
        exceed = ((clean > atol + rtol * tl.abs(rf)) | ((~finite) & (~equal))) & inside
        # ULP: map the bit patterns to integers ordered like the floats, -0.0 == +0.0
        if BITS == 64:
            bits_b = b.to(tl.int64, bitcast=True)
            bits_r = r.to(tl.int64, bitcast=True)
            mag_b = bits_b & 0x7FFFFFFFFFFFFFFF
            mag_r = bits_r & 0x7FFFFFFFFFFFFFFF
            ord_b = tl.where(bits_b < 0, -mag_b, mag_b).to(tl.float64)
            ord_r = tl.where(bits_r < 0, -mag_r, mag_r).to(tl.float64)
            ulp = tl.abs(ord_b - ord_r)
        else:
            if BITS == 32:
                bits_b = b.to(tl.int32, bitcast=True)
                bits_r = r.to(tl.int32, bitcast=True)
                mag_b = bits_b & 0x7FFFFFFF
                mag_r = bits_r & 0x7FFFFFFF
            else:
                bits_b = b.to(tl.int16, bitcast=True).to(tl.int32)
                bits_r = r.to(tl.int16, bitcast=True).to(tl.int32)
                mag_b = bits_b & 0x7FFF
                mag_r = bits_r & 0x7FFF
            ord_b = tl.where(bits_b < 0, -mag_b, mag_b).to(tl.int64)
            ord_r = tl.where(bits_r < 0, -mag_r, mag_r).to(tl.int64)
            ulp = tl.abs(ord_b - ord_r).to(tl.float64)
        ulp = tl.where(finite & inside, ulp, 0.0)
        base = out_ptr + (row * n_blocks + blk) * N_FIELDS
        tl.store(base + MISMATCH, tl.sum(mismatch.to(tl.float32), axis=0).to(tl.float64))
        tl.store(base + NONFINITE, tl.sum(nonfinite.to(tl.float32), axis=0).to(tl.float64))
        tl.store(base + EXCEED, tl.sum(exceed.to(tl.float32), axis=0).to(tl.float64))
        tl.store(base + MAX_ABS, tl.max(clean, axis=0).to(tl.float64))
        tl.store(base + SUM_ABS, tl.sum(clean, axis=0).to(tl.float64))
        tl.store(base + SQ_DIFF, tl.sum(clean * clean, axis=0).to(tl.float64))
        tl.store(base + SQ_REF, tl.sum(rf * rf, axis=0).to(tl.float64))
        tl.store(base + SQ_OUT, tl.sum(bf * bf, axis=0).to(tl.float64))
        tl.store(base + DOT, tl.sum(bf * rf, axis=0).to(tl.float64))
        tl.store(base + MAX_ULP, tl.max(ulp, axis=0))


#: The kernel's layout: where it writes each field, read from the registry.
_LAYOUT = {name.upper(): INDEX[name] for name in KERNEL_FIELDS if name in INDEX}
_COMPLETE = {f.name for f in FIELDS} <= KERNEL_FIELDS


def supports(b: torch.Tensor) -> bool:
    """Whether :func:`fused_stats` can take this tensor (and computes every field)."""
    return AVAILABLE and _COMPLETE and b.is_cuda and b.dtype in _ULP_BITS


def fused_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Per-row statistics of two ``[rows, elements]`` tensors, as ``[rows, fields]`` float64.

    The columns are those of :data:`divtrace.measure.fields.FIELDS`. Rows may be strided;
    elements within a row must be contiguous.
    """
    if b.stride(1) != 1:
        b = b.contiguous()
    if r.stride(1) != 1:
        r = r.contiguous()
    rows, cols = b.shape
    n_blocks = max(1, triton.cdiv(cols, _BLOCK))
    partial = torch.empty((rows, n_blocks, len(FIELDS)), dtype=torch.float64, device=b.device)
    # Triton launches on the current device's stream: make that the tensors' device, or a
    # model sharded over GPUs is read on another GPU's stream, before its data is written
    with torch.cuda.device(b.device) if b.is_cuda else contextlib.nullcontext():
        _stats_kernel[(rows, n_blocks)](
            b, r, partial, cols, b.stride(0), r.stride(0), n_blocks, float(rtol), float(atol),
            BLOCK=_BLOCK, BITS=_ULP_BITS[b.dtype], N_FIELDS=len(FIELDS), **_LAYOUT)
    return partial[:, 0] if n_blocks == 1 else reduce_blocks(partial, 1)
