"""Where a leaf module's inputs came from: another site's output, or somewhere unseen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from divtrace.record import SiteInfo, Tracker
from divtrace.sites import flatten_output

__all__ = ["InputPart", "input_parts", "input_site", "tensor_inputs"]

_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


@dataclass(frozen=True)
class InputPart:
    """One tensor input of a module call.

    ``kind`` is ``"site"`` (it is the unchanged output of site ``key``), ``"input"`` (made
    outside any observed module, e.g. by a functional op; recorded under ``key``), or
    ``"unknown"`` (made unseen and then changed in place by the module itself).
    """

    kind: str
    key: str | None
    tensor: torch.Tensor


def input_site(call: SiteInfo, index: int) -> SiteInfo:
    """The pseudo-site under which an unseen input of ``call`` is recorded."""
    path = f"<in{index}>"
    return SiteInfo(f"{call.key}{path}", call.module, call.module_type, call.call, path, True)


def tensor_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among a call's arguments, in order."""
    if not kwargs and all(isinstance(a, _PLAIN) for a in args):  # the common case, cheap
        return [a for a in args if isinstance(a, torch.Tensor)]
    return [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def input_parts(call: SiteInfo, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> list[InputPart]:
    """Classifies the tensor inputs of one leaf module call (see :class:`InputPart`).

    A module that returns its input tensor itself either changed it in place (it has
    ``inplace=True``, as ``nn.ReLU(inplace=True)``) or passed it through untouched (as
    ``nn.Dropout`` and ``nn.Identity`` in eval mode): then the input is its own output.
    """
    outputs = ({id(output)} if isinstance(output, torch.Tensor)
               else {id(t) for _, t in flatten_output(output)})
    parts = []
    for index, tensor in enumerate(tensor_inputs(args, kwargs)):
        returned = id(tensor) in outputs
        in_place = returned and bool(getattr(module, "inplace", False))
        key = tracker.producer(tensor, in_place)
        if key is not None:
            parts.append(InputPart("site", key, tensor))
        elif in_place:
            parts.append(InputPart("unknown", None, tensor))
        elif returned and isinstance(output, torch.Tensor):  # passed through untouched
            parts.append(InputPart("site", call.key, tensor))
        else:
            parts.append(InputPart("input", input_site(call, index).key, tensor))
    return parts
