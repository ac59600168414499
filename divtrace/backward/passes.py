"""The two runs of a training step: one backward over the batch, and gradient
accumulation over chunks; the user's loss called on a part of the batch, its weight, and
the parameters' ``.grad`` put back afterwards."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from divtrace.errors import DivtraceTypeError, DivtraceValueError

__all__ = ["Objective", "Step", "backprop", "kept_grads", "part_of", "take_grads", "weighed"]

Loss = Callable[[nn.Module, Any], torch.Tensor]
Weight = Callable[[Any], float]


def part_of(x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A part of the batch as the user gave the batch: a tensor, a tuple or a dict."""
    if isinstance(x, dict):
        return dict(kwargs)
    if isinstance(x, tuple):
        return tuple(args)
    return args[0]


def _scalar(value: Any, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shown = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                 else type(value).__name__)
        raise DivtraceTypeError(
            f"loss(model, part) must return a scalar tensor (the part's loss, e.g. "
            f"lambda m, b: m(**b).loss); {where} it returned {shown}")
    if not value.is_floating_point():
        raise DivtraceTypeError(f"loss(model, part) returned a {value.dtype} tensor {where}; "
                                f"it must be floating point")
    return value.reshape(())


def weighed(weight: Weight | None, part: Any, rows: int, batch: int) -> float:
    """The weight of a part's loss in the accumulated sum: ``weight(part)``, else rows in
    the part over rows in the batch."""
    if weight is None:
        return rows / batch
    value = weight(part)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise DivtraceTypeError(
                f"weight(part) must return a number; it returned a tensor of shape "
                f"{tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value):
        raise DivtraceValueError(f"weight(part) must return a finite number; it returned "
                                 f"{value!r}")
    return float(value)


@dataclass(frozen=True)
class Step:
    """One pass: rows ``start:stop``, its loss and weight (``weight * loss`` was
    backpropagated). The loss stays where it was computed (``value``) until it is read:
    reading it waits for the pass, which a GPU would otherwise still run while the next
    one is queued."""

    start: int
    stop: int
    value: torch.Tensor
    weight: float
    dtype: str

    @property
    def loss(self) -> float:
        """The loss, on the host."""
        return float(self.value.double())

    def row(self) -> dict[str, Any]:
        """The pass as a row of ``Backward.steps``."""
        return {"start": self.start, "stop": self.stop, "loss": self.loss,
                "weight": self.weight, "dtype": self.dtype}


def backprop(value: Callable[[], Any], weight: Weight | None, part: Any, start: int,
             stop: int, size: int) -> Step:
    """``weight(part) * value()`` backpropagated, ``value()`` being the loss of rows
    ``start:stop`` of a batch of ``size`` (weight 1 for the whole batch)."""
    where = f"for rows {start}:{stop}"
    found = _scalar(value(), where)
    if not found.requires_grad:
        raise DivtraceValueError(
            f"loss(model, part) returned a tensor without a gradient {where}: nothing to "
            f"backpropagate (no parameter requires grad, or the loss was computed under "
            f"torch.no_grad())")
    w = 1.0 if stop - start == size else weighed(weight, part, stop - start, size)
    (found * w if w != 1.0 else found).backward()
    return Step(start, stop, found.detach(), w, str(found.dtype).removeprefix("torch."))


@contextmanager
def kept_grads(params: list[tuple[str, nn.Parameter]]) -> Iterator[None]:
    """Each parameter's ``.grad`` as the user left it (None stays None), put back after."""
    before = [(p, p.grad) for _, p in params]
    try:
        for p, _ in before:
            p.grad = None
        yield
    finally:
        for p, grad in before:
            p.grad = grad


def take_grads(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor | None]:
    """The parameters' gradients now (then cleared for the next run)."""
    found = {}
    for name, p in params:
        found[name] = p.grad
        p.grad = None
    return found


class Objective(nn.Module):
    """The model seen through the loss: the same modules, parameters and buffers under
    the same names (shared, not copied), whose forward is ``loss(model, part)``. The
    forward sites of :func:`divtrace.compare` on it are those of the loss's forward pass;
    its own output (the part's loss) is the site ``""``."""

    def __init__(self, model: nn.Module, loss: Loss, x: Any) -> None:
        super().__init__()
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self.training = model.training
        self.__dict__["_objective"] = (model, loss, x)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        model, loss, x = self.__dict__["_objective"]
        value: torch.Tensor = loss(model, part_of(x, args, kwargs))  # checked by backprop
        return value
