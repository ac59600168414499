"""The split run as a CUDA graph: one pass captured, its recording copies inside it, then
replayed for every chunk.

A per-sample run is bound by kernel launches and by Python (the model's and the hooks').
Here the first chunk runs eagerly, as always; one pass of the same size is then captured
as a CUDA graph, with every site's copy into the row store inside the graph (each row to
the slot a device tensor names, set before each replay). Each further chunk is its rows
copied into the graph's input, its slots set, and one replay.

Truthfulness first: the graph replays the captured kernels, which should be the eager
pass's. Before any chunk is replayed, the graph runs the first chunk again and every site
is compared bit for bit with the eager pass; on any difference, or when the capture fails
(a host synchronisation, a tensor not on the GPU, ...), the rest of the run is eager and
the outcome says why (``graphs=True`` raises instead).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from divtrace.errors import DivtraceValueError, DivtraceWarning
from divtrace.plan.inputs import BatchedInput
from divtrace.record.cudagraph import Graph, graph_for
from divtrace.record.loop import InputCopies, drive, forward
from divtrace.record.recorder import Recorder
from divtrace.record.rows import RowStore, StoredRows

__all__ = ["GraphMode", "GraphOutcome", "GraphedRun", "check_graphs"]

#: ``compare(graphs=...)``: ``"auto"`` (graphs where they can be used and pay), True
#: (graphs, or an error saying why not), False (the eager split run).
GraphMode = bool | str

#: Under ``"auto"``, the fewest passes a graph must replay to pay for its capture (a
#: warm-up pass, the capture, the check).
MIN_REPLAYS = 3


def check_graphs(graphs: Any) -> GraphMode:
    """The validated ``graphs=`` option."""
    if graphs not in (False, True, "auto") or not isinstance(graphs, bool | str):
        raise DivtraceValueError(
            f"graphs must be 'auto' (replay the split run from a CUDA graph where it can be "
            f"used), True (always, or an error) or False (the eager split run); got "
            f"{graphs!r}")
    return graphs


@dataclass(frozen=True)
class GraphOutcome:
    """How one chunked run went: replayed from a CUDA graph or eager, and why.

    Attributes:
        requested: The ``graphs=`` option.
        passes: The run's passes.
        replayed: The passes replayed from the graph (0: the run was eager).
        pool_bytes: GPU memory the graph's own pool took (its pass's activations).
        capture_s: Seconds spent on the graph before its first replay (a warm-up pass,
            the capture, the check against the eager pass).
        reason: Why passes ran eagerly (None: every pass after the first was replayed).
    """

    requested: GraphMode
    passes: int
    replayed: int = 0
    pool_bytes: int = 0
    capture_s: float = 0.0
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, as integers of its width (floats compared bit for bit)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_floating_point():
        return tensor.view(_INTS[tensor.element_size()])
    return tensor


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


class _Failed(Exception):
    """The graph cannot stand for the eager pass; the message says why. ``tried``: a
    graph was made and failed (a warning), rather than none could be made."""

    def __init__(self, reason: str, tried: bool = True) -> None:
        super().__init__(reason)
        self.tried = tried


@dataclass
class _Pass:
    """One captured pass: its input buffers, its slots and the sites it copies."""

    graph: Graph
    inputs: list[Any]
    slots: torch.Tensor
    steps: torch.Tensor  # 0, 1, ... for each row of the pass
    sites: list[StoredRows]
    pool_bytes: int = 0
    capture_s: float = 0.0

    def load(self, leaves: list[Any], first_slot: int) -> None:
        """Sets the next replay's input rows, and its slots: ``first_slot`` onwards (the
        rows of a replayed pass are all compared, so their slots follow each other)."""
        for buffer, leaf in zip(self.inputs, leaves, strict=True):
            if isinstance(buffer, torch.Tensor) and buffer is not leaf:
                buffer.copy_(leaf)
        torch.add(self.steps, first_slot, out=self.slots)  # no copy from the host


class GraphedRun:
    """Drives a chunked run into a row store through a CUDA graph where it can.

    After :meth:`drive`, :attr:`outcome` says how many passes were replayed, or why none.
    """

    def __init__(self, mode: GraphMode,
                 make_graph: Callable[[torch.device, Callable[[], None]], Graph | None]
                 = graph_for) -> None:
        self.mode = mode
        self.make_graph = make_graph
        self.outcome: GraphOutcome | None = None

    def drive(self, model: nn.Module, recorder: Recorder, store: RowStore,
              batch: BatchedInput, chunks: Iterable[tuple[int, int]],
              label: Callable[[int, int], str], feed: Callable[[Any], Any] | None = None,
              step: Callable[[], object] | None = None, copies: InputCopies | None = None,
              unsuitable: str | None = None) -> str | None:
        """Like :func:`~divtrace.record.loop.drive`; ``unsuitable``: why this run cannot
        be graphed whatever happens (None: it may be)."""
        chunks = list(chunks)
        run = partial(drive, model, recorder, store, batch, label=label, feed=feed,
                      step=step, copies=copies)
        if unsuitable is not None:  # known before anything runs: one eager loop
            self._eager(len(chunks), unsuitable, False)
            return run(chunks)
        kind = run(chunks[:1])
        size = chunks[0][1] - chunks[0][0]
        slot = {sample: index for index, sample in enumerate(store.samples)}
        replayable = [c for c in chunks[1:] if c[1] - c[0] == size
                      and all(row in slot for row in range(*c))]
        reason = self._too_few(len(replayable))
        if reason is None and not all(row in slot for row in range(*chunks[0])):
            reason = "the first pass holds rows that are not compared"
        graphed, tried = None, False
        if reason is None:
            try:
                graphed = self._capture(model, recorder, store, batch, chunks[0], feed,
                                        label, slot)
            except _Failed as failed:
                reason, tried = str(failed), failed.tried
        if graphed is None:
            self._eager(len(chunks), reason, tried)
            run(chunks[1:])
            return kind
        places = set(replayable)
        for start, stop in chunks[1:]:
            if (start, stop) not in places:
                run([(start, stop)])
                continue
            graphed.load(_fed(batch, start, stop, feed), slot[start])
            graphed.graph.replay()
            if step is not None:
                step()
        for stored in graphed.sites:  # each replay filled its rows at every captured site
            stored.filled += size * len(replayable)
        others = len(chunks) - 1 - len(replayable)
        self.outcome = GraphOutcome(
            self.mode, len(chunks), len(replayable), graphed.pool_bytes, graphed.capture_s,
            f"{others} pass(es) of another size, or with rows not compared, ran eagerly"
            if others else None)
        return kind

    def _too_few(self, replayable: int) -> str | None:
        if replayable == 0:
            return "no pass to replay (one pass, or passes of other sizes)"
        if self.mode == "auto" and replayable < MIN_REPLAYS:
            return f"{replayable} pass(es) to replay, too few to pay for a capture"
        return None

    def _eager(self, passes: int, reason: str | None, tried: bool) -> None:
        """The run stays eager: an error under ``graphs=True``, else a note (and a
        warning when a graph was ``tried`` and failed)."""
        if self.mode is True:
            raise DivtraceValueError(
                f"graphs=True, but the split run cannot be replayed from a CUDA graph: "
                f"{reason}. Pass graphs='auto' or False to run it eagerly")
        if tried:
            warnings.warn(f"{reason}; the split run ran eagerly, with the same figures "
                          f"(graphs=False skips the attempt)", DivtraceWarning, stacklevel=7)
        self.outcome = GraphOutcome(self.mode, passes, reason=reason)

    def _capture(self, model: nn.Module, recorder: Recorder, store: RowStore,
                 batch: BatchedInput, first: tuple[int, int],
                 feed: Callable[[Any], Any] | None, label: Callable[[int, int], str],
                 slot: dict[int, int]) -> _Pass:
        """Captures one pass over the first chunk's rows and checks it against the eager
        pass bit for bit (raises :class:`_Failed` with the reason)."""
        began = time.perf_counter()
        leaves = _fed(batch, *first, feed)
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf
                  for leaf in leaves]
        tensors = [leaf for leaf in inputs if isinstance(leaf, torch.Tensor)]
        devices = {t.device for t in tensors}
        args, kwargs = batch.build(inputs)
        graph = (self.make_graph(next(iter(devices)), partial(model, *args, **kwargs))
                 if len(devices) == 1 else None)
        if graph is None:
            raise _Failed("the input is not on one CUDA device", tried=False)
        first_slot = slot[first[0]]
        steps = torch.arange(first[1] - first[0], device=tensors[0].device)
        slots = steps + first_slot
        snapshot = [(stored, _rows(stored).narrow(0, first_slot, len(slots)).clone())
                    for stored in store.rows.values() if stored.rows is not None]
        graphed = _Pass(graph, inputs, slots, steps, [])
        missing: list[str] = []

        def captured() -> None:
            with recorder.observe(store) as tracker:
                store.begin_capture(slots, tracker)
                try:
                    forward(model, args, kwargs, tracker, partial(label, *first), tensors,
                            len(slots))
                finally:
                    graphed.sites, missing[:] = store.end_capture()

        try:
            try:
                graphed.pool_bytes = graph.capture(captured)
            except Exception as exc:  # the capture's own errors, of any type
                first_line = (str(exc).strip() or "\n").splitlines()[0]
                raise _Failed(f"the graph could not be captured ({type(exc).__name__}: "
                              f"{first_line})") from exc
            if missing:
                raise _Failed(f"the graph could not be captured: site '{missing[0]}' is "
                              f"not a batched tensor on the input's device, or the first "
                              f"pass did not show it")
            graphed.load(leaves, first_slot)
            graph.replay()
            _check(snapshot, graphed.sites, first_slot)  # (waits for the replay)
        except _Failed:
            for stored, rows in snapshot:  # the eager pass's rows, whatever ran since
                _rows(stored).narrow(0, first_slot, len(rows)).copy_(rows)
            raise
        graphed.capture_s = time.perf_counter() - began
        return graphed


def _check(snapshot: list[tuple[StoredRows, torch.Tensor]], sites: list[StoredRows],
           first_slot: int) -> None:
    """Every site's rows as the graph wrote them equal the eager pass's, bit for bit;
    otherwise :class:`_Failed` names the first site that differs."""
    copied = {id(stored) for stored in sites}
    unseen = [stored.site.key for stored, _ in snapshot if id(stored) not in copied]
    written = [(_rows(stored).narrow(0, first_slot, len(rows)), rows)
               for stored, rows in snapshot]
    differs = (torch.stack([(_bits(now) != _bits(was)).any() for now, was in written])
               if written else torch.zeros(0, dtype=torch.bool))
    if unseen or bool(differs.any()):
        where = unseen[0] if unseen else snapshot[int(differs.nonzero()[0])][0].site.key
        raise _Failed(f"the graph's pass differed from the eager pass at site '{where}' "
                      f"(not the same kernels, or a model that is not deterministic run to "
                      f"run)")


def _rows(stored: StoredRows) -> torch.Tensor:
    assert stored.rows is not None
    return stored.rows


def _fed(batch: BatchedInput, start: int, stop: int, feed: Callable[[Any], Any] | None
         ) -> list[Any]:
    """The input leaves of rows ``start:stop`` as the run feeds them."""
    leaves = batch.row_leaves(start, stop)
    return leaves if feed is None else [feed(leaf) for leaf in leaves]
