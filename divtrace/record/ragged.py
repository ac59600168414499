"""The row store of a run over prompts of different lengths: each compared prompt's real
tokens at every site, whatever the padding of the pass it ran in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from divtrace.align.sites import Site
from divtrace.align.status import Status, comparable
from divtrace.plan.prompts import RaggedInput, TokenMap
from divtrace.record.recorder import Tracker
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows

__all__ = ["RaggedStore"]


@dataclass
class RaggedStore(RowStore):
    """A :class:`RowStore` for :class:`~divtrace.Prompts`: a site's rows are one tensor
    per compared prompt (``StoredRows.parts``), its real tokens only."""

    ragged: RaggedInput | None = None
    _layout: TokenMap | None = None
    _start: int = 0

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        super().begin_chunk(start, stop, tracker)
        assert self.ragged is not None
        self._layout = self.ragged.layout(start, stop)
        self._start = start

    def end_chunk(self) -> bool:
        return True  # every part is a copy made at once

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        usable = comparable(tensor) if site.opaque is None else site.opaque
        layout = self._layout
        assert layout is not None
        if isinstance(usable, Status) or usable.dim() == 0 or (
                usable.shape[0] != self._chunk_len):
            super().on_tensor(site, tensor)  # reported, never compared
            return
        stored = self.rows.get(site.key)
        if stored is None:
            stored = self.rows[site.key] = StoredRows(
                site, tuple(usable.shape), None, (), usable.dtype,
                parts=[None] * len(self.samples))
        elif usable.dtype != stored.dtype:
            stored.drop(Status.SHAPE_MISMATCH)
        if stored.parts is None:
            return
        device = torch.device("cpu") if self.offload else usable.device
        for slot, row, n in self._runs:
            for k in range(n):
                at = row + k
                part = layout.tokens(usable, at)
                stored.parts[slot + k] = part.to(device, copy=True)
        stored.filled += self._in_chunk

    @property
    def stored_bytes(self) -> int:
        return super().stored_bytes + sum(
            p.numel() * p.element_size() for stored in self.rows.values()
            for p in (stored.parts or ()) if p is not None)
