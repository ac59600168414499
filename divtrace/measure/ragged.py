"""The measured run over prompts of different lengths: each compared prompt's real tokens
against those the reference run recorded (padding is never compared)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from divtrace.align.ragged import real_tokens
from divtrace.align.sites import Site
from divtrace.align.status import Status, comparable
from divtrace.measure.meter import Measured, Meter
from divtrace.plan.prompts import Layout

__all__ = ["RaggedMeter"]


@dataclass
class RaggedMeter(Meter):
    """A :class:`Meter` for :class:`~divtrace.Prompts`: the measured run's tensor is cut to
    each compared prompt's real tokens (``layout``: where they lie in its pass) and
    compared with the reference run's parts, prompt by prompt."""

    layout: Layout | None = None

    def measure(self, site: Site, tensor: torch.Tensor) -> Measured:
        stored = self.store.rows.get(site.key)
        usable = comparable(tensor) if site.opaque is None else site.opaque
        if isinstance(usable, Status) or stored is None or stored.parts is None:
            return super().measure(site, tensor)  # reported as the row store says
        status = self._status(usable, stored.dtype)
        if status == Status.OK and not self.store.complete(stored):
            status = Status.PARTIAL_IN_SPLIT
        measured = Measured(site, status, tuple(usable.shape), usable.dtype)
        if status != Status.OK:
            return measured
        layout = self.layout
        assert layout is not None
        found, elements = [], []
        for slot, sample in enumerate(self.store.samples):
            r = stored.parts[slot]
            assert r is not None
            b = real_tokens(usable, sample, layout.length, layout.offsets[sample],
                            layout.valid[sample], tuple(r.shape))
            if b.shape != r.shape:
                measured.status = Status.SHAPE_MISMATCH
                return measured
            found.append(self.pair_stats(b.reshape(1, -1), r.to(b.device).reshape(1, -1)))
            elements.append(b.numel())
        measured.stats = self.host.add(torch.cat(found))
        measured.elements = tuple(elements)
        for watcher in self.site_watchers:  # no stored rows of one shape to hand on
            watcher(measured, usable, usable.new_empty(0))
        self.store.measured(site.key)
        return measured

    def _status(self, tensor: torch.Tensor, dtype: torch.dtype) -> Status:
        if tensor.dim() == 0 or tensor.shape[0] != self.batch:
            return Status.UNBATCHED
        if tensor.dtype != dtype and not (
                tensor.is_floating_point() and dtype.is_floating_point):
            return Status.DTYPE_MISMATCH
        return Status.OK
