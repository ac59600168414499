"""Where a leaf module's inputs came from: another site's output, or somewhere unseen."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import Site, flatten_output, input_site
from divtrace.compat import pytree
from divtrace.record.recorder import Tracker

__all__ = ["InputPart", "Origin", "input_parts", "tensor_inputs"]

_SCALARS = (int, float, bool, str, type(None))


class Origin(StrEnum):
    """Where one tensor input of a leaf call came from."""

    SITE = "site"  # the unchanged output of an observed site
    INPUT = "input"  # made outside any observed module; recorded under its own pseudo-site
    UNKNOWN = "unknown"  # made unseen, then changed in place by the module itself


@dataclass(frozen=True)
class InputPart:
    """One tensor input of a module call: its origin and the key it is known by."""

    origin: Origin
    key: str | None
    tensor: torch.Tensor


def tensor_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among a call's arguments, in order."""
    if not kwargs:  # the common case (tensors and scalars), cheap: no tree walked
        tensors = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                tensors.append(arg)
            elif not isinstance(arg, _SCALARS):
                break
        else:
            return tensors
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def input_parts(call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> list[InputPart]:
    """Classifies the tensor inputs of one leaf module call (see :class:`Origin`).

    A module that returns its input tensor itself either changed it in place (it has
    ``inplace=True``, as ``nn.ReLU(inplace=True)``) or passed it through untouched (as
    ``nn.Dropout`` and ``nn.Identity`` in eval mode): then the input is its own output.
    """
    outputs = ({id(output)} if isinstance(output, torch.Tensor)
               else {id(t) for _, t, _ in flatten_output(output)})
    parts = []
    for index, tensor in enumerate(tensor_inputs(args, kwargs)):
        returned = id(tensor) in outputs
        in_place = returned and bool(getattr(module, "inplace", False))
        key = tracker.producer(tensor, in_place)
        if key is not None:
            parts.append(InputPart(Origin.SITE, key, tensor))
        elif in_place:
            parts.append(InputPart(Origin.UNKNOWN, None, tensor))
        elif returned and isinstance(output, torch.Tensor):  # passed through untouched
            parts.append(InputPart(Origin.SITE, call.key, tensor))
        else:
            parts.append(InputPart(Origin.INPUT, input_site(call, index).key, tensor))
    return parts
