"""The measured run of a token-layout comparison: each compared sequence's tokens in its
one forward call (padded or packed) against the tokens the other run gathered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from divtrace.align.sites import Site
from divtrace.align.status import Status
from divtrace.measure.host import Host
from divtrace.measure.measured import Measured
from divtrace.measure.meter import Meter
from divtrace.measure.ragged import RaggedMeter
from divtrace.plan.prompts import TokenMap
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows

__all__ = ["TokenMeter"]


@dataclass
class TokenMeter(RaggedMeter):
    """A :class:`RaggedMeter` whose pass lays its sequences out by ``layout`` (rows, as
    packing puts several in one row): each stored part is met by the same tokens of its
    sequence (from the part's first, :attr:`StoredRows.firsts`)."""

    _firsts: list[int] | None = None

    @property
    def _rows(self) -> int:
        layout = self.layout
        assert layout is not None
        return self.batch if layout.rows is None else max(layout.rows) + 1

    def _laid(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor`` as ``[rows, tokens, ...]`` (None: no axis of the pass's tokens)."""
        layout = self.layout
        assert layout is not None
        rows = self._rows
        if tensor.dim() >= 2 and tensor.shape[0] == rows and tensor.shape[1] == layout.length:
            return tensor
        if tensor.dim() >= 1 and tensor.shape[0] == rows * layout.length != rows:
            return tensor.view(rows, layout.length, *tensor.shape[1:])
        return None

    def part_of(self, key: str, tensor: torch.Tensor, sample: int,
                shape: tuple[int, ...]) -> torch.Tensor:
        stored = self.store.rows.get(key)
        first = 0 if stored is None or stored.firsts is None else (
            stored.firsts[self.store.samples.index(sample)])
        return self._cut(tensor, sample, shape, first)

    def _cut(self, tensor: torch.Tensor, sample: int, shape: tuple[int, ...],
             first: int) -> torch.Tensor:
        """Sample ``sample``'s tokens ``first:first + shape[0]`` in ``tensor``."""
        layout = self.layout
        assert layout is not None
        laid = self._laid(tensor)
        count = shape[0] if shape else 0
        at = layout.offsets[sample] + first
        if laid is None or first + count > layout.valid[sample] or at < 0:
            return tensor.new_empty(0)  # lines up with no part
        return laid[layout.row(sample)].narrow(0, at, count)

    def measure(self, site: Site, tensor: torch.Tensor) -> Measured:
        stored = self.store.rows.get(site.key)
        self._firsts = None if stored is None else stored.firsts
        return super().measure(site, tensor)

    def real_parts(self, tensor: torch.Tensor, shapes: list[torch.Size]
                   ) -> list[torch.Tensor] | None:
        firsts = self._firsts or [0] * len(shapes)
        parts = [self._cut(tensor, sample, tuple(shape), first) for sample, shape, first in
                 zip(self.store.samples, shapes, firsts, strict=True)]
        return parts if [p.shape for p in parts] == list(shapes) else None

    def _pairs(self, tensor: torch.Tensor, parts: list[torch.Tensor | None]
               ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        firsts = self._firsts or [0] * len(parts)
        pairs = []
        for slot, sample in enumerate(self.store.samples):
            r = parts[slot]
            assert r is not None
            b = self._cut(tensor, sample, tuple(r.shape), firsts[slot])
            if b.shape != r.shape:
                return None
            pairs.append((b, r))
        return pairs

    def stats_at(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        stored = self.store.rows.get(key)
        self._firsts = None if stored is None else stored.firsts
        return super().stats_at(key, tensor)

    def with_reference(self, leaf: torch.Tensor, stored: StoredRows, op: bool
                       ) -> torch.Tensor | None:
        return None  # run a's tokens lie in other calls: not put into this pass

    def of_stored(self, second: RowStore, batch: int
                  ) -> Callable[[StoredRows], Measured | None]:
        """Run b recorded in several calls too (``second``: a :class:`TokenStore`): each
        site's parts put end to end in one row, and measured as a packed pass of them."""
        def measure(stored: StoredRows) -> Measured | None:
            laid = _end_to_end(stored, second.samples, batch)
            if laid is None:
                return None
            if isinstance(laid, Status):
                return Measured(stored.site, laid, stored.shape, stored.dtype)
            before, self.layout = self.layout, laid[1]
            try:
                return self.measure(stored.site, laid[0])
            finally:
                self.layout = before
        return measure

    def over(self, store: RowStore, host: Host | None = None,
             reads: frozenset[str] | None = None) -> Meter:
        return TokenMeter(store, self.batch, host or self.host, self.rtol, self.atol,
                          lineage=False, views=False, reads=reads, layout=self.layout)

    def _status(self, tensor: torch.Tensor, dtype: torch.dtype) -> Status:
        if self._laid(tensor) is None:
            return Status.NOT_PER_TOKEN
        if tensor.dtype != dtype and not (
                tensor.is_floating_point() and dtype.is_floating_point):
            return Status.DTYPE_MISMATCH
        return Status.OK


def _end_to_end(stored: StoredRows, samples: list[int], batch: int
                ) -> tuple[torch.Tensor, TokenMap] | Status | None:
    """A site's parts (one per compared sequence) end to end as one packed row, with the
    map of where each sequence's tokens lie in it; a status where they cannot be; None
    where the store holds no parts."""
    parts, firsts = stored.parts, stored.firsts
    if parts is None or firsts is None or any(p is None for p in parts):
        return None
    held = [p for p in parts if p is not None]
    if any(p.dim() == 0 for p in held) or len({tuple(p.shape[1:]) for p in held}) > 1:
        return Status.SHAPE_MISMATCH
    offsets, valid, at = [0] * batch, [0] * batch, 0
    for part, sample, first in zip(held, samples, firsts, strict=True):
        offsets[sample], valid[sample] = at - first, first + part.shape[0]
        at += part.shape[0]
    return (torch.cat(held).unsqueeze(0),
            TokenMap(at, tuple(offsets), tuple(valid), rows=(0,) * batch))
