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

__all__ = ["drive", "forward", "fresh"]

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


def fresh(args: tuple[Any, ...], kwargs: dict[str, Any]
          ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of every tensor in ``(args, kwargs)``: a pass that changes its input in place
    changes only its own copy, and every pass sees the input as the user gave it."""
    copied = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                             (args, kwargs))
    return copied[0], copied[1]


def _as_is(args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def drive(model: nn.Module, recorder: Recorder, sink: Sink, batch: BatchedInput,
          chunks: Iterable[tuple[int, int]], label: Callable[[int, int], str],
          feed: Feed = _as_is, step: Callable[[], object] | None = None,
          after: Callable[[Callable[[], str]], object] | None = None) -> str | None:
    """Runs rows ``start:stop`` of ``batch`` through ``model`` for each chunk, observed by
    ``recorder`` and handed to ``sink``; a chunk runs again while the sink asks for it.
    Each pass gets its own copy of the input.

    Args:
        label: Names the pass over ``start:stop`` in the note of an exception (called
            only then).
        feed: Turns the rows into what the run feeds the model (moved, cast, ...).
        step: Called after each chunk (a progress bar's update).
        after: Called after each pass with the pass's label (e.g. a check that raises).

    Returns:
        The type of the last pass's output when it holds no tensor (else None).
    """
    kind = None
    with recorder.observe(sink) as tracker:
        for start, stop in chunks:
            given = feed(*batch.rows(start, stop))
            done = False
            while not done:  # a pass run again gets a fresh copy of the input too
                args, kwargs = fresh(*given)
                sink.begin_chunk(start, stop, tracker)
                output = forward(model, args, kwargs, tracker, partial(label, start, stop))
                if after is not None:
                    after(partial(label, start, stop))
                done = sink.end_chunk()
            kind = None if flatten_output(output) else type(output).__name__
            del output
            if step is not None:
                step()
    return kind
