"""The split run's recording: the compared samples' tensors at every site, and no more."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.lineage import input_parts, input_site, tensor_inputs
from divtrace.record import SiteInfo, Tracker

__all__ = ["Reference", "SplitRecording", "runs_of"]


def runs_of(indices: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of sorted indices as ``(position in list, first index, length)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, index in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == index:
            first_pos, first, length = runs[-1]
            runs[-1] = (first_pos, first, length + 1)
        else:
            runs.append((pos, index, 1))
    return runs


@dataclass
class Reference:
    """What the split run produced at one site for the compared samples.

    ``rows`` is ``[samples, *row_shape]`` with the batch dimension moved to the front;
    ``filled`` counts the sample slots written. ``status`` is ``"ok"`` unless the site
    could not be recorded (see :class:`divtrace.Comparison`).
    """

    site: SiteInfo
    shape: tuple[int, ...]
    rows: torch.Tensor | None
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    filled: int = 0
    status: str = "ok"
    pieces: tuple[torch.Tensor, ...] = ()  # rows split by chunk, when every row is compared

    def drop(self, status: str | None = None) -> None:
        """Releases the rows (and the views into them); optionally marks the site."""
        self.rows, self.pieces = None, ()
        if status is not None:
            self.status = status


@dataclass
class SplitRecording:
    """Records the split run, chunk by chunk, keeping only the compared samples' rows."""

    samples: list[int]
    batch_dim: int
    offload: bool
    chunk: int = 1
    refs: dict[str, Reference] = field(default_factory=dict)
    #: per leaf call: where each tensor input came from, as ``(kind, key)``
    calls: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)
    _chunk_len: int = 0
    _runs: list[tuple[int, int, int]] = field(default_factory=list)
    _whole: tuple[int, int] | None = None  # (slot, rows) when the whole chunk is compared
    _in_chunk: int = 0
    _piece: int | None = None  # index into Reference.pieces for this chunk
    # Copies are launched together at the end of a chunk, one foreach launch instead of
    # one per site, except for sites whose output a later op changes in place: those are
    # copied in their hook. Such sites are found by the tensors' version counters.
    _eager: set[str] = field(default_factory=set)
    _pending: list[tuple[torch.Tensor, torch.Tensor, int, str]] = field(default_factory=list)
    _touched: list[Reference] = field(default_factory=list)

    def begin_chunk(self, start: int, stop: int) -> None:
        """Starts a chunk of rows ``start:stop`` of the batch."""
        self._chunk_len = stop - start
        inside = [s for s in self.samples if start <= s < stop]
        first_slot = self.samples.index(inside[0])
        self._runs = [(first_slot + pos, row - start, n) for pos, row, n in runs_of(inside)]
        self._in_chunk = len(inside)
        whole = len(inside) == self._chunk_len
        self._whole = (first_slot, self._chunk_len) if whole else None
        every = len(self.samples) == self.samples[-1] + 1  # rows 0..S-1: slot == row
        self._piece = start // self.chunk if every and whole else None
        self._pending.clear()
        self._touched.clear()

    def end_chunk(self) -> bool:
        """Finishes the chunk. False if it must run again: an op changed a tensor in place
        after its hook, before its copy was made; that site is copied at once from now on.
        """
        changed = [key for _, src, version, key in self._pending if src._version != version]
        if changed:
            self._eager.update(changed)
            self._pending.clear()
            self._touched.clear()
            return False
        if self._pending:
            torch._foreach_copy_([p[0] for p in self._pending], [p[1] for p in self._pending])
        for ref in self._touched:
            ref.filled += self._in_chunk
        self._pending.clear()
        self._touched.clear()
        return True

    @property
    def stored_bytes(self) -> int:
        """Bytes held by the recorded rows."""
        return sum(
            ref.rows.numel() * ref.rows.element_size()
            for ref in self.refs.values()
            if ref.rows is not None
        )

    def complete(self, ref: Reference) -> bool:
        """Whether every compared sample's rows were recorded at this site."""
        return ref.filled == len(self.samples)

    def on_call(self, call: SiteInfo, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        """Notes where a leaf call's inputs came from; records those made unseen.

        The lineage is worked out in the first chunk; later chunks of the same structure
        only record the inputs found unseen there (a call first met later is worked out
        then, with no lineage: all its inputs are recorded).
        """
        known = self.calls.get(call.key)
        if known is not None:
            if any(kind == "input" for kind, _ in known):
                tensors = tensor_inputs(args, kwargs)
                for index, (kind, _) in enumerate(known):
                    if kind == "input" and index < len(tensors):
                        self(input_site(call, index), tensors[index])
            return
        parts = input_parts(call, module, args, kwargs, output, tracker)
        for index, part in enumerate(parts):
            if part.kind == "input":
                self(input_site(call, index), part.tensor)
        self.calls[call.key] = [(part.kind, part.key) for part in parts]

    def _first(self, site: SiteInfo, tensor: torch.Tensor, row_shape: tuple[int, ...]
               ) -> Reference:
        device = torch.device("cpu") if self.offload else tensor.device
        rows = torch.empty((len(self.samples), *row_shape), dtype=tensor.dtype,
                           device=device, pin_memory=self.offload and tensor.is_cuda)
        ref = Reference(site, tuple(tensor.shape), rows, row_shape, tensor.dtype)
        if self.samples[-1] + 1 == len(self.samples):
            ref.pieces = rows.split(self.chunk)  # one call makes every chunk's view
        self.refs[site.key] = ref
        return ref

    def __call__(self, site: SiteInfo, tensor: torch.Tensor) -> None:
        """Records one tensor of the split run (called from its hook: kept lean)."""
        ref = self.refs.get(site.key)
        shape = tensor.shape
        dim = self.batch_dim % len(shape) if shape else 0
        if not shape or shape[dim] != self._chunk_len:
            if ref is None:
                ref = Reference(site, tuple(shape), None, (), tensor.dtype)
                self.refs[site.key] = ref
            ref.drop("unbatched")
            return
        row_shape = tuple(shape[:dim] + shape[dim + 1:])
        if ref is None:
            ref = self._first(site, tensor, row_shape)
        elif row_shape != ref.row_shape or tensor.dtype != ref.dtype:
            ref.drop("shape_mismatch")
        rows = ref.rows
        if rows is None:
            return
        self._touched.append(ref)
        if self._whole is not None and dim == 0:
            target = (ref.pieces[self._piece] if self._piece is not None
                      else rows.narrow(0, self._whole[0], self._whole[1]))
            if self.offload or site.key in self._eager:
                target.copy_(tensor, self.offload)
            else:
                self._pending.append((target, tensor, tensor._version, site.key))
            return
        for slot, row, n in self._runs:
            rows.narrow(0, slot, n).copy_(tensor.narrow(dim, row, n).movedim(dim, 0),
                                          self.offload)
