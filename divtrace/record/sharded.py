"""A tensor-parallel model's site outputs, reassembled into the whole tensors of the
unsharded model before they are measured.

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
from divtrace.record.recorder import Sink, Tracker

__all__ = ["Reassembled", "whole"]


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
    if len(dims) != 1 or expected[dims[0]] % world or (
            tensor.shape[dims[0]] * world != expected[dims[0]]):
        return tensor  # not an even shard along one dimension: measured as it is
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=dims[0])


class Reassembled(Sink):
    """A sink that hands ``sink`` every site's tensor reassembled (``expected``: the
    unsharded run's shape at a site key, None where it has none)."""

    def __init__(self, sink: Sink, expected: Callable[[str], tuple[int, ...] | None]) -> None:
        self.sink, self.expected = sink, expected

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        self.sink.begin_chunk(start, stop, tracker)

    def pass_rows(self, start: int, stop: int) -> int:
        return self.sink.pass_rows(start, stop)

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        """The call, its DTensor inputs (a parallel style's wrappers) as the site outputs
        they wrap, or else as their local tensors."""
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
            expected = self.expected(key)
            return value if expected is None else whole(value, expected)

        args, kwargs = pytree.tree_map(local, (args, kwargs))
        self.sink.on_call(call, module, args, kwargs, output, tracker)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        self.sink.on_tensor(site, whole(tensor, self.expected(site.key)))

    def end_chunk(self) -> bool:
        return self.sink.end_chunk()
