"""``compare_backward()``: one backward over the batch against gradient accumulation over
chunks — the loss, every module's output gradient per sample, every parameter's
gradient, the weights test, and the forward sites."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.backward.grads import GradSites
from divtrace.backward.measure import GradMeter, GradStore, loss_row, param_rows
from divtrace.backward.passes import Loss, Objective, Step, kept_grads, run_step, take_grads
from divtrace.backward.result import Backward
from divtrace.backward.weights import check_weights
from divtrace.compare import compare
from divtrace.errors import BatchMixingError, DivtraceTypeError
from divtrace.measure.host import Host
from divtrace.plan.inputs import prepare_input
from divtrace.plan.runs import Resources, Run
from divtrace.plan.samples import check_chunk, chunks_for, prepare_samples
from divtrace.plan.selection import refuse_mixing
from divtrace.plan.walk import Walk
from divtrace.progress import Progress
from divtrace.record.guard import RandomDraws, cuda_devices, untouched

__all__ = ["compare_backward"]

_OUTPUTS_KEPT = 8  # the last leaf outputs a batched pass keeps for the weights test


def _checked(model: Any, loss: Any, weight: Any, allow_train: bool) -> None:
    if not isinstance(model, nn.Module):
        raise DivtraceTypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(loss):
        raise DivtraceTypeError(
            f"loss must be a callable loss(model, part) -> scalar tensor (e.g. lambda m, b: "
            f"m(**b).loss, or lambda m, b: F.mse_loss(m(b[0]), b[1])); got "
            f"{type(loss).__name__}")
    if weight is not None and not callable(weight):
        raise DivtraceTypeError(
            f"weight must be a callable weight(part) -> number (e.g. lambda part: "
            f"tokens in part / tokens in the batch); got {type(weight).__name__}")
    refuse_mixing(model.named_modules(), allow_train,
                  apart="one backward over the batch and accumulation would differ",
                  fix="Call model.eval() first (gradients flow in eval mode too)")


def _steps(split: list[Step], batched: Step) -> pd.DataFrame:
    rows = [{"run": "split", **vars(s)} for s in split]
    rows.append({"run": "batched", **vars(batched)})
    return pd.DataFrame(rows)


def compare_backward(
    model: nn.Module,
    batch: Any,
    loss: Loss,
    *,
    chunk: int,
    samples: Iterable[int] | None = None,
    weight: Callable[[Any], float] | None = None,
    batch_dim: int = 0,
    forward: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    allow_train: bool = False,
    progress: bool = True,
) -> Backward:
    """One backward over ``batch`` against gradient accumulation over chunks of
    ``chunk`` rows, compared layer by layer.

    The batched run backpropagates ``loss(model, batch)`` once; the split run
    backpropagates ``weight(part) * loss(model, part)`` for each chunk, the gradients
    adding up in ``.grad`` as accumulation does. Compared: the loss (batched against the
    weighted losses summed), each module output's gradient for the compared samples, each
    parameter's gradient, and with ``forward`` the forward sites (as
    :func:`divtrace.compare` finds them, with the independence test, on the loss's forward
    pass). The weights test runs each chunk's loss again on the batched run's very
    outputs, to tell a wrong weighting (not rounding) from rounding. The parameters, their
    ``.grad`` (None stays None), buffers, training flags and random state come back as
    they were; no optimizer is used.

    Args:
        model: The model (eval mode, or train mode without dropout or batch norm).
        batch: A tensor, a tuple or a dict, cut along ``batch_dim`` as ``compare()``
            cuts its input.
        loss: ``loss(model, part) -> scalar tensor``: the forward pass and the loss on a
            part of the batch (a tensor, tuple or dict like ``batch``).
        chunk: Rows per micro-batch of the split run.
        samples: The rows whose output gradients are compared (default: all).
        weight: ``weight(part) -> number``, each chunk's weight (default: rows in the
            part / rows in the batch, right for a mean over rows; for a mean over tokens,
            tokens in the part / tokens in the batch).
        batch_dim: The batch dimension of the inputs and of the modules' outputs.
        forward: Also compare the forward sites (three or four forward passes more).
        rtol, atol: Tolerances of the ``exceed`` column (as for ``compare()``).
        allow_train: Compare a model that draws random numbers or mixes samples anyway.
        progress: Show a progress bar on stderr.

    Returns:
        A :class:`~divtrace.backward.result.Backward`.

    Example:
        >>> import torch, divtrace
        >>> torch.manual_seed(0) and None
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
        ...                           torch.nn.Linear(8, 1))
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> found = divtrace.compare_backward(net, (x, y), mse, chunk=2, progress=False)
        >>> found.verdict.kind in ("identical", "rounding"), found.weights.passed
        (True, True)
    """
    _checked(model, loss, weight, allow_train)
    cut = prepare_input(batch, batch_dim)
    size = cut.batch_size
    step = check_chunk(chunk, size)
    rows = prepare_samples(samples, size)
    chunks = chunks_for(list(range(size)), step, size)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    types = {name or ROOT: type(m).__name__ for name, m in model.named_modules()}
    walk = Walk.of(model)
    devices = cuda_devices((walk,), cut.leaves)
    sites = GradSites(model, batch_dim, keep=_OUTPUTS_KEPT)
    store = GradStore()
    host = Host()
    meter = GradMeter(store, rows, host, rtol, atol)
    with Progress(2 * len(chunks) + 1, progress) as bar:
        with untouched(walk, devices), kept_grads(params), torch.enable_grad():
            draws = RandomDraws(devices)
            bar.stage("split run (accumulation)")
            split = []
            for start, stop in chunks:
                inside = [s for s in rows if start <= s < stop]
                with sites.watching(stop - start, [s - start for s in inside],
                                    store.sink(inside)):
                    split.append(run_step(model, loss, weight, batch, cut, start, stop))
                bar.advance()
            accumulated = take_grads(params)
            bar.stage("batched run")
            with sites.watching(size, rows, meter.sink):
                batched = run_step(model, loss, weight, batch, cut, 0, size)
            if draws.drew() and not allow_train:
                raise BatchMixingError(
                    "the model drew random numbers in its training passes (dropout in "
                    "train mode, torch.rand, ...): the two runs would differ for reasons "
                    "that are not numerical. Call model.eval(), or pass allow_train=True")
            bar.advance()
            whole = take_grads(params)
            chosen = next((o for o in reversed(sites.outputs) if o.grad is not None), None)
            bar.stage("weights test")
            weights = check_weights(model, loss, batch, cut,
                                    [(s.start, s.stop, s.weight) for s in split], chosen,
                                    bar.advance)
        sites.outputs.clear()
        pending = [*meter.found, *param_rows(whole, accumulated, types, host, rtol, atol)]
        host.fetch()  # the one host synchronisation of the figures
        table = pd.DataFrame([loss_row(batched.loss, sum(s.loss * s.weight for s in split),
                                       batched.dtype), *(p.row() for p in pending)])
    seen, why = _forward(model, loss, batch, rows, batch_dim, step, forward, rtol, atol,
                         allow_train, progress)
    said = "rows in part / rows in batch" if weight is None else "weight(part)"
    settings = {"batch_size": size, "chunk": step, "samples": rows, "weight": said,
                "batch_dim": batch_dim}
    return Backward(table, _steps(split, batched), weights, seen, settings, why)


def _forward(model: nn.Module, loss: Loss, batch: Any, rows: list[int], batch_dim: int,
             chunk: int, wanted: bool, rtol: float | None, atol: float | None,
             allow_train: bool, progress: bool) -> tuple[Any, str | None]:
    if not wanted:
        return None, "forward=False"
    if next(model.children(), None) is None:
        return None, "the model is one module: its output is the loss's input"
    found = compare(Objective(model, loss, batch), batch, samples=rows, batch_dim=batch_dim,
                    a=Run(chunk=chunk), rtol=rtol, atol=atol, allow_train=allow_train,
                    resources=Resources(graphs=False), progress=progress)
    return found, None
