"""The output head in float32 (:class:`Float32Head`), as trainers compute
log-probabilities from a half-precision model."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.errors import DivtraceValueError
from divtrace.record.experts import Routers
from divtrace.remedies.catalog import Leave, Upcast, around
from divtrace.remedies.remedy import Remedy, Situation, targets

__all__ = ["Float32Head", "Float32Router", "output_head"]


def output_head(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of ``model``'s output head: its final norm (the last norm
    outside its repeated layers, when there is one) and its output embedding
    (``get_output_embeddings()``, e.g. ``lm_head``); empty when it has no output embedding."""
    found = getattr(model, "get_output_embeddings", None)
    head = found() if callable(found) else None
    if not isinstance(head, nn.Module):
        return ()
    names = {id(module): name for name, module in model.named_modules()}
    if id(head) not in names:
        return ()
    norms = [name for name, module in model.named_modules()
             if module is not head and "norm" in type(module).__name__.lower()
             and not any(part.isdigit() for part in name.split("."))]
    return (*norms[-1:], names[id(head)] or ROOT)


class Float32Head(Remedy):
    """The output head in float32, as trainers compute log-probabilities: while the final
    norm and the output embedding run (:func:`output_head`: e.g. ``model.norm`` and
    ``lm_head``), every torch function takes its bfloat16 and float16 tensors (the weights
    too) as float32 copies, and their outputs stay float32: the logits are float32. The
    parameters are not changed.

    Args:
        modules: The head's qualified names (None: :func:`output_head` of the model).
    """

    kind = "float32-head"

    def __init__(self, modules: Sequence[str] | None = None) -> None:
        self._modules = None if modules is None else tuple(
            [modules] if isinstance(modules, str) else modules)

    @property
    def name(self) -> str:
        return "float32 head" + ("" if self._modules is None else
                                 f" ({', '.join(self._modules)})")

    @property
    def modules(self) -> tuple[str, ...] | None:
        return self._modules

    def unusable(self, situation: Situation) -> str | None:
        if not situation.head:
            return "the model has no output embedding (get_output_embeddings())"
        if situation.head_dtype not in ("bfloat16", "float16"):
            return f"the output head computes in {situation.head_dtype} already"
        return None

    def caveat(self, situation: Situation) -> str:
        return "the logits are float32, not the model's dtype"

    def _found(self, model: nn.Module) -> tuple[str, ...]:
        """The modules it computes in float32 when none were named."""
        names = output_head(model)
        if not names:
            raise DivtraceValueError(
                f"{type(model).__name__} has no output embedding (get_output_embeddings()) "
                f"to compute in float32; name the head: Float32Head(['lm_head'])")
        return names

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        names = self._modules if self._modules is not None else self._found(model)

        def enter(_module: nn.Module, _args: tuple[Any, ...]) -> Leave:
            mode = Upcast(torch.float32)
            mode.__enter__()

            def leave(output: Any) -> Any:
                mode.__exit__(None, None, None)
                return output
            return leave

        around(targets(model, names), enter, stack)


class Float32Router(Float32Head):
    """The mixture-of-experts routers in float32: while a router runs, every torch
    function takes its bfloat16 and float16 tensors (its weight too) as float32 copies,
    and its outputs (logits, weights) stay float32. The parameters are not changed.

    Args:
        modules: The routers' qualified names, or a :class:`~divtrace.Routers` that finds
            them (None: every Hugging Face mixture-of-experts block's ``gate``).
    """

    kind = "float32-router"

    def __init__(self, modules: Sequence[str] | Routers | None = None) -> None:
        self._routing = modules if isinstance(modules, Routers) else Routers()
        super().__init__(None if isinstance(modules, Routers) else modules)

    @property
    def name(self) -> str:
        if self._modules is not None:
            return f"float32 router ({', '.join(self._modules)})"
        pattern = self._routing.pattern
        return "float32 router" + ("" if pattern is None else f" ({self._routing.described()})")

    def unusable(self, situation: Situation) -> str | None:
        if not situation.routers:
            return "the model has no mixture-of-experts router"
        if situation.router_dtype not in ("bfloat16", "float16"):
            return f"the routers compute in {situation.router_dtype} already"
        return None

    def caveat(self, situation: Situation) -> str:
        return "the routers' logits and weights are float32, not the model's dtype"

    def _found(self, model: nn.Module) -> tuple[str, ...]:
        names = self._routing.names(model)
        if not names:
            raise DivtraceValueError(
                f"{type(model).__name__} has no mixture-of-experts router (a module with a "
                f"gate and experts); name the routers: Float32Router(['model.layers.0.mlp."
                f"gate']) or Float32Router(divtrace.Routers('*.router'))")
        return names
