"""The least a recorder does, without any divtrace code: passes with a forward hook on
every module, or traced with ``torch.fx`` with a call after every leaf module's call;
each doing nothing with the output, or copying its compared rows (rows 0 and 1).

Neither keeps whole outputs: holding every tensor of the passes would cost fresh pages on
the CPU (about 0.3× mobilenet_v3_small's bare passes), which no recorder that copies rows
pays. Used by ``many_sites.py`` and ``recorder_floor.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

__all__ = ["KEPT", "copy_rows", "hooked", "observe", "passes", "traced"]

#: The rows the copying ways keep, until the passes end.
KEPT: list[object] = []


def passes(model: torch.nn.Module, x: torch.Tensor, chunk: int = 1,
           batched: torch.nn.Module | None = None) -> Callable[[], None]:
    """The bare passes ``compare()`` makes with samples [0, 1]: the split run's (``chunk``
    rows each), then the batched one (of ``batched`` when given); the rows a traced
    model's passes copied are dropped after them."""

    def bare() -> None:
        with torch.no_grad():
            for start in range(0, 2, chunk):
                model(x[start:start + chunk])
            (model if batched is None else batched)(x)
        KEPT.clear()

    return bare


def hooked(model: torch.nn.Module, bare: Callable[[], None], copy: bool
           ) -> Callable[[], None]:
    """``bare`` with a forward hook on every module that does nothing with the output, or
    keeps a copy of its compared rows."""

    def keep(_module: torch.nn.Module, _args: object, output: object) -> None:
        if copy and isinstance(output, torch.Tensor) and output.dim():
            KEPT.append(output[:2].clone())

    def run() -> None:
        handles = [module.register_forward_hook(keep) for module in model.modules()]
        try:
            bare()
        finally:
            for handle in handles:
                handle.remove()
            KEPT.clear()

    return run


def observe(tensor: torch.Tensor) -> torch.Tensor:
    """Sees a leaf call's output and does nothing with it."""
    return tensor


def copy_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Keeps a copy of rows 0 and 1 of a leaf call's output."""
    KEPT.append(tensor[:2].clone())
    return tensor


torch.fx.wrap("observe")
torch.fx.wrap("copy_rows")


def traced(model: torch.nn.Module, after: Callable[[torch.Tensor], torch.Tensor]
           ) -> tuple[torch.fx.GraphModule, int]:
    """``model`` traced, with ``after`` called on every leaf module call's output; and
    the number of those calls in one pass. The containers are not called, so it sees
    fewer sites than module hooks do."""
    module = torch.fx.symbolic_trace(model)
    calls = [node for node in module.graph.nodes if node.op == "call_module"]
    for node in calls:
        with module.graph.inserting_after(node):
            wrapped = module.graph.call_function(after, (node,))
        node.replace_all_uses_with(wrapped, delete_user_cb=lambda user, w=wrapped: user is not w)
    module.recompile()
    return module, len(calls)
