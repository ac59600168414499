"""The row store: the compared samples' rows of one run at every site, and no more."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import Site, input_site
from divtrace.align.status import Status, comparable
from divtrace.compat import foreach_copy, version
from divtrace.devices import upload
from divtrace.record.cudagraph import slot_copy
from divtrace.record.lineage import InputPart, Origin, input_parts, tensor_inputs
from divtrace.record.recorder import Sink, Tracker, writes
from divtrace.record.repeats import LastTensor
from divtrace.record.stored import StoredRows, runs_of

__all__ = ["RowStore"]


@dataclass
class RowStore(Sink):
    """Records a run chunk by chunk, keeping only the compared samples' rows.

    With ``learn_lineage``, it also notes where each leaf call's inputs came from
    (:attr:`lineage`, worked out in the first chunk) and records the inputs that no
    observed module made. Rows are released as soon as the measured run is done with
    them, unless ``pinned`` or held (:meth:`hold`).
    """

    samples: list[int]
    batch_dim: int
    offload: bool = False
    learn_lineage: bool = True
    pinned: bool = False
    rows: dict[str, StoredRows] = field(default_factory=dict)
    #: per leaf call: where each tensor input came from, as ``(origin, key)``
    lineage: dict[str, list[tuple[Origin, str | None]]] = field(default_factory=dict)
    _unseen: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per call: inputs
    _chunk_len: int = 0
    _runs: list[tuple[int, int, int]] = field(default_factory=list)
    _whole: tuple[int, int] | None = None  # (slot, rows) when the whole chunk is compared
    _in_chunk: int = 0
    # Copies are launched together at the end of a chunk, one foreach launch instead of
    # one per site, except for sites whose output a later op changes in place: those are
    # copied in their hook. Such sites are found by the tensors' version counters.
    _eager: set[str] = field(default_factory=set)
    # The first chunk copies every site at once and watches which tensors a later op
    # changes: those sites are copied at once from then on (no pass runs twice for it).
    _learnt: bool = False
    _watched: list[tuple[torch.Tensor, int, int, str]] = field(default_factory=list)
    # (target, source, its version, its memory's write count, site key)
    _pending: list[tuple[torch.Tensor, torch.Tensor, int, int, str]] = field(
        default_factory=list)
    _tracker: Tracker | None = None
    _touched: list[StoredRows] = field(default_factory=list)
    _holds: Counter[str] = field(default_factory=Counter)
    _index: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    # While a pass is captured as a graph: the device tensor of the slots each row goes
    # to (set before each replay), the sites captured, and what the capture could not take
    _slots: torch.Tensor | None = None
    _captured: list[StoredRows] = field(default_factory=list)
    _uncapturable: list[str] = field(default_factory=list)
    #: per site that hands on the very tensor of the site before it (a container and its
    #: last child): that site's key; the two share one rows tensor, copied once
    aliases: dict[str, str] = field(default_factory=dict)
    _last: LastTensor[None] = field(default_factory=LastTensor)

    # -- the recorded run -------------------------------------------------------------

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        """Starts a chunk of rows ``start:stop`` of the batch."""
        tracker.lineage = self.learn_lineage and not self.lineage  # learnt from the first
        self._tracker = tracker
        self._chunk_len = stop - start
        inside = [s for s in self.samples if start <= s < stop]
        first_slot = self.samples.index(inside[0])
        self._runs = [(first_slot + pos, row - start, n) for pos, row, n in runs_of(inside)]
        self._in_chunk = len(inside)
        whole = len(inside) == self._chunk_len
        self._whole = (first_slot, self._chunk_len) if whole else None
        self._pending.clear()
        self._touched.clear()
        self._last.forget()

    def end_chunk(self) -> bool:
        """Finishes the chunk. False if it must run again: an op changed a tensor in place
        after its hook, before its copy was made (an in-place op the first chunk did not
        show); that site is copied at once from now on.
        """
        writes = self._tracker.writes_to if self._tracker is not None else (lambda _t: 0)
        if not self._learnt:  # the first chunk: copied at once, watched
            self._eager.update(key for src, seen, wrote, key in self._watched
                               if version(src) != seen or writes(src) != wrote)
            self._watched.clear()
            self._learnt = True
        changed = [key for _, src, seen, wrote, key in self._pending
                   if version(src) != seen or writes(src) != wrote]
        if changed:
            self._eager.update(changed)
            self._pending.clear()
            self._touched.clear()
            return False
        if self._pending:
            foreach_copy([p[0] for p in self._pending], [p[1] for p in self._pending])
        for stored in self._touched:
            stored.filled += self._in_chunk
        self._pending.clear()
        self._touched.clear()
        return True

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        """Notes where a leaf call's inputs came from; records those made unseen.

        The lineage is worked out in the first chunk; later chunks of the same structure
        only record the inputs found unseen there (a call first met later is worked out
        then, with no lineage: all its inputs are recorded).
        """
        if not self.learn_lineage:
            return
        unseen = self._unseen.get(call.key)
        if unseen is not None:  # a call met before: only its unseen inputs are recorded
            if unseen:
                tensors = tensor_inputs(args, kwargs)
                for index in unseen:
                    if index < len(tensors):
                        self.on_tensor(input_site(call, index), tensors[index])
            return
        parts = input_parts(call, module, args, kwargs, output, tracker)
        for index, part in enumerate(parts):
            if part.origin == Origin.INPUT:
                self.on_tensor(input_site(call, index), part.tensor)
        self.lineage[call.key] = [(part.origin, part.key) for part in parts]
        self._unseen[call.key] = tuple(
            index for index, part in enumerate(parts) if part.origin == Origin.INPUT)

    def on_op(self, call: Site, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              parts: list[InputPart], tracker: Tracker) -> None:
        """An op call: its lineage (first met), and its inputs made unseen, recorded."""
        if not self.learn_lineage:
            return
        if call.key not in self.lineage:
            self.lineage[call.key] = [(part.origin, part.key) for part in parts]
        for index, part in enumerate(parts):
            if part.origin == Origin.INPUT:
                self.on_tensor(input_site(call, index), part.tensor)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        """Records one tensor of the run (called from its hook: kept lean)."""
        if self._slots is not None:
            self._capture(site, tensor)
            return
        if site.opaque is not None or tensor.layout is not torch.strided or (
                tensor.is_nested or tensor.is_quantized):  # the rare cases, out of the way
            usable = comparable(tensor) if site.opaque is None else site.opaque
            if isinstance(usable, Status):  # reported, never compared
                self.rows[site.key] = StoredRows(site, (), None, (), tensor.dtype,
                                                 status=usable)
                return
            tensor = usable
        stored = self.rows.get(site.key)
        shape = tensor.shape
        dim = self.batch_dim % len(shape) if shape else 0
        if not shape or shape[dim] != self._chunk_len:
            if stored is None:
                stored = StoredRows(site, tuple(shape), None, (), tensor.dtype)
                self.rows[site.key] = stored
            stored.drop(Status.UNBATCHED)
            return
        row_shape = tuple(shape[:dim] + shape[dim + 1:])
        wrote = writes(self._tracker, tensor)
        if stored is not None and (row_shape != stored.row_shape
                                   or tensor.dtype != stored.dtype):
            stored.drop(Status.SHAPE_MISMATCH)
        elif self._shares(site, stored, tensor, row_shape, wrote):
            return
        made = stored is None and self._whole == (0, len(self.samples)) and dim == 0 and (
            not self.offload)  # the chunk's rows are all the compared rows: copied at once
        if stored is None:
            stored = self._first(site, tensor, row_shape, made)
        rows = stored.rows
        if rows is None:
            return
        self._touched.append(stored)
        self._last.note(site.key, tensor, wrote)
        if self._whole is not None and dim == 0:
            if not (made or self.offload or site.key in self._eager or not self._learnt):
                target = rows.narrow(0, self._whole[0], self._whole[1])
                self._pending.append((target, tensor, version(tensor), wrote, site.key))
                return
            if not made:  # copied at once (else a copy of the tensor made the rows)
                rows.narrow(0, self._whole[0], self._whole[1]).copy_(tensor, self.offload)
            if not self._learnt and not self.offload:
                self._watched.append((tensor, version(tensor), wrote, site.key))
            return
        for slot, row, n in self._runs:
            part = tensor.narrow(dim, row, n)
            target = rows if n == len(rows) else rows.narrow(0, slot, n)
            target.copy_(part.movedim(dim, 0) if dim else part, self.offload)

    def _shares(self, site: Site, stored: StoredRows | None, tensor: torch.Tensor,
                row_shape: tuple[int, ...], wrote: int) -> bool:
        """Whether the site's rows are the last site's, written by that site's copy: the
        site hands on its very tensor, unchanged (:mod:`~divtrace.record.repeats`), now
        and in every chunk before. A site that shared rows and stops handing the tensor
        on gets rows of its own (the chunks so far copied from the shared ones)."""
        earlier = self._last.repeats(tensor, wrote)
        held = None if earlier is None else self.rows[earlier].rows
        if stored is None:
            if earlier is None or held is None:
                return False
            stored = self.rows[site.key] = StoredRows(site, tuple(tensor.shape), held,
                                                      row_shape, tensor.dtype)
            self.aliases[site.key] = earlier
        elif site.key not in self.aliases:
            return False
        elif held is None or self.aliases[site.key] != earlier or stored.rows is not held:
            del self.aliases[site.key]
            if stored.rows is not None:
                stored.rows = stored.rows.clone()
            return False
        self._touched.append(stored)
        self._last.note(site.key, tensor, wrote)
        return True

    def _first(self, site: Site, tensor: torch.Tensor, row_shape: tuple[int, ...],
               whole: bool = False) -> StoredRows:
        """The site's rows: empty, or (``whole``: the tensor holds every compared row, in
        order) a copy of the tensor, in one op."""
        if whole:
            rows = tensor.clone(memory_format=torch.contiguous_format)
        else:
            device = torch.device("cpu") if self.offload else tensor.device
            rows = torch.empty((len(self.samples), *row_shape), dtype=tensor.dtype,
                               device=device, pin_memory=self.offload and tensor.is_cuda)
        stored = StoredRows(site, tuple(tensor.shape), rows, row_shape, tensor.dtype)
        self.rows[site.key] = stored
        return stored

    # -- a captured pass ----------------------------------------------------------------

    def begin_capture(self, slots: torch.Tensor, tracker: Tracker) -> None:
        """The pass about to be captured (as a CUDA graph) copies every site's rows to the
        rows named by ``slots``, a device tensor of one slot per row of the pass, set
        before each replay. Every row of such a pass is compared."""
        self._slots, self._tracker, self._chunk_len = slots, tracker, len(slots)
        self._captured, self._uncapturable = [], []
        self._last.forget()

    def end_capture(self) -> tuple[list[StoredRows], list[str]]:
        """The sites the captured pass copies, in order; the sites it could not take (a
        site the first pass did not show, or one whose tensor is not a plain batched
        tensor on the slots' device)."""
        self._slots = None
        return self._captured, self._uncapturable

    def _capture(self, site: Site, tensor: torch.Tensor) -> None:
        stored = self.rows.get(site.key)
        if stored is not None and stored.rows is None and stored.status is not Status.OK:
            return  # reported in the first pass, never compared
        slots = self._slots
        assert slots is not None
        shape = tensor.shape
        dim = self.batch_dim % len(shape) if shape else 0
        if (stored is None or stored.rows is None or site.opaque is not None
                or tensor.layout is not torch.strided or tensor.is_nested
                or tensor.is_quantized or tensor.device != slots.device
                or stored.rows.device != slots.device or not shape
                or shape[dim] != self._chunk_len or tensor.dtype != stored.dtype
                or tuple(shape[:dim] + shape[dim + 1:]) != stored.row_shape):
            self._uncapturable.append(site.key)
            return
        wrote = writes(self._tracker, tensor)
        shared = self.aliases.get(site.key)
        if shared is None:
            slot_copy(stored.rows, slots, tensor.movedim(dim, 0))
        elif shared != self._last.repeats(tensor, wrote):  # its rows are another site's
            self._uncapturable.append(site.key)
            return
        self._last.note(site.key, tensor, wrote)
        self._captured.append(stored)

    # -- reading ------------------------------------------------------------------------

    def put(self, site: Site, shape: tuple[int, ...], rows: torch.Tensor) -> None:
        """Stores the complete rows of a site as they are (e.g. another run's kept rows)."""
        self.rows[site.key] = StoredRows(site, shape, rows, tuple(rows.shape[1:]),
                                         rows.dtype, filled=len(self.samples))

    def as_batch(self) -> RowStore:
        """The same rows, read as a batch of their own: sample ``i`` is row ``i``."""
        count = len(self.samples)
        return RowStore(list(range(count)), 0, False, rows=self.rows,
                        lineage=self.lineage, _unseen=self._unseen, aliases=self.aliases)

    @property
    def stored_bytes(self) -> int:
        """Bytes held by the recorded rows (rows two sites share counted once)."""
        held = {id(stored.rows): stored.rows for stored in self.rows.values()
                if stored.rows is not None}
        return sum(rows.numel() * rows.element_size() for rows in held.values())

    def complete(self, stored: StoredRows) -> bool:
        """Whether every compared sample's rows were recorded at this site."""
        return stored.filled == len(self.samples)

    def samples_on(self, device: torch.device) -> torch.Tensor:
        """The compared samples' indices as a tensor on ``device`` (made once; copied to a
        GPU from pinned memory, so the host does not wait for the GPU's queued work)."""
        if device not in self._index:
            self._index[device] = upload(torch.tensor(self.samples), device)
        return self._index[device]

    def pick(self, tensor: torch.Tensor) -> torch.Tensor:
        """The compared samples' rows of a whole-batch tensor, batch dimension first."""
        dim = self.batch_dim % tensor.dim()
        picked = tensor.index_select(dim, self.samples_on(tensor.device))
        return picked.movedim(dim, 0) if dim else picked

    @staticmethod
    def rows_on(stored: StoredRows, device: torch.device) -> torch.Tensor:
        """The stored rows on ``device`` (a copy if they live elsewhere)."""
        rows = stored.rows
        assert rows is not None
        return rows if rows.device == device else rows.to(device, non_blocking=True)

    # -- releasing ----------------------------------------------------------------------

    def hold(self, keys: Iterable[str]) -> None:
        """Keeps these sites' rows past their measurement, until :meth:`release` d."""
        self._holds.update(keys)

    def measured(self, key: str) -> None:
        """The measured run is done with this site's rows: released unless held."""
        stored = self.rows.get(key)
        if stored is not None and not self.pinned and self._holds[key] == 0:
            stored.drop()

    def release(self, key: str) -> None:
        """One holder of this site's rows is done; the last one releases them."""
        self._holds[key] -= 1
        stored = self.rows.get(key)
        if self._holds[key] <= 0 and stored is not None and not self.pinned:
            stored.drop()
