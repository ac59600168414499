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

import numpy as np
import torch

from divtrace.devices import upload
from divtrace.measure.fields import FIELDS, INDEX
from divtrace.measure.graphed import reductions_for
from divtrace.measure.stats import reduce_blocks

try:  # Triton ships with PyTorch's CUDA builds; without it the eager path is used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

__all__ = ["AVAILABLE", "BLOCK", "ManyLaunch", "fused_many", "fused_many_placed", "fused_stats",
           "supports"]

AVAILABLE = triton is not None
#: Elements a program of the kernels reads.
BLOCK = 2048
#: The fields this kernel computes.
KERNEL_FIELDS = frozenset({"mismatch", "nonfinite", "exceed", "max_abs", "sum_abs", "sq_diff",
                           "sq_ref", "sq_out", "dot", "max_ulp", "scale"})
_ULP_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}
#: A site's record for :func:`fused_many`: its rows' addresses (measured, reference), its
#: partial fields' address, the row width, the rows' strides, the blocks per row.
_RECORD = 7
#: Pairs of at most this many blocks per row share one reduction of their partial
#: blocks with the other pairs of as many. On an H200 that reduction gave every row bit
#: for bit its own reduction's sums for 2 to 69, 80 and 96 blocks (the counts tried);
#: from 128 blocks on, a pair of at most 4 rows reduced alone summed in another order.
_SHARED_BLOCKS = 64

if AVAILABLE:

    @triton.jit
    def _fields(b_ptr, r_ptr, out_ptr, row, blk, n_cols, stride_b, stride_r, n_blocks,
                rtol, atol, BLOCK: tl.constexpr, BITS: tl.constexpr, N_FIELDS: tl.constexpr,
                MISMATCH: tl.constexpr, NONFINITE: tl.constexpr, EXCEED: tl.constexpr,
                MAX_ABS: tl.constexpr, SUM_ABS: tl.constexpr, SQ_DIFF: tl.constexpr,
                SQ_REF: tl.constexpr, SQ_OUT: tl.constexpr, DOT: tl.constexpr,
                MAX_ULP: tl.constexpr, SCALE: tl.constexpr):
        """Block ``blk`` of row ``row`` of both runs' rows, loaded, and its fields written
        to its place in ``out_ptr``. The one body of both kernels."""
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols  # the columns in the row
        b = tl.load(b_ptr + row * stride_b + cols, mask=inside, other=0)
        r = tl.load(r_ptr + row * stride_r + cols, mask=inside, other=0)
        base = out_ptr + (row * n_blocks + blk) * N_FIELDS
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
        tl.store(base + SCALE, 0.0)  # unscaled (see divtrace.measure.scale)

    @triton.jit
    def _stats_kernel(b_ptr, r_ptr, out_ptr, n_cols, stride_b, stride_r, n_blocks, rtol, atol,
                      BLOCK: tl.constexpr, BITS: tl.constexpr, N_FIELDS: tl.constexpr,
                      MISMATCH: tl.constexpr, NONFINITE: tl.constexpr, EXCEED: tl.constexpr,
                      MAX_ABS: tl.constexpr, SUM_ABS: tl.constexpr, SQ_DIFF: tl.constexpr,
                      SQ_REF: tl.constexpr, SQ_OUT: tl.constexpr, DOT: tl.constexpr,
                      MAX_ULP: tl.constexpr, SCALE: tl.constexpr):
        _fields(b_ptr, r_ptr, out_ptr, tl.program_id(0), tl.program_id(1), n_cols, stride_b,
                stride_r, n_blocks, rtol, atol, BLOCK, BITS, N_FIELDS, MISMATCH, NONFINITE,
                EXCEED, MAX_ABS, SUM_ABS, SQ_DIFF, SQ_REF, SQ_OUT, DOT, MAX_ULP, SCALE)

    @triton.jit
    def _many_kernel(sites_ptr, site_of_ptr, local_of_ptr, rtol, atol, BLOCK: tl.constexpr,
                     BITS: tl.constexpr, DTYPE: tl.constexpr, RECORD: tl.constexpr,
                     ALIGNED_B: tl.constexpr, ALIGNED_R: tl.constexpr,
                     STRIDE_B16: tl.constexpr, STRIDE_R16: tl.constexpr,
                     COLS16: tl.constexpr, N_FIELDS: tl.constexpr,
                     MISMATCH: tl.constexpr, NONFINITE: tl.constexpr, EXCEED: tl.constexpr,
                     MAX_ABS: tl.constexpr, SUM_ABS: tl.constexpr, SQ_DIFF: tl.constexpr,
                     SQ_REF: tl.constexpr, SQ_OUT: tl.constexpr, DOT: tl.constexpr,
                     MAX_ULP: tl.constexpr, SCALE: tl.constexpr):
        """One program per (site, row, block): the site's record (see :func:`fused_many`)
        says where its rows and its partial fields are. The flags tell the compiler what
        :func:`_stats_kernel` learns from its arguments (16-byte aligned rows, strides and
        widths that 16 divides), so that it lays the block out over the threads alike and
        sums it in the same order."""
        program = tl.program_id(0)
        site = tl.load(site_of_ptr + program)
        local = tl.load(local_of_ptr + program)
        record = sites_ptr + site * RECORD
        b_ptr = tl.load(record).to(tl.pointer_type(DTYPE))
        r_ptr = tl.load(record + 1).to(tl.pointer_type(DTYPE))
        out_ptr = tl.load(record + 2).to(tl.pointer_type(tl.float64))
        n_cols = tl.load(record + 3)
        stride_b = tl.load(record + 4)
        stride_r = tl.load(record + 5)
        n_blocks = tl.load(record + 6)
        if ALIGNED_B:
            b_ptr = tl.multiple_of(b_ptr, 16)
        if ALIGNED_R:
            r_ptr = tl.multiple_of(r_ptr, 16)
        if STRIDE_B16:
            stride_b = tl.multiple_of(stride_b, 16)
        if STRIDE_R16:
            stride_r = tl.multiple_of(stride_r, 16)
        if COLS16:
            n_cols = tl.multiple_of(n_cols, 16)
        _fields(b_ptr, r_ptr, out_ptr, local // n_blocks, (local % n_blocks).to(tl.int32),
                n_cols, stride_b, stride_r, n_blocks, rtol, atol, BLOCK, BITS, N_FIELDS,
                MISMATCH, NONFINITE, EXCEED, MAX_ABS, SUM_ABS, SQ_DIFF, SQ_REF, SQ_OUT, DOT,
                MAX_ULP, SCALE)


#: Triton's names of the dtypes the kernels read.
_TL_DTYPES = ({torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
               torch.float32: tl.float32, torch.float64: tl.float64} if AVAILABLE else {})

#: The kernel's layout: where it writes each field, read from the registry.
_LAYOUT = {name.upper(): INDEX[name] for name in KERNEL_FIELDS if name in INDEX}
_COMPLETE = {f.name for f in FIELDS} <= KERNEL_FIELDS


def supports(b: torch.Tensor) -> bool:
    """Whether :func:`fused_stats` can take this tensor (and computes every field)."""
    return AVAILABLE and _COMPLETE and b.is_cuda and b.dtype in _ULP_BITS


def fused_stats(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Per-row statistics of two ``[rows, elements]`` tensors, as ``[rows, fields]`` float64
    (the columns of :data:`divtrace.measure.fields.FIELDS`; rows may be strided)."""
    b = b if b.stride(1) == 1 else b.contiguous()
    r = r if r.stride(1) == 1 else r.contiguous()
    rows, cols = b.shape
    n_blocks = max(1, triton.cdiv(cols, BLOCK))
    partial = torch.empty((rows, n_blocks, len(FIELDS)), dtype=torch.float64, device=b.device)
    # Triton launches on the current device's stream: make that the tensors' device, or a
    # model sharded over GPUs is read on another GPU's stream, before its data is written
    with torch.cuda.device(b.device) if b.is_cuda else contextlib.nullcontext():
        _stats_kernel[(rows, n_blocks)](
            b, r, partial, cols, b.stride(0), r.stride(0), n_blocks, float(rtol), float(atol),
            BLOCK=BLOCK, BITS=_ULP_BITS[b.dtype], N_FIELDS=len(FIELDS), **_LAYOUT)
    return partial[:, 0] if n_blocks == 1 else reduce_blocks(partial, 1)


def fused_many(pairs: list[tuple[torch.Tensor, torch.Tensor]], rtol: float, atol: float
               ) -> list[torch.Tensor]:
    """:func:`fused_stats` of many pairs (see :func:`fused_many_placed`), one tensor each."""
    return [fields[lo:hi] for fields, (lo, hi) in fused_many_placed(pairs, rtol, atol)]


def fused_many_placed(pairs: list[tuple[torch.Tensor, torch.Tensor]], rtol: float,
                      atol: float) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """:func:`fused_stats` of many pairs of one dtype on one device, in one launch per
    kind of layout (:class:`ManyLaunch`, launched once)."""
    return ManyLaunch(pairs, rtol, atol).run()


class ManyLaunch:
    """:func:`fused_stats` of many pairs of one dtype on one device, planned once: one
    launch per kind of layout, each pair's fields exactly as :func:`fused_stats` gives
    them alone (the same kernel body on the same blocks, laid out alike). Rows of one
    element are not taken (:func:`fused_stats` compiles them apart). Blocks are ``[rows,
    elements]``, or contiguous ``[rows, ...]`` ones read as such.

    Each pair's fields come as a tensor shared with other pairs and the range of its rows
    in it, not sliced here: the pairs of one block per row share one tensor; the pairs of
    ``n`` blocks per row (up to :data:`_SHARED_BLOCKS`) write their partial blocks into one
    buffer for that ``n``, which one reduction combines (three launches for all of them,
    not three per pair). Every row of that reduction sums its own blocks as
    :func:`fused_stats`' reduction of one pair does; a CUDA test checks the two bit for bit
    over many shapes. A pair of more blocks is combined alone.

    :meth:`run` may launch again over the same memory, its values changed since, where no
    pair was copied to make its rows contiguous (``copied`` False). The caller keeps every
    tensor alive until the launches have run (they are stream-ordered)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], rtol: float,
                 atol: float) -> None:
        self.device = device = pairs[0][0].device
        self.dtype = pairs[0][0].dtype
        self.rtol, self.atol = rtol, atol
        self.copied = any(_step(b) is None or _step(r) is None for b, r in pairs)
        pairs = [(b if _step(b) is not None else b.contiguous(),
                  r if _step(r) is not None else r.contiguous()) for b, r in pairs]
        self._pairs = pairs  # (the copies alive until the launches ran)
        shapes = [(b.shape[0], width, max(1, triton.cdiv(width, BLOCK)))
                  for b, _ in pairs for width in (b.numel() // max(b.shape[0], 1),)]
        # each pair's buffer of partial blocks: one per count of blocks, or its own
        keys = [blocks if blocks <= _SHARED_BLOCKS else -index - 1
                for index, (_, _, blocks) in enumerate(shapes)]
        held: dict[int, tuple[int, int]] = {}  # key -> rows of its pairs, blocks per row
        for key, (rows, _, blocks) in zip(keys, shapes, strict=True):
            held[key] = (held.get(key, (0, 0))[0] + rows, blocks)
        outs = {key: torch.empty((rows, blocks, len(FIELDS)), dtype=torch.float64,
                                 device=device) for key, (rows, blocks) in held.items()
                if key > 0}
        alone = [key for key in keys if key < 0]  # combined one by one: from a graph
        self._graphed = reductions_for(device, tuple(held[key] for key in alone)) if len(
            alone) > 1 else None  # where several are (the same kernels, one launch)
        for index, key in enumerate(alone):
            outs[key] = (self._graphed.partials[index] if self._graphed is not None
                         else torch.empty((*held[key], len(FIELDS)), dtype=torch.float64,
                                          device=device))
        self._outs = outs
        in_graph = dict(zip(alone, self._graphed.spans, strict=True)) if self._graphed else {}
        taken = dict.fromkeys(outs, 0)
        #: per pair, where run() gives its fields: its buffer's key and its rows there
        self._spans: list[tuple[int | None, int, int]] = []
        kinds: dict[tuple[bool, ...], list[int]] = {}
        records = []
        for index, ((b, r), (rows, cols, blocks), key) in enumerate(
                zip(pairs, shapes, keys, strict=True)):
            out, at = outs[key], taken[key]
            taken[key] += rows
            self._spans.append((None, *in_graph[key]) if key in in_graph
                               else (key, at, at + rows))
            stride_b, stride_r = (int(_step(t) or 0) for t in (b, r))  # (None: not now)
            records.append((b.data_ptr(), r.data_ptr(),
                            out.data_ptr() + at * blocks * len(FIELDS) * out.element_size(),
                            cols, stride_b, stride_r, blocks))
            kinds.setdefault((b.data_ptr() % 16 == 0, r.data_ptr() % 16 == 0,
                              stride_b % 16 == 0, stride_r % 16 == 0, cols % 16 == 0),
                             []).append(index)
        self._gather: tuple[list[int | None], torch.Tensor | None] | None = None
        self._tables = [(_table([records[i] for i in members],
                                [shapes[i][0] * shapes[i][2] for i in members], device), kind)
                        for kind, members in kinds.items()]

    def run(self) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        """Each pair's fields, as the tensor that holds them and its rows' range in it
        (one launch per kind of layout)."""
        for (table, programs), kind in self._tables:
            _launch(table, programs, kind, self.device, self.dtype, self.rtol, self.atol)
        made: dict[int | None, torch.Tensor] = {}
        if self._graphed is not None:  # every pair combined alone, in one replay
            made[None] = self._graphed.replay()
        for key, out in self._outs.items():
            if key > 0 or self._graphed is None:
                made[key] = out[:, 0] if key == 1 else reduce_blocks(out, 1)
        return [(made[key], (lo, hi)) for key, lo, hi in self._spans]

    def gathered(self) -> torch.Tensor:
        """:meth:`run`, every pair's fields then in one ``[rows, fields]`` tensor of its
        own, the pairs' rows one after the other in their order (one gather)."""
        made = {key: fields for (key, _, _), (fields, _) in zip(
            self._spans, self.run(), strict=True)}  # each buffer's fields, by key
        if self._gather is None:  # the buffers in their first pairs' order, and the pairs'
            keys = list(made)  # rows among them (the same at every launch)
            sizes = [made[key].shape[0] for key in keys]
            first = dict(zip(keys, np.cumsum([0, *sizes[:-1]]), strict=True))
            at = np.concatenate([np.arange(lo, hi) + first[key] for key, lo, hi in self._spans])
            in_order = len(at) == sum(sizes) and bool((at == np.arange(len(at))).all())
            self._gather = keys, None if in_order else upload(torch.from_numpy(at), self.device)
        keys, order = self._gather
        whole = torch.cat([made[key] for key in keys]) if len(keys) > 1 else made[keys[0]].clone()
        return whole if order is None else whole.index_select(0, order)


def _step(block: torch.Tensor) -> int | None:
    """The elements from a row's start to the next's, where each row lies along memory
    (a ``[rows, elements]`` block's side by side, a contiguous ``[rows, ...]`` block's)."""
    if block.dim() == 2:
        return block.stride(0) if block.stride(1) == 1 else None
    return block.numel() // max(block.shape[0], 1) if block.is_contiguous() else None


def _table(records: list[tuple[int, ...]], programs: list[int], device: torch.device
           ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """The table of one launch of :func:`_many_kernel` on ``device``, in its three parts
    (the sites' records, each program's site, its block among the site's), and the count
    of its programs."""
    counts = np.array(programs, dtype=np.int64)
    site_of = np.repeat(np.arange(len(records), dtype=np.int64), counts)
    local_of = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts)
    table = torch.from_numpy(np.concatenate(
        [np.array(records, dtype=np.int64).reshape(-1), site_of, local_of]))
    table = upload(table, device)
    n, launched = len(records) * _RECORD, len(site_of)
    return (table, table[n:], table[n + launched:]), launched


def _launch(table: tuple[torch.Tensor, torch.Tensor, torch.Tensor], programs: int,
            kind: tuple[bool, ...], device: torch.device, dtype: torch.dtype, rtol: float,
            atol: float) -> None:
    """One launch of :func:`_many_kernel` over sites of one kind of layout (``table``:
    :func:`_table`'s)."""
    aligned_b, aligned_r, stride_b16, stride_r16, cols16 = kind
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _many_kernel[(programs,)](
            *table, float(rtol), float(atol),
            BLOCK=BLOCK, BITS=_ULP_BITS[dtype], DTYPE=_TL_DTYPES[dtype], RECORD=_RECORD,
            ALIGNED_B=aligned_b, ALIGNED_R=aligned_r, STRIDE_B16=stride_b16,
            STRIDE_R16=stride_r16, COLS16=cols16, N_FIELDS=len(FIELDS), **_LAYOUT)
