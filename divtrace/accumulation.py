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
from divtrace.backward.passes import Loss, Objective, Step, kept_grads
from divtrace.backward.result import Backward
from divtrace.backward.training import Passes, Training
from divtrace.backward.weights import check_weights
from divtrace.errors import BatchMixingError, DivtraceTypeError
from divtrace.kinds.accumulation import Accumulation
from divtrace.measure.host import Host
from divtrace.pipeline import execute
from divtrace.plan.inputs import prepare_input
from divtrace.plan.make import make_plan
from divtrace.plan.runs import Resources, Run
from divtrace.plan.samples import check_chunk, chunks_for, prepare_samples
from divtrace.plan.selection import refuse_mixing
from divtrace.plan.walk import Walk
from divtrace.progress import Progress
from divtrace.record.guard import RandomDraws, cuda_devices, untouched
from divtrace.report.comparison import Comparison

__all__ = ["compare_backward"]

_OUTPUTS_KEPT = 8  # the last leaf outputs a pass keeps, for the weights test


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
    rows = [{"run": "split", **s.row()} for s in split]
    rows.append({"run": "batched", **batched.row()})
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
    pass, recorded in the training passes themselves). The weights test runs the batched
    loss again on the split run's very outputs of the loss's input, to tell a wrong
    weighting (not rounding) from rounding. The parameters, their
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
        forward: Also compare the forward sites, recorded in the training passes (the
            independence test's two forward passes more).
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
    host = Host()
    store = GradStore()
    passes = Passes(GradSites(model, batch_dim, keep=_OUTPUTS_KEPT), store,
                    GradMeter(store, rows, host, rtol, atol), params, weight, batch, cut,
                    rows)
    why = ("forward=False" if not forward else "the model is one module: its output is "
           "the loss's input" if next(model.children(), None) is None else None)
    with untouched(walk, devices), kept_grads(params):
        if why is None:
            seen = _compared(model, loss, batch, passes, chunks, rtol, atol, allow_train,
                             progress)
        else:
            seen = None
            _trained(model, loss, passes, chunks, allow_train, devices, progress)
        with Progress(1, progress) as bar, torch.enable_grad():
            bar.stage("weights test")
            weights = check_weights(model, loss, batch, cut, passes.split, passes.kept)
            bar.advance()
        passes.kept.clear()
        pending = [*passes.meter.found,
                   *param_rows(passes.whole, passes.accumulated, types, host, rtol, atol)]
        host.fetch()  # the one host synchronisation of the figures
        batched = passes.batched
        assert batched is not None
        table = pd.DataFrame([loss_row(batched.loss, sum(s.loss * s.weight
                                                         for s in passes.split),
                                       batched.dtype), *(p.row() for p in pending)])
    said = "rows in part / rows in batch" if weight is None else "weight(part)"
    settings = {"batch_size": size, "chunk": step, "samples": rows, "weight": said,
                "batch_dim": batch_dim}
    return Backward(table, _steps(passes.split, batched), weights, seen, settings, why)


def _trained(model: nn.Module, loss: Loss, passes: Passes, chunks: list[tuple[int, int]],
             allow_train: bool, devices: Any, progress: bool) -> None:
    """The training passes alone (no forward site compared): the split run's, then the
    batched run's."""
    with Progress(len(chunks) + 1, progress) as bar, torch.enable_grad():
        draws = RandomDraws(devices)
        bar.stage("split run (accumulation)")
        for start, stop in chunks:
            passes.train(start, stop, lambda part: loss(model, part))
            bar.advance()
        bar.stage("batched run")
        passes.train(0, passes.batch.batch_size, lambda part: loss(model, part))
        bar.advance()
    if draws.drew() and not allow_train:
        raise BatchMixingError(
            "the model drew random numbers in its training passes (dropout in train mode, "
            "torch.rand, ...): the two runs would differ for reasons that are not "
            "numerical. Call model.eval(), or pass allow_train=True")


def _compared(model: nn.Module, loss: Loss, x: Any, passes: Passes,
              chunks: list[tuple[int, int]], rtol: float | None, atol: float | None,
              allow_train: bool, progress: bool) -> Comparison:
    """The training passes run by the comparison of the loss's forward pass, whose hooks
    record the forward sites in them (see :mod:`divtrace.backward.training`): every
    chunk of the split run, then the batched run, then the independence test's forward
    passes. The observer check is left out: a training pass takes no fast path that hooks
    could turn off (PyTorch's are for passes without autograd)."""
    objective = Objective(model, loss, x)
    kind = Accumulation(Training(passes), tuple(chunks))
    plan = make_plan(objective, x, samples=passes.samples, batch_dim=passes.batch.batch_dim,
                     a=Run(chunk=chunks[0][1]), explain=["-observer"], rtol=rtol, atol=atol,
                     allow_train=allow_train, resources=Resources(graphs=False),
                     progress=progress, kind=kind)
    return execute(plan, objective)
