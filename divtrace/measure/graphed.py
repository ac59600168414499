"""The reductions of pairs whose partial blocks are combined one pair at a time, replayed
from a CUDA graph.

:func:`~divtrace.measure.fused.fused_many_placed` combines a pair of more than 64
blocks a row alone: shared with other rows,
torch's reduction may sum it in another order. The prompts of one site are such pairs, a
reduction each: three launches a prompt. Here the same reductions, on partial blocks laid
out as the pair alone would have them (each its own contiguous ``[rows, blocks, fields]``,
aligned as the allocator aligns a tensor), are captured once per layout into a CUDA graph
and replayed: the same kernels with the same shapes, so the same sums, in one launch.
"""

from __future__ import annotations

import torch

from divtrace.measure.fields import FIELDS
from divtrace.measure.stats import reduce_blocks
from divtrace.record.cudagraph import CudaGraph

__all__ = ["Reductions", "reductions_for"]

#: Each pair's partial blocks start on this many float64 (512 bytes, as the caching
#: allocator aligns a tensor).
_ALIGN = 64
#: Layouts kept (their graphs and buffers) before the oldest are let go.
_KEPT = 32
_HELD: dict[tuple[torch.device, tuple[tuple[int, int], ...]], Reductions] = {}


class Reductions:
    """The partial blocks of pairs laid out as ``layout`` (per pair: rows, blocks a row),
    and a graph that combines each pair's on its own into one ``[rows, fields]`` tensor."""

    def __init__(self, device: torch.device, layout: tuple[tuple[int, int], ...]) -> None:
        fields = len(FIELDS)
        starts, size = [], 0
        for rows, blocks in layout:
            starts.append(size)
            size += -(-rows * blocks * fields // _ALIGN) * _ALIGN
        self.buffer = torch.zeros(size, dtype=torch.float64, device=device)
        self.partials = [self.buffer[at:at + rows * blocks * fields].view(rows, blocks, fields)
                         for at, (rows, blocks) in zip(starts, layout, strict=True)]
        self.out = torch.zeros(sum(rows for rows, _ in layout), fields, dtype=torch.float64,
                               device=device)
        self.spans, at = [], 0
        for rows, _ in layout:
            self.spans.append((at, at + rows))
            at += rows
        self.graph = CudaGraph(device, self._run)
        self.graph.capture(self._run)

    def _run(self) -> None:
        for partial, (lo, hi) in zip(self.partials, self.spans, strict=True):
            reduce_blocks(partial, 1, out=self.out[lo:hi])

    def replay(self) -> torch.Tensor:
        """Every pair's fields, after the partial blocks were written: a copy, so that the
        next pairs of this layout may use the buffers."""
        self.graph.replay()
        return self.out.clone()


def reductions_for(device: torch.device, layout: tuple[tuple[int, int], ...]
                   ) -> Reductions | None:
    """The reductions of ``layout`` on ``device``, made once; None where a graph cannot be
    used (not CUDA, or inside another capture)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    key = (device, layout)
    found = _HELD.get(key)
    if found is None:
        if len(_HELD) >= _KEPT:
            _HELD.pop(next(iter(_HELD))).graph.release()
        found = _HELD[key] = Reductions(device, layout)
    return found
