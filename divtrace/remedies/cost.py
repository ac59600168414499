"""What a remedy costs: the bare passes of each run, timed under it and without it, in
interleaved rounds on the same device in the same call."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from divtrace.compat import pytree
from divtrace.kinds.registry import kind_of
from divtrace.plan.compiled import Compiled
from divtrace.plan.make import Plan
from divtrace.record.recorder import Sink, Tracker
from divtrace.remedies.remedy import Remedy

__all__ = ["Costs", "costs", "quiet", "sync"]

#: Per remedy: ``(cost, a_cost, output_change)``: run b's passes and run a's passes
#: under the remedy over the same passes without it, and how far the remedy moves run b's
#: first output (its rel_l2 against the same output without the remedy).
Costs = list[tuple[float, float, float]]


@contextmanager
def quiet() -> Iterator[None]:
    """Silences the warnings of ``use_deterministic_algorithms(warn_only=True)``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have a deterministic")
        warnings.filterwarnings("ignore", message=".*deterministic.*CUBLAS_WORKSPACE")
        yield


def sync(devices: set[torch.device]) -> None:
    """Waits for the queued work of the CUDA devices among ``devices`` (a timing's ends)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


#: A pass: its rows and its input.
Pass = tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]


def _passes(plan: Plan, chunks: Sequence[tuple[int, int]]) -> list[Pass]:
    """Each pass's input, copied once (a model that changes its input in place changes
    only these copies)."""
    return [((start, stop), *plan.batch.rows(start, stop, copy=True))
            for start, stop in chunks]


def _first_float(output: Any) -> torch.Tensor | None:
    return next((t for t in pytree.tree_leaves(output)
                 if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


class _Change:
    """How far each remedy moves the first output: kept for the run without a remedy,
    compared at once for the others. ``real`` cuts out what is compared (the prompts'
    real tokens: padded positions hold no result)."""

    def __init__(self, real: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.real = real
        self.reference: torch.Tensor | None = None
        self.found: list[float] = []

    def see(self, output: Any, first: bool) -> None:
        tensor = _first_float(output)
        tensor = None if tensor is None else self.real(tensor.detach())
        if first:
            self.reference = None if tensor is None else tensor.detach().double()
            return
        if tensor is None or self.reference is None or tensor.shape != self.reference.shape:
            self.found.append(math.nan)
            return
        norm = float(self.reference.norm())
        diff = float((tensor.double() - self.reference).norm())
        self.found.append(diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf))


def _timer(model: nn.Module, plan: Plan, which: str, passes: list[Pass],
           devices: set[torch.device]) -> Callable[[Remedy | None, Callable[[Any], object]
                                                    | None], float]:
    """Times run ``which``'s passes as the comparison runs them, without divtrace: in the
    kind's context for the run, through the input's driver where it has one (a token
    layout's forward calls, ``generate()``)."""
    run = plan.a if which == "a" else plan.b
    driver = plan.batch.driver
    chunk = None if driver is None else driver.observed(Sink())  # told, never recording
    nets: dict[int, nn.Module] = {}  # a compiled run: a copy compiled under each remedy

    def net(remedy: Remedy | None) -> nn.Module:
        if id(remedy) not in nets:
            mine = run if remedy is None else getattr(remedy.replanned(plan), which)
            nets[id(remedy)] = replace(mine, copies={}).model(model) if isinstance(
                mine, Compiled) else model
        return nets[id(remedy)]

    def one(mine: nn.Module, rows: tuple[int, int], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        if driver is None:
            return mine(*args, **kwargs)
        tracker = Tracker(lineage=False)
        assert chunk is not None
        chunk.begin_chunk(*rows, tracker)
        return driver.run(mine, args, kwargs, tracker)

    def timed(remedy: Remedy | None, seen: Callable[[Any], object] | None = None) -> float:
        mine = net(remedy)
        within = nullcontext() if remedy is None else remedy.applied(mine)
        with within, kind_of(plan).around(which), run.flags(), torch.no_grad(), quiet():
            sync(devices)
            start = time.perf_counter()
            for index, (rows, args, kwargs) in enumerate(passes):
                output = one(mine, rows, args, kwargs)
                if seen is not None and index == 0:
                    seen(output)
                del output
            sync(devices)
            return time.perf_counter() - start
    return timed


def costs(plan: Plan, model: nn.Module, remedies: Sequence[Remedy], repeats: int,
          step: Callable[[], object] | None = None) -> Costs:
    """Each remedy's cost, from the median of ``repeats`` timings (after one round to
    warm up), the rounds interleaving the bare passes and every remedy."""
    if not remedies:
        return []
    size = plan.batch.batch_size
    devices = {t.device for t in plan.batch.leaves if isinstance(t, torch.Tensor)}
    devices |= {p.device for p in model.parameters()}
    b_chunks = plan.b_chunks or ((0, size),)
    timers = [_timer(model, plan, "b", _passes(plan, b_chunks), devices),
              _timer(model, plan, "a", _passes(plan, plan.a_chunks), devices)]
    everyone: list[Remedy | None] = [None, *remedies]
    seen: list[list[list[float]]] = [[[] for _ in everyone] for _ in timers]
    change = _Change(kind_of(plan).real(plan, b_chunks[0]))
    for index, remedy in enumerate(everyone):  # a round to warm up, seeing the outputs
        timers[0](remedy, partial(change.see, first=index == 0))
        timers[1](remedy, None)
    if step is not None:
        step()
    for round_ in range(repeats):
        order = list(range(len(everyone)))
        order = order[round_ % len(order):] + order[:round_ % len(order)]  # no one first
        for which, timer in enumerate(timers):
            timer(None, None)  # after the other run's passes: not timed
            for index in order:
                seen[which][index].append(timer(everyone[index], None))
        if step is not None:
            step()
    medians = [[statistics.median(times) for times in per] for per in seen]

    return [(medians[0][i] / medians[0][0], medians[1][i] / medians[1][0], change.found[i - 1])
            for i in range(1, len(everyone))]
