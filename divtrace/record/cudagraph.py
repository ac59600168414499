"""CUDA graphs as the graphed split run uses them (:mod:`divtrace.record.graphs`): passes
captured side by side, each on a stream of its own, after a warm-up; replayed; and the
copy of a pass's rows to slots a device tensor names (inside the graph)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

from divtrace.compat import generator_kept

__all__ = ["CudaGraph", "Graph", "graph_for", "slot_copy"]


class Graph(Protocol):
    """What the graphed run needs of a graph: capture passes, replay them."""

    def capture(self, run: Callable[[], None]) -> int:
        """Captures ``run()`` (which launches the passes); returns the bytes its pool
        took."""

    def lane(self, index: int) -> AbstractContextManager[None]:
        """Inside ``run()``: the work launched in this context is lane ``index``'s, which
        replays concurrently with the other lanes'."""

    def replay(self) -> None:
        """Runs the captured passes again."""

    def release(self) -> None:
        """Frees the graph and its pool (it is not replayed again)."""


class CudaGraph:
    """A :class:`torch.cuda.CUDAGraph`, with a warm-up pass on a side stream first; each
    lane captured on a stream of its own, forked from the start of the capture and joined
    at its end."""

    def __init__(self, device: torch.device, warm_up: Callable[[], None]) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()
        self._warm_up = warm_up
        self._streams: list[torch.cuda.Stream] = []
        self._start: torch.cuda.Event | None = None

    def capture(self, run: Callable[[], None]) -> int:
        side = torch.cuda.Stream(self.device)
        here = torch.cuda.current_stream(self.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            self._warm_up()  # lazy set-up (handles, workspaces) outside the capture
            side.synchronize()
            before = torch.cuda.memory_reserved(self.device)
            # (not torch.cuda.graph(), which empties the allocator's cache first; no
            # garbage collection inside the capture: a graph freed there, the user's or
            # an earlier comparison's, resets itself with calls a capture forbids)
            with generator_kept(self.device), _no_collection():
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._start = torch.cuda.Event()
                    self._start.record(side)
                    run()
                finally:
                    try:
                        for stream in self._streams:  # every lane joins the capture's end
                            side.wait_stream(stream)
                    finally:
                        self.graph.capture_end()
        here.wait_stream(side)
        return torch.cuda.memory_reserved(self.device) - before

    @contextmanager
    def lane(self, index: int) -> Iterator[None]:
        while len(self._streams) <= index:
            self._streams.append(torch.cuda.Stream(self.device))
        stream = self._streams[index]
        assert self._start is not None, "lanes exist only inside a capture"
        stream.wait_event(self._start)
        with torch.cuda.stream(stream):
            yield

    def replay(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        self.graph.reset()


@contextmanager
def _no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def graph_for(device: torch.device, warm_up: Callable[[], None]) -> Graph | None:
    """The graph for passes on ``device`` (None where there is none: not CUDA)."""
    return CudaGraph(device, warm_up) if device.type == "cuda" else None


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def slot_copy(target: torch.Tensor, slots: torch.Tensor, source: torch.Tensor) -> None:
    """``target[slots[i]] = source[i]`` for every row ``i``: the same bytes, read as the
    widest words that divide a row (an indexed copy looks its slot up per element). One
    ``index_copy_``: inside a capture its Python costs far less than a Triton kernel's
    launch, and a graph of several lanes captures hundreds of them."""
    n = len(source)
    width = source[0].numel() * source.element_size() if n else 0
    word = next((size for size in _WORDS if width and width % size == 0
                 and (source.storage_offset() * source.element_size()) % size == 0
                 and (target.storage_offset() * target.element_size()) % size == 0), None)
    if word is None or not source.is_contiguous() or not target.is_contiguous():
        target.index_copy_(0, slots, source)
        return
    dst = target.view(len(target), -1).view(_WORDS[word])
    dst.index_copy_(0, slots, source.reshape(n, -1).view(_WORDS[word]))
