"""The weights test: is the split run's weighted sum of losses the batched loss?

A training step's objective is the loss; gradient accumulation backpropagates
``weight(part) * loss(model, part)`` for each chunk instead. Whether those are the same
objective does not depend on the model's rounding, so the test takes rounding out: it
runs the batched loss once more with the output of the loss's input module (the last leaf
module whose output got a gradient; ``lm_head`` in a language model) replaced by the split
run's very rows, and compares the gradient it sends into each chunk's rows with the one
that chunk's weighted loss sent into them in the split run. With the right weights they
are the same numbers up to the few roundings of the loss's own scaling: each chunk's
gradient is the batched one times a ratio within :data:`ULPS` units of roundoff of 1, and
nothing is left over. A token-mean
loss accumulated with row weights gives each chunk the ratio (its share of the rows) /
(its share of the tokens); a loss that mixes samples (a batch statistic, a contrastive
loss) leaves a residual."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn

from divtrace.align.sites import ROOT, flatten_output
from divtrace.backward.grads import Output
from divtrace.backward.passes import Loss, Step, part_of
from divtrace.compat import pytree
from divtrace.plan.inputs import BatchedInput

__all__ = ["ULPS", "Weights", "check_weights"]

#: How many units of roundoff (of the gradient's dtype) a chunk's ratio and residual may
#: be from 1 and 0: the weight and the mean's divisor are each rounded once or twice, the
#: gradient once more where it is cast to the input's dtype.
ULPS = 8


@dataclass(frozen=True)
class Weights:
    """What the weights test found.

    Attributes:
        site: The site whose output was replaced (the loss's input), or None.
        dtype: Its dtype.
        limit: How far from 1 a ratio (and from 0 a residual) may be: ``ULPS`` units of
            roundoff of ``dtype``.
        table: One row per chunk: ``start``, ``stop``, ``weight``, ``ratio`` (the
            chunk's gradient over the batched one's, by least squares), ``residual`` (what
            the ratio leaves, relative), ``max_ulp`` and ``passed``.
        why: Why it could not test, or None.
    """

    site: str | None
    dtype: str | None
    limit: float
    table: pd.DataFrame
    why: str | None = None

    @property
    def passed(self) -> bool | None:
        """True: the same objective; False: not; None: not tested."""
        if self.why is not None:
            return None
        return bool(self.table["passed"].all())

    @property
    def worst(self) -> pd.Series:
        """The chunk whose ratio is furthest from 1."""
        return self.table.loc[(self.table["ratio"] - 1).abs().idxmax()]


def _replaced(output: Any, path: str, by: torch.Tensor) -> Any:
    if path == "":
        return by
    found = {p: t for p, t, _ in flatten_output(output)}
    old = found.get(path)
    return pytree.tree_map(lambda t: by if t is old else t, output)


def _compare(a: torch.Tensor, b: torch.Tensor, limit: float) -> dict[str, Any]:
    from divtrace.measure.stats import ulp_ordered

    a64, b64 = a.flatten().to(torch.float64, copy=True), b.flatten().double()
    norm = float(b64.dot(b64))
    if norm == 0.0:
        same = float(a64.abs().max()) == 0.0 if a64.numel() else True
        return {"ratio": 1.0 if same else float("inf"), "residual": 0.0 if same else 1.0,
                "max_ulp": 0.0 if same else float("inf"), "passed": same}
    apart = a != b  # the ULP distances of the elements that differ only (it is costly)
    ulp = float((ulp_ordered(a[apart]) - ulp_ordered(b[apart])).abs().max()) if bool(
        apart.any()) else 0.0
    ratio = float(a64.dot(b64)) / norm
    residual = float(a64.sub_(b64, alpha=ratio).norm()) / norm ** 0.5
    passed = abs(ratio - 1) <= limit and residual <= limit
    return {"ratio": ratio, "residual": residual, "max_ulp": ulp, "passed": passed}


def _replaced_loss(model: nn.Module, loss: Loss, part: Any, target: nn.Module,
                   chosen: Output, replacement: torch.Tensor) -> torch.Tensor:
    """The part's loss with the chosen call's output replaced. The layers before it run
    without autograd (nothing of theirs is differentiated); grad mode is turned on where
    the replacement goes in, for the loss's own operations, and put back after."""
    calls = [0]

    def hook(_m: nn.Module, _a: Any, output: Any) -> Any:
        calls[0] += 1
        if calls[0] - 1 != chosen.call:
            return None
        torch.set_grad_enabled(True)
        return _replaced(output, chosen.path, replacement)

    handle = target.register_forward_hook(hook)
    try:
        with torch.no_grad():
            value: torch.Tensor = loss(model, part)
        return value
    finally:
        handle.remove()


def _unusable(kept: list[Output | None]) -> str | None:
    """Why the split run's kept outputs cannot be put together into the batch's."""
    if not kept or any(k is None or k.grad is None for k in kept):
        return "no leaf module's output carrying the batch got a gradient in every chunk"
    if len({(k.site.key, k.call, k.path) for k in kept if k is not None}) > 1:
        return "the loss's input was not the output of the same module in every chunk"
    return None


def check_weights(model: nn.Module, loss: Loss, x: Any, batch: BatchedInput,
                  steps: list[Step], kept: list[Output | None]) -> Weights:
    """The batched loss on the split run's outputs of the loss's input, against each
    split pass (``steps``: its rows and the weight it was given) and the gradient it sent
    into them (``kept``, per pass; see the module's text)."""
    why = _unusable(kept)
    if why is not None:
        site = next((k.site.key for k in kept if k is not None), None)
        return Weights(site, None, float("nan"), pd.DataFrame(), why)
    parts = [k for k in kept if k is not None]  # all of them, by now
    chosen, dim = parts[0], batch.batch_dim
    rows = torch.cat([k.tensor.detach() for k in parts], dim).requires_grad_(True)
    limit = ULPS * float(torch.finfo(rows.dtype).eps) / 2
    name = chosen.site.module
    target = model if name == ROOT else dict(model.named_modules())[name]
    value = _replaced_loss(model, loss, part_of(x, *batch.whole()), target, chosen, rows)
    (grad,) = torch.autograd.grad(value, rows, allow_unused=True)
    if grad is None:
        return Weights(chosen.site.key, None, limit, pd.DataFrame(),
                       f"the loss did not depend on the output of {chosen.site.key} "
                       f"when it was replaced")
    found = []
    for step, k in zip(steps, parts, strict=True):
        assert k.grad is not None
        found.append({"start": step.start, "stop": step.stop, "weight": step.weight,
                      **_compare(k.grad, grad.narrow(dim, step.start, step.stop - step.start),
                                 limit)})
    return Weights(chosen.site.key, str(rows.dtype).removeprefix("torch."), limit,
                   pd.DataFrame(found))
