"""The measured run over prompts of different lengths: each compared prompt's real tokens
against those the reference run recorded (padding is never compared)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from divtrace.align.sites import Site
from divtrace.align.status import Status, comparable
from divtrace.measure import fused
from divtrace.measure.fields import FIELDS
from divtrace.measure.host import Deferred, Host, Joined
from divtrace.measure.measured import Measured
from divtrace.measure.meter import Meter
from divtrace.measure.scale import WIDE, common
from divtrace.plan.prompts import TokenMap
from divtrace.record.oplineage import per_sample
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows

__all__ = ["RaggedMeter"]


@dataclass
class RaggedMeter(Meter):
    """A :class:`Meter` for :class:`~divtrace.Prompts`: the measured run's tensor is cut to
    each compared prompt's real tokens (``layout``: where they lie in its pass) and
    compared with the reference run's parts, prompt by prompt."""

    layout: TokenMap | None = None

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
        kept: list[torch.Tensor] | None = [] if self.keep else None
        prints: list[torch.Tensor] | None = [] if self.prints else None
        found = self._parts_stats(usable, stored.parts, kept, prints)
        if found is None:
            measured.status = Status.SHAPE_MISMATCH
            return measured
        measured.kept_parts = kept
        if prints is not None:
            measured.prints = torch.cat(prints)
            measured.part_shapes = tuple(tuple(p.shape) for p in stored.parts if p is not None)
        measured.stats = found[0]
        measured.elements = found[1]
        for watcher in self.site_watchers:  # no stored rows of one shape to hand on
            watcher(measured, usable, usable.new_empty(0))
        self.store.measured(site.key)
        return measured

    def part_of(self, key: str, tensor: torch.Tensor, sample: int,
                shape: tuple[int, ...]) -> torch.Tensor:
        """Sample ``sample``'s real tokens in ``tensor``, a pass's at site ``key``, as
        measured against a stored part of ``shape``."""
        layout = self.layout
        assert layout is not None
        return layout.tokens(tensor, sample, shape)

    def real_parts(self, tensor: torch.Tensor, shapes: list[torch.Size]
                   ) -> list[torch.Tensor] | None:
        layout = self.layout
        assert layout is not None
        parts = [layout.tokens(tensor, sample, tuple(shape))
                 for sample, shape in zip(self.store.samples, shapes, strict=True)]
        return parts if [p.shape for p in parts] == list(shapes) else None

    def over(self, store: RowStore, host: Host | None = None,
             reads: frozenset[str] | None = None) -> Meter:
        return RaggedMeter(store, self.batch, host or self.host, self.rtol, self.atol,
                           lineage=False, views=False, reads=reads, layout=self.layout)

    def _pairs(self, tensor: torch.Tensor, parts: list[torch.Tensor | None]
               ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per compared prompt: its real tokens in ``tensor`` and its recorded part, each
        as one row (views where they can be); None if a shape does not line up."""
        layout = self.layout
        assert layout is not None
        pairs = []
        for slot, sample in enumerate(self.store.samples):
            r = parts[slot]
            assert r is not None
            b = layout.tokens(tensor, sample, tuple(r.shape))
            if b.shape != r.shape:
                return None
            pairs.append((b, r))
        return pairs

    def _parts_stats(self, tensor: torch.Tensor, parts: list[torch.Tensor | None],
                     kept: list[torch.Tensor] | None = None,
                     prints: list[torch.Tensor] | None = None
                     ) -> tuple[Deferred, tuple[int, ...]] | None:
        """Per compared prompt: the statistics of its real tokens in ``tensor`` against its
        recorded part (on the host after its fetch), and their element counts; None if a
        shape does not line up. ``kept``, ``prints``: also collect copies of the real
        tokens, their fingerprints (one sum for every prompt)."""
        pairs = self._pairs(tensor, parts)
        if pairs is None:
            return None
        if kept is not None:
            kept.extend(b.to(r.device, copy=True) for b, r in pairs)
        if prints is not None:
            prints.append(self.fingerprints([b.unsqueeze(0) for b, _ in pairs]))
        elements = tuple(b.numel() for b, _ in pairs)
        rows = [(b.reshape(1, -1), (r if r.device == b.device else r.to(b.device))
                 .reshape(1, -1)) for b, r in pairs]
        wide = tensor.dtype in WIDE  # every prompt's sums brought to one scale
        if wide and tensor.device.type != "cpu":
            return self.host.add(common(torch.cat([self._alone(*p) for p in rows]))), elements
        found: list[Deferred | None] = [self.queued_pair(b, r) if b.shape[1] else None
                                        for b, r in rows]
        together = [i for i, (b, r) in enumerate(rows) if found[i] is None
                    and b.shape[1] > 1 and b.dtype == r.dtype and fused.supports(b)]
        if len(together) > 1:  # one launch for these prompts, each its own figures
            placed = fused.fused_many_placed([rows[i] for i in together],
                                             *self._tolerances(tensor.dtype))
            for i, (fields, span) in zip(together, placed, strict=True):
                place = found[i] = self.host.reserve()
                self.host.put(place, fields, span)
        return Joined([place if place is not None else self.host.add(self._alone(*rows[i]))
                       for i, place in enumerate(found)], scaled=wide), elements

    def _alone(self, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """One prompt's ``[1, fields]``; a prompt without a real token yet (an empty cache)
        compares nothing."""
        if b.numel() == 0:
            return torch.zeros(1, len(FIELDS), dtype=torch.float64, device=b.device)
        return self.pair_stats(b, r)

    def stats_at(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        stored = self.store.rows.get(key)
        if stored is None or stored.parts is None or (
                self._status(tensor, stored.dtype) != Status.OK):
            return None
        pairs = self._pairs(tensor, stored.parts)
        if pairs is None:
            return None
        stats = torch.cat([self._alone(b.reshape(1, -1), r.to(b.device).reshape(1, -1))
                           for b, r in pairs])
        return common(stats) if tensor.dtype in WIDE else stats

    def with_reference(self, leaf: torch.Tensor, stored: StoredRows, op: bool
                       ) -> torch.Tensor | None:
        if stored.parts is None:
            return super().with_reference(leaf, stored, op)
        copy = leaf.clone()
        if leaf.dim() == 0 or leaf.shape[0] % self.batch:
            return copy
        rows = per_sample(copy, 0, self.batch) if op else copy
        layout = self.layout
        assert layout is not None
        for slot, sample in enumerate(self.store.samples):
            part = stored.parts[slot]
            assert part is not None
            target = layout.tokens(rows, sample, tuple(part.shape))
            if target.shape != part.shape:
                return None
            target.copy_(part)
        return copy

    def _status(self, tensor: torch.Tensor, dtype: torch.dtype) -> Status:
        if tensor.dim() == 0 or tensor.shape[0] != self.batch:
            return Status.UNBATCHED
        if tensor.dtype != dtype and not (
                tensor.is_floating_point() and dtype.is_floating_point):
            return Status.DTYPE_MISMATCH
        return Status.OK
