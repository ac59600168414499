"""CUDA graphs as the graphed split run uses them (:mod:`divtrace.record.graphs`): a pass
captured on a side stream after a warm-up, replayed; and the copy of a pass's rows to
slots a device tensor names (inside the graph)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from divtrace.compat import generator_kept

try:  # Triton ships with PyTorch's CUDA builds; without it, index_copy_ does the copies
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

__all__ = ["CudaGraph", "Graph", "graph_for", "slot_copy"]


class Graph(Protocol):
    """What the graphed run needs of a graph: capture a pass, replay it."""

    def capture(self, run: Callable[[], None]) -> int:
        """Captures ``run()`` (which launches the pass); returns the bytes its pool took."""

    def replay(self) -> None:
        """Runs the captured pass again."""


class CudaGraph:
    """A :class:`torch.cuda.CUDAGraph`, with a warm-up pass on a side stream first."""

    def __init__(self, device: torch.device, warm_up: Callable[[], None]) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()
        self._warm_up = warm_up

    def capture(self, run: Callable[[], None]) -> int:
        side = torch.cuda.Stream(self.device)
        here = torch.cuda.current_stream(self.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            self._warm_up()  # lazy set-up (handles, workspaces) outside the capture
            side.synchronize()
            before = torch.cuda.memory_reserved(self.device)
            # (not torch.cuda.graph(), which empties the allocator's cache first)
            with generator_kept(self.device):
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    run()
                finally:
                    self.graph.capture_end()
        here.wait_stream(side)
        return torch.cuda.memory_reserved(self.device) - before

    def replay(self) -> None:
        self.graph.replay()


def graph_for(device: torch.device, warm_up: Callable[[], None]) -> Graph | None:
    """The graph for passes on ``device`` (None where there is none: not CUDA)."""
    return CudaGraph(device, warm_up) if device.type == "cuda" else None


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _slot_copy_kernel(src_ptr, dst_ptr, slots_ptr, n_cols, src_stride, dst_stride,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        slot = tl.load(slots_ptr + row).to(tl.int64)
        words = tl.load(src_ptr + row * src_stride + cols, mask=inside)
        tl.store(dst_ptr + slot * dst_stride + cols, words, mask=inside)


def slot_copy(target: torch.Tensor, slots: torch.Tensor, source: torch.Tensor) -> None:
    """``target[slots[i]] = source[i]`` for every row ``i``: the same bytes, read as the
    widest words that divide a row. On CUDA with Triton one kernel that reads each row's
    slot once (an indexed copy looks it up per element); else ``index_copy_``."""
    n = len(source)
    width = source[0].numel() * source.element_size() if n else 0
    word = next((size for size in _WORDS if width and width % size == 0
                 and (source.storage_offset() * source.element_size()) % size == 0
                 and (target.storage_offset() * target.element_size()) % size == 0), None)
    if word is None or not source.is_contiguous() or not target.is_contiguous():
        target.index_copy_(0, slots, source)
        return
    src = source.reshape(n, -1).view(_WORDS[word])
    dst = target.view(len(target), -1).view(_WORDS[word])
    if triton is None or not src.is_cuda:
        dst.index_copy_(0, slots, src)
        return
    with torch.cuda.device(src.device):
        _slot_copy_kernel[(n, triton.cdiv(src.shape[1], _BLOCK))](
            src, dst, slots, src.shape[1], src.stride(0), dst.stride(0), BLOCK=_BLOCK)
