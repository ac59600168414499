"""The split run as a CUDA graph: a few passes captured side by side, their recording
copies inside, then replayed for every group of chunks.

A per-sample run is bound by kernel launches and by Python (the model's and the hooks'),
and a pass over one sample leaves most of a large GPU idle. Here the first chunk runs
eagerly, as always; then as many passes of the same size as there are *lanes* are
captured as one CUDA graph, each lane on a stream of its own, with every site's copy into
the row store inside the graph (each row to the slot a device tensor names, set before
each replay). Each further group of chunks is its rows copied into the lanes' inputs,
their slots set, and one replay: the lanes' passes run concurrently, each with the very
kernels of an eager pass alone.

Truthfulness first: the graph replays the captured kernels, which should be the eager
pass's. Before any chunk is replayed, every lane runs the first chunk again and every site
of every lane is compared bit for bit with the eager pass; on any difference, or when the
capture fails (a host synchronisation, a tensor not on the GPU, ...), the rest of the run
is eager and the outcome says why (``Resources(graphs=True)`` raises instead; a capture of
several lanes that runs out of memory is tried again with one).
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

from divtrace.errors import DivtraceValueError, DivtraceWarning, user_level
from divtrace.plan.checks import GraphMode
from divtrace.plan.inputs import BatchedInput, each_once
from divtrace.record.cudagraph import Graph, graph_for
from divtrace.record.lanes import Captured, Lane, first_difference, rows_of
from divtrace.record.loop import InputCopies, drive, forward
from divtrace.record.recorder import Recorder
from divtrace.record.rows import RowStore

__all__ = ["MAX_LANES", "GraphOutcome", "GraphedRun", "lanes_for"]

#: Under ``"auto"``, the fewest passes a graph must replay to pay for its capture (a
#: warm-up pass, a pass captured per lane, the check): on an H200, a small MLP's 7
#: replayed passes cost more than they saved (``benchmarks/graphs.py``).
MIN_REPLAYS = 8

#: The most passes one replay runs side by side. Each lane is one pass captured (its
#: Python, the model's and the hooks', runs once per lane) and one pass's activations in
#: the graph's pool; on an H200, 4 lanes made AlexNet's and ResNet50's per-sample
#: comparisons fastest, 8 cost more to capture than they saved.
MAX_LANES = 4


def lanes_for(passes: int) -> int:
    """How many lanes a run of ``passes`` passes of one size gets: at most
    :data:`MAX_LANES`, and no more than a quarter of the passes (each lane's capture
    costs about an eager pass)."""
    return max(1, min(MAX_LANES, passes // 4))


@dataclass(frozen=True)
class GraphOutcome:
    """How one chunked run went: replayed from a CUDA graph or eager, and why.

    Attributes:
        requested: The ``graphs=`` option.
        passes: The run's passes.
        replayed: The passes replayed from the graph (0: the run was eager).
        lanes: The passes each replay ran side by side (0: the run was eager).
        pool_bytes: GPU memory the graph's own pool took (its pass's activations).
        capture_s: Seconds spent on the graph before its first replay (a warm-up pass,
            the capture, the check against the eager pass).
        reason: Why passes ran eagerly (None: every pass after the first was replayed).
    """

    requested: GraphMode
    passes: int
    replayed: int = 0
    lanes: int = 0
    pool_bytes: int = 0
    capture_s: float = 0.0
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class _Failed(Exception):
    """The graph cannot stand for the eager pass; the message says why. ``tried``: a
    graph was made and failed (a warning), rather than none could be made; ``memory``: it
    ran out of GPU memory."""

    def __init__(self, reason: str, tried: bool = True, memory: bool = False) -> None:
        super().__init__(reason)
        self.tried = tried
        self.memory = memory


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
        size = chunks[0][1] - chunks[0][0]
        slot = {sample: index for index, sample in enumerate(store.samples)}
        fits = [c[1] - c[0] == size and all(row in slot for row in range(*c))
                for c in chunks]
        kind = run(chunks[:1])  # eager: the pass the graph's lanes are checked on
        replayable = [c for c, fit in zip(chunks[1:], fits[1:], strict=True) if fit]
        reason = self._too_few(len(replayable))
        if reason is None and not fits[0]:
            reason = "the first pass holds rows that are not compared"
        graphed, tried = None, False
        if reason is None:
            lanes = [chunks[0], *replayable[:lanes_for(len(replayable) + 1) - 1]]
            try:
                graphed = self._narrowing(model, recorder, store, batch, lanes, feed,
                                          label, slot)
            except _Failed as failed:
                reason, tried = str(failed), failed.tried
        if graphed is None:
            self._eager(len(chunks), reason, tried)
            if len(chunks) > 1:  # (no pass left: the hooks are not attached for nothing)
                run(chunks[1:])
            return kind
        try:
            self._replay(graphed, chunks, fits, run, batch, feed, step, slot)
        finally:
            graphed.graph.release()  # now, not whenever the garbage collector runs
        for stored in graphed.lanes[0].sites:  # every lane's rows at every captured site
            stored.filled += size * len(replayable)
        others = len(chunks) - 1 - len(replayable)
        self.outcome = GraphOutcome(
            self.mode, len(chunks), len(replayable), len(graphed.lanes),
            graphed.pool_bytes, graphed.capture_s,
            f"{others} pass(es) of another size, or with rows not compared, ran eagerly"
            if others else None)
        return kind

    @staticmethod
    def _replay(graphed: Captured, chunks: list[tuple[int, int]], fits: list[bool],
                run: Callable[[list[tuple[int, int]]], object], batch: BatchedInput,
                feed: Callable[[Any], Any] | None, step: Callable[[], object] | None,
                slot: dict[int, int]) -> None:
        """Replays the chunks after the first in groups of one chunk per lane; a chunk
        that does not fit runs eagerly. A last, short group takes the chunks before it
        again (written again with the same bits: the check showed that the graph's
        passes are the eager ones)."""
        width = len(graphed.lanes)
        last = max(index for index, fit in enumerate(fits) if fit)
        done, fresh = [chunks[0]], 0
        for index in range(1, len(chunks)):
            if not fits[index]:
                run([chunks[index]])
                continue
            done.append(chunks[index])
            fresh += 1
            if fresh == width or index == last:
                group = done[-width:]
                graphed.replay([_fed(batch, *c, feed) for c in group],
                               [slot[c[0]] for c in group])
                for _ in range(fresh):
                    if step is not None:  # a progress bar counts each pass
                        step()
                fresh = 0

    def _too_few(self, replayable: int) -> str | None:
        if replayable == 0:
            return "no pass to replay (one pass, or passes of other sizes)"
        if self.mode == "auto" and replayable < MIN_REPLAYS:
            return f"{replayable} pass(es) to replay, too few to pay for a capture"
        return None

    def _eager(self, passes: int, reason: str | None, tried: bool) -> None:
        """The run stays eager: an error under ``Resources(graphs=True)``, else a note (and a
        warning when a graph was ``tried`` and failed)."""
        if self.mode is True:
            raise DivtraceValueError(
                f"Resources(graphs=True), but the split run cannot be replayed from a CUDA "
                f"graph: {reason}. Pass Resources(graphs='auto') or False to run it eagerly")
        if tried:
            warnings.warn(f"{reason}; the split run ran eagerly, with the same figures "
                          f"(Resources(graphs=False) skips the attempt)", DivtraceWarning,
                          stacklevel=user_level())
        self.outcome = GraphOutcome(self.mode, passes, reason=reason)

    def _narrowing(self, model: nn.Module, recorder: Recorder, store: RowStore,
                   batch: BatchedInput, lanes: list[tuple[int, int]],
                   feed: Callable[[Any], Any] | None, label: Callable[[int, int], str],
                   slot: dict[int, int]) -> Captured:
        """:meth:`_capture`, with one lane when the GPU's memory does not hold the
        activations of all of them."""
        try:
            return self._capture(model, recorder, store, batch, lanes, feed, label, slot)
        except _Failed as failed:
            if not failed.memory or len(lanes) == 1:
                raise
        # (the failed graph's pool is freed: the allocator hands its memory to the next)
        return self._capture(model, recorder, store, batch, lanes[:1], feed, label, slot)

    def _capture(self, model: nn.Module, recorder: Recorder, store: RowStore,
                 batch: BatchedInput, lanes: list[tuple[int, int]],
                 feed: Callable[[Any], Any] | None, label: Callable[[int, int], str],
                 slot: dict[int, int]) -> Captured:
        """Captures one pass per lane, each writing to the slots of its chunk in
        ``lanes``, and checks them: every lane is fed the first chunk (``lanes[0]``, run
        eagerly before) and must write its rows bit for bit (raises :class:`_Failed`
        with the reason). The other lanes' slots are written again later."""
        began = time.perf_counter()
        first = lanes[0]
        leaves = _fed(batch, *first, feed)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise _Failed("the input is not on one CUDA device", tried=False)
        device, size = next(iter(devices)), first[1] - first[0]
        args, kwargs = batch.build(leaves)
        graph = self.make_graph(device, partial(model, *args, **kwargs))
        if graph is None:
            raise _Failed("the input is not on one CUDA device", tried=False)
        captured = Captured(graph, [])
        for chunk in lanes:
            steps = torch.arange(size, device=device)
            captured.lanes.append(Lane(each_once(leaves, _clone),
                                       steps + slot[chunk[0]], steps, []))
        snapshot = [(stored, rows_of(stored).narrow(0, slot[first[0]], size).clone())
                    for stored in store.rows.values() if stored.rows is not None]
        missing: list[str] = []

        def capture() -> None:
            with recorder.observe(store) as tracker:
                for index, lane in enumerate(captured.lanes):
                    inputs = [t for t in lane.inputs if isinstance(t, torch.Tensor)]
                    with graph.lane(index):
                        store.begin_capture(lane.slots, tracker)
                        try:
                            forward(model, *batch.build(lane.inputs), tracker,
                                    partial(label, *first), inputs, size)
                        finally:
                            lane.sites, unseen = store.end_capture()
                            missing.extend(unseen)

        try:
            self._captured(captured, capture, missing)
            firsts = [slot[chunk[0]] for chunk in lanes]
            captured.replay([leaves] * len(lanes), firsts)  # every lane on the first chunk
            where = first_difference(snapshot, captured.lanes)
            if where is not None:  # (waited for the replay)
                raise _Failed(f"the graph's pass differed from the eager pass at site "
                              f"'{where}' (not the same kernels, or a model that is not "
                              f"deterministic run to run)")
        except _Failed:
            for stored, was in snapshot:  # the eager pass's rows, whatever ran since
                rows_of(stored).narrow(0, slot[first[0]], size).copy_(was)
            graph.release()
            raise
        captured.capture_s = time.perf_counter() - began
        return captured

    @staticmethod
    def _captured(captured: Captured, capture: Callable[[], None], missing: list[str]
                  ) -> None:
        """Runs the capture; :class:`_Failed` says why it failed."""
        try:
            captured.pool_bytes = captured.graph.capture(capture)
        except Exception as exc:  # the capture's own errors, of any type
            first_line = (str(exc).strip() or "\n").splitlines()[0]
            raise _Failed(f"the graph could not be captured ({type(exc).__name__}: "
                          f"{first_line})",
                          memory=isinstance(exc, torch.OutOfMemoryError)) from exc
        if missing:
            raise _Failed(f"the graph could not be captured: site '{missing[0]}' is not a "
                          f"batched tensor on the input's device, the first pass did not "
                          f"show it, or it no longer hands on the tensor of the site "
                          f"before it")


def _fed(batch: BatchedInput, start: int, stop: int, feed: Callable[[Any], Any] | None
         ) -> list[Any]:
    """The input leaves of rows ``start:stop`` as the run feeds them."""
    leaves = batch.row_leaves(start, stop)
    return leaves if feed is None else each_once(leaves, feed)


def _clone(leaf: Any) -> Any:
    return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf
