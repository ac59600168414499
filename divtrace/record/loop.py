"""The chunk loop: every recorded or measured run goes through :func:`drive`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import INPUT, flatten_output
from divtrace.compat import pytree
from divtrace.plan.inputs import BatchedInput
from divtrace.record.recorder import Recorder, Sink, Tracker

__all__ = ["drive", "forward"]

Feed = Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            tracker: Tracker, label: Callable[[], str]) -> Any:
    """One forward pass; an exception keeps its type and gains a note naming the pass
    (``label()``, made only then) and the last site it reached."""
    tracker.reset()
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            tracker.produced(INPUT, leaf)
    try:
        return model(*args, **kwargs)
    except Exception as exc:
        where = tracker.last_site or "none (no module had returned yet)"
        exc.add_note(f"divtrace: raised in the {label()}; last site reached: {where}")
        raise


def _as_is(args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def _kind(output: Any) -> str | None:
    """The type of an output that holds no tensor (None when it holds one)."""
    if isinstance(output, torch.Tensor) or flatten_output(output):
        return None
    return type(output).__name__


def drive(model: nn.Module, recorder: Recorder, sink: Sink, batch: BatchedInput,
          chunks: Iterable[tuple[int, int]], label: Callable[[int, int], str],
          feed: Feed = _as_is, step: Callable[[], object] | None = None) -> str | None:
    """Runs rows ``start:stop`` of ``batch`` through ``model`` for each chunk, observed by
    ``recorder`` and handed to ``sink``; a chunk runs again while the sink asks for it.
    Each pass, a rerun too, gets its own copy of the input: a pass that changes its input
    in place changes only its copy.

    Args:
        label: Names the pass over ``start:stop`` in the note of an exception (called
            only then).
        feed: Turns the rows into what the run feeds the model (moved, cast, ...).
        step: Called after each chunk (a progress bar's update).

    Returns:
        The type of the last pass's output when it holds no tensor (else None).
    """
    kind = None
    with recorder.observe(sink) as tracker:
        for start, stop in chunks:
            done = False
            while not done:
                args, kwargs = feed(*batch.rows(start, stop, copy=True))
                sink.begin_chunk(start, stop, tracker)
                output = forward(model, args, kwargs, tracker, partial(label, start, stop))
                done = sink.end_chunk()
            kind = _kind(output)
            del output
            if step is not None:
                step()
    return kind
