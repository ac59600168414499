"""The chunk loop: every recorded or measured run goes through :func:`drive`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import INPUT, flatten_output
from divtrace.compat import BATCH_NORM, version
from divtrace.plan.inputs import BatchedInput, Driver, each_once
from divtrace.record.recorder import Recorder, Sink, Tracker

__all__ = ["InputCopies", "drive", "forward"]


class InputCopies:
    """Whether passes need their own copies of the input, learnt from the first pass.

    The first pass of a comparison gets copies. If it left them as they were (their
    version counters did not move), later passes get views of the user's input: no
    memory, no time. A pass that changes its input in place makes every later pass get
    copies; if it had views, the user's input was changed (:attr:`changed_given`). Inputs
    made under ``torch.inference_mode`` carry no version counter: always copied.
    """

    def __init__(self, batch: BatchedInput) -> None:
        self.copy = True
        self.changed_given = False
        self._settled = any(isinstance(t, torch.Tensor) and t.is_inference()
                            for t in batch.leaves)

    def seen(self, tensors: list[torch.Tensor]) -> list[int]:
        """The version counters of a pass's input tensors, before the pass."""
        return [version(t) for t in tensors]

    def after(self, tensors: list[torch.Tensor], seen: list[int]) -> None:
        """Learns from a pass whether it changed its input in place."""
        moved = any(version(t) != v for t, v in zip(tensors, seen, strict=True))
        if moved:
            self.changed_given |= not self.copy
            self.copy, self._settled = True, True
        elif not self._settled:
            self.copy, self._settled = False, True


def forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            tracker: Tracker, label: Callable[[], str], inputs: list[torch.Tensor],
            rows: int = 0, driver: Driver | None = None, padded: int | None = None) -> Any:
    """One forward pass over ``rows`` rows of the batch; an exception keeps its type and
    gains a note naming the pass (``label()``, made only then) and the last site it
    reached. ``inputs``: the tensors among the arguments (the model's own input, for the
    lineage). ``padded``: the rows the model's own hooks pad the pass to (its tensors
    have that many rows; its input has ``rows``)."""
    tracker.reset(rows)
    for tensor in inputs:
        tracker.produced(INPUT, tensor)
    if padded is not None:
        tracker.rows = padded
    try:
        if driver is not None:
            return driver.run(model, args, kwargs, tracker)
        return model(*args, **kwargs)
    except Exception as exc:
        where = tracker.last_site or "none (no module had returned yet)"
        exc.add_note(f"divtrace: raised in the {label()}; last site reached: {where}")
        raise


def _cut_note(exc: Exception, batch: BatchedInput, rows: int) -> None:
    """A pass over some rows that raised, with the inputs cut along another dimension than
    the first: says so (a channel or token axis cut by mistake is a common cause)."""
    if rows == batch.batch_size or batch.batch_dim == 0 or not hasattr(batch, "dims"):
        return
    exc.add_note(f"divtrace: the inputs were cut along batch_dim={batch.batch_dim} (B="
                 f"{batch.batch_size} there) into passes of {rows}; if that is not the "
                 f"batch dimension, pass the right one (batch_dim=0 for [B, C, H, W] images)")


def _dtype_note(exc: Exception, model: nn.Module, tensors: list[torch.Tensor]) -> None:
    """A pass that raised with floating inputs of another dtype than the model's
    parameters: says so (x float64 from NumPy into a float32 model is common)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    given = {t.dtype for t in tensors if t.is_floating_point()}
    if dtype is not None and given and dtype not in given:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in given))
        exc.add_note(f"divtrace: the input is {names} and the model's parameters are "
                     f"{str(dtype).removeprefix('torch.')}: cast one to the other (e.g. "
                     f"x.to({dtype}))")


def _train_note(exc: Exception, model: nn.Module, rows: int) -> None:
    """A pass of one row that raised with BatchNorm in train mode (allowed by
    ``allow_train=True``): batch statistics need two rows or more."""
    if rows != 1:
        return
    norm = next(((name, module) for name, module in model.named_modules()
                 if module.training and isinstance(module, BATCH_NORM)), None)
    if norm is not None:
        exc.add_note(f"divtrace: '{norm[0]}' ({type(norm[1]).__name__})"
                     f" is in train mode, where a batch statistic needs two rows or more: "
                     f"split in chunks of 2 or more (a=divtrace.Run(chunk=2)), or call "
                     f"model.eval()")


def _kind(output: Any) -> str | None:
    """The type of an output that holds no tensor (None when it holds one)."""
    if isinstance(output, torch.Tensor) or flatten_output(output):
        return None
    return type(output).__name__


def drive(model: nn.Module, recorder: Recorder, sink: Sink, batch: BatchedInput,
          chunks: Iterable[tuple[int, int]], label: Callable[[int, int], str],
          feed: Callable[[Any], Any] | None = None, step: Callable[[], object] | None = None,
          copies: InputCopies | None = None) -> str | None:
    """Runs rows ``start:stop`` of ``batch`` through ``model`` for each chunk, observed by
    ``recorder`` and handed to ``sink``; a chunk runs again while the sink asks for it.

    Args:
        label: Names the pass over ``start:stop`` in the note of an exception (called
            only then).
        feed: Turns each input leaf into what the run feeds the model (moved, cast, ...;
            None: as it is).
        step: Called after each chunk (a progress bar's update).
        copies: Whether passes get copies of the input (default: always), so that a pass
            that changes its input in place changes only its copy.

    Returns:
        The type of the last pass's output when it holds no tensor (else None).
    """
    copies = copies or InputCopies(batch)
    kind = None
    driver = batch.driver
    if driver is not None:
        sink = driver.observed(sink)
    with recorder.observe(sink) as tracker:
        for start, stop in chunks:
            done = False
            while not done:  # a rerun gets the input as given too
                leaves = batch.row_leaves(start, stop, copies.copy)
                if feed is not None:
                    leaves = each_once(leaves, feed)
                tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
                seen = copies.seen(tensors)
                sink.begin_chunk(start, stop, tracker)
                rows = sink.pass_rows(start, stop)
                try:
                    output = forward(model, *batch.build(leaves), tracker,
                                     partial(label, start, stop), tensors, stop - start,
                                     driver, None if rows == stop - start else rows)
                except Exception as exc:
                    _cut_note(exc, batch, stop - start)
                    _dtype_note(exc, model, tensors)
                    _train_note(exc, model, stop - start)
                    raise
                copies.after(tensors, seen)
                done = sink.end_chunk()
            kind = _kind(output)
            del output
            if step is not None:
                step()
    return kind
