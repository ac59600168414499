"""A pass checked against the fingerprints of the measured pass: did the held rows move?"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.align.sites import Site
from divtrace.align.status import Status, comparable
from divtrace.devices import upload
from divtrace.measure.host import Deferred, Host
from divtrace.measure.measured import Measured
from divtrace.measure.meter import Meter
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

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        measured = self._sites.get(site.key)
        if measured is None or site.key in self.moved:
            return
        usable = comparable(tensor) if site.opaque is None else site.opaque
        if isinstance(usable, Status) or (
                tuple(usable.shape), usable.dtype) != (measured.shape, measured.dtype):
            return  # not the same site any more: not tested
        assert measured.prints is not None
        was = self._held(measured.prints)
        self.moved[site.key] = self.host.add((self._prints(usable, measured) != was).double())

    def _held(self, prints: torch.Tensor) -> torch.Tensor:
        """The held samples' entries of the measured pass's fingerprints."""
        first, count = self._at[0], len(self._at)
        if self._at == list(range(first, first + count)):
            return prints.narrow(0, first, count)
        index = self._index.get(prints.device)
        if index is None:
            index = self._index[prints.device] = upload(torch.tensor(self._at), prints.device)
        return prints.index_select(0, index)

    def _prints(self, tensor: torch.Tensor, measured: Measured) -> torch.Tensor:
        """The held samples' fingerprints in this pass's ``tensor``."""
        if self.layout is None:
            return self.meter.fingerprints(self.meter.rows(tensor, self._runs))
        assert measured.part_shapes is not None
        shapes = [measured.part_shapes[i] for i in self._at]
        cut = getattr(self.meter, "part_of", None)
        key = measured.site.key
        return self.meter.fingerprints([
            (self.layout.tokens(tensor, sample, shape) if cut is None else
             cut(key, tensor, sample, shape)).unsqueeze(0)
            for sample, shape in zip(self.held, shapes, strict=True)])
