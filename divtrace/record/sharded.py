"""A tensor-parallel model's site outputs, made comparable on every rank: reassembled
into the whole tensors of the unsharded model (:class:`Reassembled`, for
``compare_models``), or every rank's parts stacked (:class:`Stacked`, for the model
compared with itself, batched against split).

Under ``torchrun`` every rank runs the same forward pass, so every rank reaches the same
sites in the same order: each reassembly is a collective that all ranks make together. A
DTensor output becomes its full tensor by its placements (``full_tensor()``). A plain
tensor (the parallel styles' default ``use_local_output=True``) is compared with the
shape the unsharded model gave at that site: when it is that shape it is taken as it is
(replicated: a row-parallel layer's all-reduced output); when one dimension is that
dimension's size divided by the ranks, the ranks' shards are gathered along it, in rank
order (a column-parallel layer's output, the activations between it and the next
row-parallel layer, a sequence-parallel region). The decision reads shapes only, which
are the same on every rank, so no rank waits on a collective another skips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from divtrace.align.sites import Site, input_site
from divtrace.compat import pytree
from divtrace.record.recorder import Gate, Sink, Tracker

__all__ = ["Reassembled", "Stacked", "sharded", "stacked", "whole"]

_DIMS = 8  # tensors of more dimensions are measured as each rank holds them


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole(tensor: torch.Tensor, expected: tuple[int, ...] | None) -> torch.Tensor:
    """``tensor`` (this rank's part) as the whole tensor of shape ``expected`` (see the
    module's text); as it is when it cannot be told how it is sharded."""
    if _is_dtensor(tensor):
        return tensor.full_tensor()  # type: ignore[attr-defined]
    world = dist.get_world_size()
    if expected is None or tuple(tensor.shape) == expected or tensor.dim() != len(expected):
        return tensor
    dims = [d for d, (mine, full) in enumerate(zip(tensor.shape, expected, strict=True))
            if mine != full]
    if len(dims) != 1 or tensor.shape[dims[0]] * world != expected[dims[0]]:
        return tensor  # not an even shard along one dimension: measured as it is
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=dims[0])


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` runs over several ranks: DTensor parameters under a process group
    of more than one rank."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    return any(_is_dtensor(p) for p in model.parameters())


def stacked(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's local part of ``tensor``, stacked along a new last dimension (rank
    order), so that each rank measures all of them; as it is when the ranks' parts differ
    in shape (each rank then measures its own)."""
    if _is_dtensor(tensor):
        tensor = tensor.to_local()  # type: ignore[attr-defined]
    if tensor.dim() > _DIMS:
        return tensor
    world = dist.get_world_size()
    shape = torch.zeros(_DIMS + 1, dtype=torch.int64, device=tensor.device)
    shape[0] = tensor.dim()
    shape[1:tensor.dim() + 1] = torch.tensor(tensor.shape)
    shapes = torch.empty(world * (_DIMS + 1), dtype=torch.int64, device=tensor.device)
    dist.all_gather_into_tensor(shapes, shape)
    if not bool((shapes.view(world, -1) == shape).all()):  # one host synchronisation
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts, dim=-1)


class _Traced(Gate):
    """A sink that hands ``sink`` every site's tensor and every leaf's inputs changed by
    ``change`` (its key, its tensor), a parallel style's DTensor around a site's output
    traced back to that output first."""

    def __init__(self, sink: Sink, change: Callable[[str, torch.Tensor], torch.Tensor]
                 ) -> None:
        super().__init__(sink, active=True)
        self.change = change

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        """The call, its inputs that no site made changed (they are measured as inputs); a
        DTensor around a site's output is that output."""
        index = [0]

        def local(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            key = input_site(call, index[0]).key  # run a's rows of it, if no site made it
            index[0] += 1
            if _is_dtensor(value):
                mine: torch.Tensor = value.to_local()  # type: ignore[attr-defined]
                made = tracker.sharing(mine)
                if made is not None:
                    return made
                value = mine
            if tracker.producer(value) is not None:  # a site's output: known by identity
                return value
            return self.change(key, value)

        args, kwargs = pytree.tree_map(local, (args, kwargs))
        self.sink.on_call(call, module, args, kwargs, output, tracker)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        self.sink.on_tensor(site, self.change(site.key, tensor))


class Stacked(_Traced):
    """A sink that hands ``sink`` every rank's part of each tensor (:func:`stacked`): a
    sharded model compared with itself (batched against split), every rank the same
    figures."""

    def __init__(self, sink: Sink) -> None:
        super().__init__(sink, lambda _key, tensor: stacked(tensor))


class Reassembled(_Traced):
    """A sink that hands ``sink`` every site's tensor (and leaf input) reassembled into
    the unsharded run's whole tensor (``expected``: that run's shape at a key, None where
    it has none; see :func:`whole`)."""

    def __init__(self, sink: Sink, expected: Callable[[str], tuple[int, ...] | None]) -> None:
        super().__init__(sink, lambda key, tensor: whole(tensor, expected(key)))
