"""Output gradients at every module, per sample: a forward hook on each module puts a hook
on each of its output tensors that carries the batch, and that hook sees the tensor's
gradient in the backward pass. The compared samples' rows of it go to a sink."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import ROOT, flatten_output, site_key

__all__ = ["GradSite", "GradSites", "Output"]


@dataclass(frozen=True)
class GradSite:
    """Where a gradient was seen: the output tensor of one module call."""

    key: str
    module: str
    module_type: str


@dataclass
class Output:
    """A leaf module's output tensor in one pass, kept (not copied) while the pass lasts:
    the candidates for the loss's input (see :mod:`divtrace.backward.weights`)."""

    site: GradSite
    call: int
    path: str
    tensor: torch.Tensor
    grad: torch.Tensor | None = None


@dataclass
class GradSites:
    """Hooks ``model``'s modules for one pass at a time (:meth:`watching`).

    Args:
        model: The user's model (its root included: a model that is one layer).
        batch_dim: The dimension of a module's output that holds the samples.
        keep: How many of the last leaf outputs a pass keeps (with their gradients).
    """

    model: nn.Module
    batch_dim: int
    keep: int = 0
    outputs: deque[Output] = field(default_factory=deque)

    @contextmanager
    def watching(self, rows: int, compared: list[int],
                 sink: Callable[[GradSite, torch.Tensor], None]) -> Iterator[None]:
        """Hooks every module while a pass over ``rows`` samples runs: ``sink(site,
        grad_rows)`` gets the gradient of each batch-carrying output, cut to the pass's
        ``compared`` rows (local indices, ascending), batch dimension first, in the order
        the backward pass reaches them: a view of the gradient when every row is compared
        (valid while the sink runs), else a copy."""
        self.outputs = deque(maxlen=self.keep or None)
        calls: dict[str, int] = {}
        handles: list[Any] = []
        index = torch.tensor(compared, dtype=torch.long)
        on_device: dict[torch.device, torch.Tensor] = {}

        def rows_of(grad: torch.Tensor) -> torch.Tensor:
            if len(compared) == rows:  # every row (in order): a view
                return grad.detach().movedim(self.batch_dim, 0)
            found = on_device.get(grad.device)
            if found is None:
                found = on_device[grad.device] = index.to(grad.device)
            return grad.detach().index_select(self.batch_dim, found).movedim(self.batch_dim, 0)

        def arrived(site: GradSite, seen: Output | None, grad: torch.Tensor) -> None:
            if seen is not None:
                seen.grad = grad.detach()
            if compared:
                with torch.no_grad():
                    sink(site, rows_of(grad))

        def hook_for(name: str, module: nn.Module) -> Callable[..., None]:
            leaf = next(module.children(), None) is None

            def hook(_module: nn.Module, _args: Any, output: Any) -> None:
                call = calls.get(name, 0)
                calls[name] = call + 1
                for path, tensor, opaque in flatten_output(output):
                    if (opaque is not None or not tensor.requires_grad
                            or not tensor.is_floating_point()
                            or tensor.dim() <= self.batch_dim
                            or tensor.shape[self.batch_dim] != rows):
                        continue
                    site = GradSite(site_key(name, call, path), name, type(module).__name__)
                    seen = None
                    if leaf and self.keep:
                        seen = Output(site, call, path, tensor)
                        self.outputs.append(seen)
                    handles.append(tensor.register_hook(
                        lambda g, s=site, o=seen: arrived(s, o, g)))

            return hook

        try:
            for name, module in self.model.named_modules():
                handles.append(module.register_forward_hook(hook_for(name or ROOT, module)))
            yield
        finally:
            for handle in handles:
                handle.remove()
