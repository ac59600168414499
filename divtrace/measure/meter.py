"""The measured run: every site compared with the stored rows the moment it is produced."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import Site, input_site
from divtrace.align.status import Status, comparable, status_of
from divtrace.measure.elements import argmax, elementwise
from divtrace.measure.host import Deferred, Host
from divtrace.measure.measured import CallRecord, LeafCall, Measured
from divtrace.measure.pair import pair_fields
from divtrace.measure.printbatch import SitePrints
from divtrace.measure.prints import Fingerprints
from divtrace.measure.queue import QUEUE_WIDTH, FusedQueue, StatsQueue, WideQueue, budget_for
from divtrace.measure.scale import WIDE, common
from divtrace.measure.stats import lower_precision, tolerances
from divtrace.record.lineage import InputPart, Origin, input_parts
from divtrace.record.oplineage import per_sample
from divtrace.record.recorder import Sink, Tracker, writes
from divtrace.record.repeats import LastTensor
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows, runs_of

__all__ = ["CallRecord", "CallWatcher", "LeafCall", "Measured", "Meter", "SiteWatcher"]

#: Bytes of temporaries per compared element while a block is measured (an upper bound).
_TEMP_BYTES = 40
#: On an accelerator, temporaries may take this share of the recorded rows' bytes ...
_TEMP_SHARE = 0.05
#: ... but a block of this many elements is always allowed, to keep launches few.
_MIN_BLOCK = 1 << 20
#: On the CPU, blocks of this many elements keep the temporaries in cache.
_CPU_BLOCK = 1 << 18
#: Several blocks of at most this many words in all get their fingerprints together
#: (:meth:`~divtrace.measure.prints.Fingerprints.of_many`; off CUDA its temporaries are
#: the weights of the longest row and one block's products).
_MANY_PRINTS = 1 << 22


def _without_train_mode(module: nn.Module) -> bool:
    """A module whose forward pass does not read its ``training`` flag: PyTorch's quantized
    layers (``quantize_dynamic`` leaves them flagged as training)."""
    return type(module).__module__.startswith("torch.ao.nn.quantized")


#: Told of each measured site: ``(measured, tensor, rows)`` — the whole batch's tensor
#: and the stored rows it was measured against.
SiteWatcher = Callable[[Measured, torch.Tensor, torch.Tensor], None]
#: Told of each leaf call as it returns (before its outputs are measured).
CallWatcher = Callable[[LeafCall, CallRecord], None]


@dataclass
class Meter(Sink):
    """Measures the tensors of a run of ``batch`` rows against a :class:`RowStore`.

    Statistics stay on the device (handed to ``host`` for the one transfer at the end).
    ``keep``: also keep the compared rows of this run; ``prints``: their fingerprints.
    ``lineage``: work out where each leaf call's inputs came from (and compare those made
    unseen). ``reads``: the only fields computed eagerly (the others NaN; None: all).
    """

    store: RowStore
    batch: int
    host: Host
    rtol: float | None = None
    atol: float | None = None
    keep: bool = False
    prints: bool = False
    lineage: bool = True
    #: judge the model's output element by element too (for the summary)
    views: bool = True
    reads: frozenset[str] | None = None
    site_watchers: Sequence[SiteWatcher] = ()
    call_watchers: Sequence[CallWatcher] = ()
    sites: list[Measured] = field(default_factory=list)
    calls: dict[str, CallRecord] = field(default_factory=dict)
    _tol: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        budget = budget_for(self.store.stored_bytes)
        self._queue = StatsQueue(self.host, budget, self.reads)
        self._fused = FusedQueue(self.host, budget)
        self._wide = WideQueue(self.host, budget)
        self._runs = runs_of(self.store.samples)
        self._budget = max(_MIN_BLOCK, int(_TEMP_SHARE * self.store.stored_bytes / _TEMP_BYTES))
        self._last: LastTensor[Measured] = LastTensor()
        self._tracker: Tracker | None = None
        self.printer = Fingerprints()
        # the sites' fingerprints, made together after the pass
        self._prints = SitePrints(self.printer, budget)
        self.host.before_fetch(self._prints.flush)

    # -- the sink ---------------------------------------------------------------------

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        """A pass begins."""
        self._tracker = tracker
        self._last.forget()

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        """Measures one observed tensor (called from its hook)."""
        self.sites.append(self.measure(site, tensor))

    def end_chunk(self) -> bool:
        """A pass ended: its sites' fingerprints, together."""
        self._prints.flush()
        return True

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        """A leaf call: its inputs' lineage, then what the call watchers do with it."""
        if not self.lineage:
            return
        parts = input_parts(call, module, args, kwargs, output, tracker)
        self._call(LeafCall(call, module, args, kwargs, output, parts, tracker,
                            module.training and not _without_train_mode(module)))

    def on_op(self, call: Site, op: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], parts: list[InputPart], tracker: Tracker) -> None:
        """An op call, before it runs: its inputs' lineage, then the call watchers."""
        if self.lineage:
            self._call(LeafCall(call, op, args, kwargs, None, parts, tracker))

    def _call(self, leaf: LeafCall) -> None:
        record = self.calls[leaf.site.key] = CallRecord([
            (part.origin, part.key,
             self.measure(input_site(leaf.site, index), part.tensor)
             if part.origin == Origin.INPUT else None)
            for index, part in enumerate(leaf.parts)])
        for watcher in self.call_watchers:
            watcher(leaf, record)

    # -- measuring --------------------------------------------------------------------

    def status(self, stored: StoredRows | None, tensor: torch.Tensor) -> Status:
        """Whether ``tensor`` lines up with ``stored``, a site's stored rows."""
        complete = stored is not None and self.store.complete(stored)
        return status_of(stored, tensor, self.batch, self.store.batch_dim, complete)

    def measure(self, site: Site, tensor: torch.Tensor) -> Measured:
        """Measures one tensor against the stored rows at its site."""
        usable = comparable(tensor) if site.opaque is None else site.opaque
        if isinstance(usable, Status):  # reported, never compared
            return Measured(site, usable, (), tensor.dtype)
        tensor = usable
        stored = self.store.rows.get(site.key)
        status = self.status(stored, tensor)
        measured = Measured(site, status, tuple(tensor.shape), tensor.dtype)
        if status != Status.OK or stored is None or stored.rows is None:
            return measured
        wrote = writes(self._tracker, tensor)
        earlier = self._repeated(site.key, tensor, wrote)
        flips = (site.is_output and tensor.dim() == 2 and tensor.is_floating_point()
                 and (earlier is None or earlier.flips is None))
        # the stored rows on this device (a copy when offloaded), only where they are read
        rows = (self.store.rows_on(stored, tensor.device)
                if earlier is None or flips or self.site_watchers else stored.rows)
        picked: torch.Tensor | None = None
        if earlier is not None:  # the same rows in both runs: the same figures
            measured.stats, measured.flips, measured.kept, measured.prints = (
                earlier.stats, earlier.flips, earlier.kept, earlier.prints)
        else:
            measured.stats, picked = self._queued(tensor, rows)
            if measured.stats is None:
                measured.stats = self.host.add(self.stats(tensor, rows))
        self._last.note(site.key, tensor, wrote, measured)
        for watcher in self.site_watchers:
            watcher(measured, tensor, rows)
        if flips:
            picked = self.store.pick(tensor) if picked is None else picked
            measured.flips = self.host.add((argmax(picked) != argmax(rows)).double())
        if self.views and site.is_output and tensor.is_floating_point():
            picked = self.store.pick(tensor) if picked is None else picked
            measured.elements_view = self.host.add(elementwise(
                picked, self.store.rows_on(stored, tensor.device),
                *self._tolerances(tensor.dtype), (self.rtol, self.atol)))
        if self.keep and measured.kept is None:
            picked = self.store.pick(tensor) if picked is None else picked
            measured.kept = picked.to(stored.rows.device).contiguous()
        if self.prints and measured.prints is None:  # after the pass (or earlier's)
            self._prints.add(measured, picked, earlier, lambda: self.rows(tensor, self._runs))
        self.store.measured(site.key)  # stream: released unless still needed
        return measured

    def flush(self) -> None:
        """Computes the queued sites' statistics now, so that the copies they hold are
        released (e.g. before the probes' passes)."""
        self._queue.flush()
        self._fused.flush()
        self._wide.flush()
        self._prints.flush()

    def fingerprints(self, rows: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """``[k, ...]`` rows (or several such blocks, one after the other) → their ``[k]``
        fingerprints, in blocks as wide as the statistics'."""
        blocks = rows if isinstance(rows, list) else [rows]
        if len(blocks) > 1 and sum(b.numel() * b.element_size() for b in blocks) <= (
                8 * _MANY_PRINTS):  # one sum over every block's words (a few launches)
            return self.printer.of_many(blocks)
        found = [self.printer.of(b, _CPU_BLOCK if b.device.type == "cpu" else self._budget)
                 for b in blocks]
        return found[0] if len(found) == 1 else torch.cat(found)

    def rows(self, tensor: torch.Tensor, runs: list[tuple[int, int, int]]
             ) -> list[torch.Tensor]:
        """The rows of a whole-batch ``tensor`` in each run ``(slot, row, n)`` of samples,
        batch dimension first (views, where the batch dimension is the first)."""
        dim = self.store.batch_dim % tensor.dim()
        if not dim:  # (a move to where it is would still be an op)
            return [tensor.narrow(0, row, n) for _, row, n in runs]
        return [tensor.narrow(dim, row, n).movedim(dim, 0) for _, row, n in runs]

    def _repeated(self, key: str, tensor: torch.Tensor, wrote: int) -> Measured | None:
        """The last measured site, when this site hands on its very tensor, unchanged,
        in this run and shared its rows in the reference run
        (:mod:`~divtrace.record.repeats`); else None."""
        shared = self.store.aliases.get(key)
        if shared is None or shared != self._last.repeats(tensor, wrote):
            return None
        return self._last.payload

    def real_parts(self, tensor: torch.Tensor, shapes: list[torch.Size]
                   ) -> list[torch.Tensor] | None:
        """Per compared prompt, its real tokens in ``tensor`` (prompts of different lengths
        only; None here)."""
        return None

    def over(self, store: RowStore, host: Host | None = None,
             reads: frozenset[str] | None = None) -> Meter:
        """A meter of the same kind over another store (no lineage, no watchers, no
        element-wise view), handing its figures to ``host`` (default: this meter's),
        computing only the fields in ``reads`` (None: all)."""
        return Meter(store, self.batch, host or self.host, self.rtol, self.atol,
                     lineage=False, views=False, reads=reads)

    def of_stored(self, second: RowStore, batch: int
                  ) -> Callable[[StoredRows], Measured | None]:
        """How the compared run's rows at a site, recorded in passes of its own (``second``:
        its row store), are measured against this meter's store (None where it holds
        none)."""
        rows_meter = Meter(self.store.as_batch(), len(second.samples), self.host,
                           self.rtol, self.atol, reads=self.reads)

        def measure(stored: StoredRows) -> Measured | None:
            if stored.rows is None:
                return None
            measured = rows_meter.measure(stored.site, stored.rows)
            measured.shape = (batch, *stored.row_shape)
            return measured
        return measure

    def stats_at(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Per-sample statistics of ``tensor`` (of the whole batch) against the stored rows
        of the site ``key``, or None when they do not line up (nothing is recorded)."""
        stored = self.store.rows.get(key)
        if stored is None or stored.rows is None or self.status(stored, tensor) != Status.OK:
            return None
        return self.stats(tensor, self.store.rows_on(stored, tensor.device))

    def with_reference(self, leaf: torch.Tensor, stored: StoredRows, op: bool
                       ) -> torch.Tensor | None:
        """A copy of ``leaf`` (a tensor of this run) whose compared rows are ``stored``'s
        (the reference run's); ``op``: the batch may be merged with the next dimension."""
        copy = leaf.clone()
        dim = self.store.batch_dim % max(leaf.dim(), 1)
        size = leaf.shape[dim] if leaf.dim() else 0
        if stored.rows is None or not size or (
                size % self.batch if op else size != self.batch):
            return copy
        target = per_sample(copy, dim, self.batch)  # a view: the batch merged in an op's
        rows = self.store.rows_on(stored, leaf.device).movedim(0, dim).to(leaf.dtype)
        if target.shape[:dim] + target.shape[dim + 1:] != rows.shape[:dim] + rows.shape[
                dim + 1:]:
            return None
        target.index_copy_(dim, self.store.samples_on(leaf.device), rows)
        return copy

    def _tolerances(self, dtype: torch.dtype) -> tuple[float, float]:
        if dtype not in self._tol:
            self._tol[dtype] = tolerances(dtype, self.rtol, self.atol)
        return self._tol[dtype]

    def _queued(self, tensor: torch.Tensor, rows: torch.Tensor
                ) -> tuple[Deferred | None, torch.Tensor | None]:
        """The site's fields, queued to be computed with other small sites', and the copy
        of its compared rows the queue holds; ``(None, None)`` when it is measured on its
        own."""
        queue = self._queue_of(tensor.dtype, rows, QUEUE_WIDTH)
        if queue is None:
            return None, None
        n = rows.shape[0]  # (stored rows: the compared samples first)
        picked = self.store.pick(tensor)  # a copy: later ops cannot change it
        rtol, atol = self._tolerances(tensor.dtype)
        # [rows, elements] blocks; the kernels read a contiguous block's rows as they lie
        b, r = ((t if t.is_contiguous() and queue is not self._queue else t.reshape(n, -1))
                for t in (picked, rows))
        return queue.add(*self._roles(b, r), rtol, atol), picked

    def _roles(self, live: torch.Tensor, stored: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pair of blocks as the fields take them, the measured run's rows first: the
        pass's rows (``live``), then the stored ones."""
        return live, stored

    def queued_pair(self, b: torch.Tensor, r: torch.Tensor) -> Deferred | None:
        """The fields of one ``[rows, elements]`` pair (``b``: the measured run's rows, a
        view; ``r``: the reference run's, never written), queued with other sites' on the
        CPU (``b`` copied first) as one block the per-site path would measure in one
        piece; None where the pair is measured on its own. For the many small pairs of one
        site (a prompt each), whatever their width."""
        if b.device.type != "cpu" or self._queue_of(b.dtype, r, _CPU_BLOCK) is None:
            return None
        return self._queue.add(b.clone(), r, *self._tolerances(b.dtype))

    def _queue_of(self, dtype: torch.dtype, rows: torch.Tensor, widest: int
                  ) -> StatsQueue | FusedQueue | WideQueue | None:
        """The queue that takes a pair of ``dtype`` against the stored ``rows`` (the CPU's
        for rows of at most ``widest`` elements), or None."""
        n = rows.shape[0]
        if dtype != rows.dtype or not n:
            return None
        if self._queue.takes(rows.device, rows.numel() // n, _CPU_BLOCK // n, widest):
            return self._queue
        queue = self._wide if dtype in WIDE else self._fused  # (wide: taken at their scale)
        return queue if queue.takes(rows) else None

    def stats(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Per-sample statistics of the compared rows of ``tensor`` against ``rows``."""
        per_run = []
        for (slot, _, n), b in zip(self._runs, self.rows(tensor, self._runs), strict=True):
            r = rows if n == rows.shape[0] else rows.narrow(0, slot, n)
            per_run.append(self.pair_stats(*self._roles(b.reshape(n, -1), r.reshape(n, -1))))
        found = per_run[0] if len(per_run) == 1 else torch.cat(per_run)
        return common(found) if tensor.dtype in WIDE else found

    def pair_stats(self, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Per-row statistics of two ``[rows, elements]`` blocks (the measured run's, the
        reference run's)."""
        mixed = b.dtype != r.dtype
        rtol, atol = self._tolerances(lower_precision(b.dtype, r.dtype) if mixed
                                      else b.dtype)
        width = _CPU_BLOCK if b.device.type == "cpu" else self._budget
        return pair_fields(b, r, rtol, atol, width, self.reads)
