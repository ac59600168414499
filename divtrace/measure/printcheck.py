"""A pass checked against the fingerprints of the measured pass: did the held rows move?"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from divtrace.align.sites import Site
from divtrace.align.status import Status, comparable
from divtrace.devices import upload
from divtrace.measure.host import Deferred, Host
from divtrace.measure.measured import Measured
from divtrace.measure.meter import Meter
from divtrace.measure.printbatch import PrintBatch
from divtrace.measure.queue import budget_for
from divtrace.plan.prompts import TokenMap
from divtrace.record.recorder import Sink
from divtrace.record.stored import runs_of

__all__ = ["PrintCheck"]


@dataclass
class PrintCheck(Sink):
    """Per site of a whole-batch pass: whether each held sample's rows differ from the
    measured pass's (``meter``, which made fingerprints). ``held``: the held samples' rows
    in the batch (a run of the compared samples). ``layout``: where each prompt's real
    tokens lie, for prompts of different lengths."""

    meter: Meter
    held: list[int]
    host: Host
    layout: TokenMap | None = None
    #: per tested site: 1.0 for each held sample whose rows moved, else 0.0 (on the host
    #: after its fetch)
    moved: dict[str, Deferred] = field(default_factory=dict)
    _sites: dict[str, Measured] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._sites = {m.site.key: m for m in self.meter.sites if m.prints is not None}
        samples = self.meter.store.samples
        self._at = [samples.index(s) for s in self.held]  # their places among the compared
        self._runs = runs_of(self.held)
        self._index: dict[torch.device, torch.Tensor] = {}
        self._rows: dict[torch.device, torch.Tensor] = {}  # the held rows, per device
        # the held rows' fingerprints, made together after the pass
        self._batch = PrintBatch(self.meter.printer, budget_for(self.meter.store.stored_bytes),
                                 self._compared)
        self.host.before_fetch(self._batch.flush)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        measured = self._sites.get(site.key)
        if measured is None or site.key in self.moved:
            return
        usable = comparable(tensor) if site.opaque is None else site.opaque
        if isinstance(usable, Status) or (
                tuple(usable.shape), usable.dtype) != (measured.shape, measured.dtype):
            return  # not the same site any more: not tested
        assert measured.prints is not None
        self.moved[site.key] = self.host.reserve()
        blocks, copies = self._blocks(usable, measured)
        self._batch.add(blocks, measured, copies)

    def end_chunk(self) -> bool:
        self._batch.flush()
        return True

    def _compared(self, prints: torch.Tensor, spans: list[tuple[Any, int, int]]) -> None:
        """Each waiting site's held rows against the measured pass's, by their
        fingerprints (``prints``: this pass's, end to end), in one comparison."""
        # [sites, compared] (every waiting site has its prints: see on_tensor)
        was = torch.stack([m.prints for m, _, _ in spans if m.prints is not None])
        moved = (prints != self._held(was).reshape(-1)).double()
        for m, start, stop in spans:
            self.host.put(self.moved[m.site.key], moved, (start, stop))

    def _held(self, prints: torch.Tensor) -> torch.Tensor:
        """The held samples' entries of the measured pass's fingerprints (``[sites,
        compared]``: per site, along the last dimension)."""
        first, count = self._at[0], len(self._at)
        if self._at == list(range(first, first + count)):
            return prints.narrow(-1, first, count)
        index = self._index.get(prints.device)
        if index is None:
            index = self._index[prints.device] = upload(torch.tensor(self._at), prints.device)
        return prints.index_select(-1, index)

    def _blocks(self, tensor: torch.Tensor, measured: Measured
                ) -> tuple[list[torch.Tensor], bool]:
        """The held samples' rows in this pass's ``tensor``, one block after the other,
        and whether they are copies: views of one run of rows, or one gathered copy of
        several (a group of the independence test is seldom one run)."""
        if self.layout is None and len(self._runs) == 1:
            return self.meter.rows(tensor, self._runs), False
        if self.layout is None:
            dim = self.meter.store.batch_dim % tensor.dim()
            rows = self._rows.get(tensor.device)
            if rows is None:
                rows = self._rows[tensor.device] = upload(torch.tensor(self.held),
                                                          tensor.device)
            picked = tensor.index_select(dim, rows)
            return [picked.movedim(dim, 0) if dim else picked], True
        assert measured.part_shapes is not None
        shapes = [measured.part_shapes[i] for i in self._at]
        cut = getattr(self.meter, "part_of", None)
        key = measured.site.key
        return [(self.layout.tokens(tensor, sample, shape) if cut is None else
                 cut(key, tensor, sample, shape)).unsqueeze(0)
                for sample, shape in zip(self.held, shapes, strict=True)], False
