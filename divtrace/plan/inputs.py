"""The model's input: find the batch size, validate it, and cut it into chunks."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from divtrace.compat import pytree
from divtrace.errors import DivtraceTypeError, DivtraceValueError, DivtraceWarning

__all__ = ["BatchedInput", "check_chunk", "chunks_for", "prepare_input", "prepare_samples"]


@dataclass(frozen=True)
class BatchedInput:
    """The user's input, flattened, with the tensors that carry the batch marked.

    Attributes:
        leaves: The flattened ``(args, kwargs)`` pair.
        spec: The pytree spec that rebuilds ``(args, kwargs)`` from ``leaves``.
        sliced: For each leaf, whether it is a tensor cut along the batch dimension.
        batch_size: B, the size of the batch dimension.
        batch_dim: The batch dimension as the user gave it (may be negative).
    """

    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec
    sliced: tuple[bool, ...]
    batch_size: int
    batch_dim: int

    def rows(self, start: int, stop: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Returns ``(args, kwargs)`` holding rows ``start:stop`` of every batched tensor
        (the inputs exactly as given when that is the whole batch)."""
        if start == 0 and stop == self.batch_size:
            return self.whole()
        leaves = [
            leaf.narrow(self.batch_dim, start, stop - start) if cut else leaf
            for leaf, cut in zip(self.leaves, self.sliced, strict=True)
        ]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def select(self, rows: list[int]) -> BatchedInput:
        """The batch of only these rows, in this order."""
        index = torch.tensor(rows)
        leaves = tuple(leaf.index_select(self.batch_dim, index.to(leaf.device)) if cut else leaf
                       for leaf, cut in zip(self.leaves, self.sliced, strict=True))
        return BatchedInput(leaves, self.spec, self.sliced, len(rows), self.batch_dim)

    def whole(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Returns ``(args, kwargs)`` exactly as the user gave them."""
        args, kwargs = pytree.tree_unflatten(list(self.leaves), self.spec)
        return args, kwargs


def _split_x(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(x, torch.Tensor):
        return (x,), {}
    if isinstance(x, tuple):
        return x, {}
    if isinstance(x, dict):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise DivtraceTypeError(
                f"x is a dict, so its keys must be the model's keyword argument names "
                f"(str); got the key(s) {bad!r}"
            )
        return (), dict(x)
    raise DivtraceTypeError(
        f"x must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments; got {type(x).__name__}. Wrap a single non-tensor argument as (x,)"
    )


def _has_dim(t: torch.Tensor, dim: int) -> bool:
    return -t.dim() <= dim < t.dim()


def prepare_input(x: Any, batch_dim: int, stacklevel: int = 3) -> BatchedInput:
    """Validates ``x`` and finds its batch size.

    B is the size at ``batch_dim`` of the first tensor (in argument order) that has that
    dimension. Other tensors of that size at ``batch_dim`` are cut too; tensors of another
    size pass through whole, with a warning, since that is usually a mistake;
    ``stacklevel`` points it at the user's call.
    """
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int):
        raise DivtraceTypeError(f"batch_dim must be an int; got {type(batch_dim).__name__}")
    args, kwargs = _split_x(x)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise DivtraceValueError(
            "x holds no tensor, so there is no batch to split; pass the model's input "
            "tensor(s) as x"
        )
    batched = [(i, t) for i, t in tensors if _has_dim(t, batch_dim)]
    if not batched:
        shapes = ", ".join(str(tuple(t.shape)) for _, t in tensors)
        raise DivtraceValueError(
            f"no tensor in x has a batch dimension {batch_dim} (shapes: {shapes}); "
            f"add one, e.g. x.unsqueeze(0), or pass batch_dim="
        )
    batch_size = batched[0][1].shape[batch_dim]
    if batch_size < 2:
        raise DivtraceValueError(
            f"the batch has {batch_size} sample(s) at batch_dim={batch_dim}; comparing a "
            f"batched run with a split run needs at least 2. Pass a larger batch, or the "
            f"right batch_dim"
        )
    sliced = [False] * len(leaves)
    odd: list[str] = []
    for i, t in batched:
        if t.shape[batch_dim] == batch_size:
            sliced[i] = True
        else:
            odd.append(f"leaf {i} with shape {tuple(t.shape)}")
    if odd:
        warnings.warn(
            f"B={batch_size} (from the first tensor in x), but these tensors have another "
            f"size at batch_dim={batch_dim} and pass through whole: {'; '.join(odd)}. If "
            f"they carry the batch too, fix their shape or batch_dim",
            DivtraceWarning,
            stacklevel=stacklevel,
        )
    return BatchedInput(tuple(leaves), spec, tuple(sliced), batch_size, batch_dim)


def prepare_samples(samples: Any, batch_size: int) -> list[int]:
    """Validates ``samples`` and returns them as a sorted list of row indices."""
    if samples is None:
        return list(range(batch_size))
    if isinstance(samples, int) and not isinstance(samples, bool):
        samples = [samples]
    elif isinstance(samples, range | torch.Tensor):
        samples = list(samples.tolist() if isinstance(samples, torch.Tensor) else samples)
    if not isinstance(samples, Sequence) or isinstance(samples, str):
        raise DivtraceTypeError(
            f"samples must be a list of row indices (or None for all rows); got "
            f"{type(samples).__name__}"
        )
    out: list[int] = []
    for s in samples:
        if isinstance(s, bool) or not isinstance(s, int):
            raise DivtraceTypeError(f"samples must hold ints; got {s!r} ({type(s).__name__})")
        if not 0 <= s < batch_size:
            raise DivtraceValueError(
                f"sample {s} is out of range: the batch has B={batch_size} rows, so "
                f"samples must lie in 0..{batch_size - 1}"
            )
        out.append(s)
    if not out:
        raise DivtraceValueError("samples is empty; name at least one row, or pass None")
    if len(set(out)) != len(out):
        dup = sorted({s for s in out if out.count(s) > 1})
        raise DivtraceValueError(f"samples names rows {dup} more than once; name each once")
    return sorted(out)


def chunks_for(samples: list[int], chunk: int, batch_size: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` chunks of the split run that hold at least one compared row."""
    starts = sorted({s // chunk * chunk for s in samples})
    return [(start, min(start + chunk, batch_size)) for start in starts]


def check_chunk(chunk: Any, batch_size: int) -> int:
    """Validates the split run's chunk size."""
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise DivtraceTypeError(f"chunk must be an int; got {type(chunk).__name__}")
    if chunk < 1:
        raise DivtraceValueError(f"chunk must be at least 1; got {chunk}")
    if chunk >= batch_size:
        raise DivtraceValueError(
            f"chunk={chunk} but the batch has only B={batch_size} rows, so the split run "
            f"would be the batched run; pass a chunk below {batch_size} (1 = per-sample)"
        )
    return chunk
