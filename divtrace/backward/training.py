"""The training passes of ``compare_backward()``, once each: the split run's chunks (each
``weight(part) * loss(model, part)`` backpropagated, the gradients adding up) and the
batched run (``loss(model, batch)`` backpropagated).

:class:`Passes` makes one training pass with the output gradients watched and keeps what
the weights test needs of it. :class:`Training` is the input's
:class:`~divtrace.plan.inputs.Driver` when the forward sites are compared too: the
comparison's own chunk loop then runs the training passes, so its hooks record the
forward sites in them (no forward pass of their own), and every further pass of the
comparison (the independence test's) is a forward pass only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.backward.grads import GradSites, Output
from divtrace.backward.measure import GradMeter, GradStore
from divtrace.backward.passes import Step, Weight, backprop, part_of, take_grads
from divtrace.plan.inputs import BatchedInput
from divtrace.record.recorder import Gate, Sink, Tracker

__all__ = ["Passes", "Training"]


@dataclass
class Passes:
    """The training passes made so far, and the gradients of each run.

    Attributes:
        split: The split run's passes, in order.
        batched: The batched run's pass (None before it).
        kept: Per split pass, the loss's input (the last leaf output that got a
            gradient, kept with it) for the weights test; None where there was none.
        accumulated: The parameters' gradients after the split run.
        whole: The parameters' gradients after the batched run.
    """

    sites: GradSites
    store: GradStore
    meter: GradMeter
    params: list[tuple[str, nn.Parameter]]
    weight: Weight | None
    x: Any
    batch: BatchedInput
    samples: list[int]
    split: list[Step] = field(default_factory=list)
    batched: Step | None = None
    kept: list[Output | None] = field(default_factory=list)
    accumulated: dict[str, torch.Tensor | None] = field(default_factory=dict)
    whole: dict[str, torch.Tensor | None] = field(default_factory=dict)

    def train(self, start: int, stop: int, value: Callable[[Any], torch.Tensor]) -> Step:
        """Backpropagates ``weight(part) * value(part)`` for rows ``start:stop`` (the
        whole batch: weight 1, after the split run's gradients were taken)."""
        size = self.batch.batch_size
        whole = stop - start == size
        if whole:
            self.accumulated = take_grads(self.params)
        inside = [s for s in self.samples if start <= s < stop]
        sink = self.meter.sink if whole else self.store.sink(inside)
        part = part_of(self.x, *self.batch.rows(start, stop))
        with self.sites.watching(stop - start, [s - start for s in inside], sink):
            step = backprop(lambda: value(part), self.weight, part, start, stop, size)
        if whole:
            self.batched = step
            self.whole = take_grads(self.params)
        else:
            self.split.append(step)
            self.kept.append(next((o for o in reversed(self.sites.outputs)
                                   if o.grad is not None), None))
        self.sites.outputs.clear()
        return step


@dataclass
class _Pass(Gate):
    """The comparison's sink, told of a pass only where it holds compared samples (the
    split run runs every chunk, the comparison keeps only theirs), and told of tensors
    without autograd (its copies and figures stay out of the training graph)."""

    training: Training | None = None

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        assert self.training is not None
        self.active = self.training.begin(start, stop)
        if self.active:
            self.sink.begin_chunk(start, stop, tracker)

    def on_call(self, call: Any, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        with torch.no_grad():
            super().on_call(call, module, args, kwargs, output, tracker)

    def on_tensor(self, site: Any, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            super().on_tensor(site, tensor)

    def end_chunk(self) -> bool:
        return self.sink.end_chunk() if self.active else True


@dataclass
class Training:
    """Runs the comparison's passes as the training passes: the first pass over each
    chunk, and the first over the whole batch, backpropagate (:meth:`Passes.train`);
    any other pass (one asked for again, a probe's) is the forward pass alone, with
    autograd on as in the training passes (some kernels, and PyTorch's fast paths, are
    chosen by whether a gradient is wanted)."""

    passes: Passes
    _trained: set[tuple[int, int]] = field(default_factory=set)
    _current: tuple[int, int] | None = None

    def observed(self, sink: Sink) -> Sink:
        return _Pass(sink, training=self)

    def begin(self, start: int, stop: int) -> bool:
        """A pass over ``start:stop`` begins; whether the comparison is told of it."""
        self._current = None if (start, stop) in self._trained else (start, stop)
        self._trained.add((start, stop))
        return (stop - start == self.passes.batch.batch_size
                or any(start <= s < stop for s in self.passes.samples))

    def run(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            tracker: Tracker) -> Any:
        if self._current is None:
            with torch.enable_grad():
                return model(*args, **kwargs).detach()
        start, stop = self._current
        self._current = None
        with torch.enable_grad():
            step = self.passes.train(start, stop, lambda _part: model(*args, **kwargs))
        return step.value
