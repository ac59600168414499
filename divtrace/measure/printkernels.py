"""Fingerprints on a CUDA device (the weights of :mod:`~divtrace.measure.prints`), by
Triton kernels: of ``[rows, words]`` words, and of many rows of words each with its own
address and length (a site's prompts), in one launch and one sum for all of them."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from divtrace.devices import upload
from divtrace.measure.fused import AVAILABLE, BLOCK

if AVAILABLE:
    import triton
    import triton.language as tl

__all__ = ["fused_many_prints", "fused_prints", "prints_at", "takes"]

if AVAILABLE:

    @triton.jit
    def _mix(i):
        """:func:`divtrace.measure.prints._mix`, the same wrapping arithmetic."""
        x = i * -7046029254386353131 + -4658895280553007687
        x = (x ^ (x >> 30)) * -7723592293110705685
        x = (x ^ (x >> 27)) * -4658895280553007687
        return (x ^ (x >> 31)) | 1

    @triton.jit
    def _weighted(words_ptr, blk, n_words, BLOCK: tl.constexpr, PERIOD: tl.constexpr):
        """Block ``blk`` of a row of ``n_words`` words: its words times their weights,
        summed (modulo 2**64)."""
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        word = tl.load(words_ptr + cols, mask=cols < n_words, other=0)
        j = cols.to(tl.int64)
        return tl.sum(word * (_mix(j % PERIOD) * _mix(j // PERIOD + (1 << 40))), axis=0)

    @triton.jit
    def _prints_kernel(words_ptr, out_ptr, n_words, stride, n_blocks, BLOCK: tl.constexpr,
                       PERIOD: tl.constexpr):
        """Block ``blk`` of row ``row``, written to its place in ``out_ptr``."""
        row = tl.program_id(0)
        blk = tl.program_id(1)
        tl.store(out_ptr + row * n_blocks + blk,
                 _weighted(words_ptr + row * stride, blk, n_words, BLOCK, PERIOD))

    @triton.jit
    def _many_prints_kernel(rows_ptr, row_of_ptr, block_of_ptr, out_ptr,
                            BLOCK: tl.constexpr, PERIOD: tl.constexpr):
        """One program per (row, block) of rows each named by a record (its words'
        address, their count): the block's sum, written to the program's place."""
        program = tl.program_id(0)
        row = tl.load(row_of_ptr + program)
        words_ptr = tl.load(rows_ptr + 2 * row).to(tl.pointer_type(tl.int64))
        tl.store(out_ptr + program, _weighted(words_ptr, tl.load(block_of_ptr + program),
                                              tl.load(rows_ptr + 2 * row + 1), BLOCK, PERIOD))


def takes(device: torch.device) -> bool:
    """Whether fingerprints on ``device`` are made by these kernels."""
    return AVAILABLE and device.type == "cuda"


def fused_prints(words: torch.Tensor, period: int) -> torch.Tensor:
    """Fingerprints of ``[rows, words]`` int64 words, in two launches."""
    if words.stride(1) != 1:
        words = words.contiguous()
    rows, n = words.shape
    n_blocks = max(1, triton.cdiv(n, BLOCK))
    partial = torch.empty((rows, n_blocks), dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext():
        _prints_kernel[(rows, n_blocks)](words, partial, n, words.stride(0), n_blocks,
                                         BLOCK=BLOCK, PERIOD=period)
    return partial.sum(1)


def fused_many_prints(blocks: list[torch.Tensor], period: int) -> torch.Tensor:
    """Fingerprints of the rows of several ``[rows, words]`` int64 blocks, one after the
    other, as :func:`fused_prints` gives them block by block (see :func:`prints_at`). The
    caller keeps the blocks alive until the launch has run (it is stream-ordered)."""
    device = blocks[0].device
    blocks = [b if b.stride(1) == 1 else b.contiguous() for b in blocks]
    return prints_at([(b.data_ptr() + i * b.stride(0) * 8, b.shape[1]) for b in blocks
                      for i in range(b.shape[0])], device, period)


def prints_at(records: list[tuple[int, int]], device: torch.device, period: int
              ) -> torch.Tensor:
    """Fingerprints of rows each named by a record (the address of its words on
    ``device``, their count): one launch for every row's blocks of words, and one sum of
    each row's (integers: in any order the same). The caller keeps the rows alive until
    the launch has run (it is stream-ordered)."""
    counts = np.array([max(1, -(-n // BLOCK)) for _, n in records], dtype=np.int64)
    row_of = np.repeat(np.arange(len(records), dtype=np.int64), counts)
    block_of = np.arange(len(row_of), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts,
                                                                  counts)
    table = upload(torch.from_numpy(np.concatenate(
        [np.array(records, dtype=np.int64).reshape(-1), row_of, block_of])), device)
    partial = torch.empty(len(row_of), dtype=torch.int64, device=device)
    n = 2 * len(records)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _many_prints_kernel[(len(row_of),)](table, table[n:], table[n + len(row_of):],
                                            partial, BLOCK=BLOCK, PERIOD=period)
    return torch.zeros(len(records), dtype=torch.int64, device=device).index_add_(
        0, table[n:n + len(row_of)], partial)
