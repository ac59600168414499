"""The independence test's input: the batch with every row but the held ones given other
valid data, the shapes kept."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from divtrace.plan.inputs import BatchedInput

__all__ = ["replaced"]


def replaced(batch: BatchedInput, fixed: list[int]) -> tuple[BatchedInput, list[int]]:
    """The same batch, every row but ``fixed`` given other valid data, and the rows
    that could not be made to differ from what they were.

    Shapes stay, and so do the fixed rows and their positions. A floating-point
    tensor's other rows take the values of fixed rows (so that statistics over the
    batch change, as a permutation among the other rows would not); an integer
    tensor of ids likewise; a mask (bool, or only 0 and 1) is kept, so that the
    model takes the same code path. A row that still equals what it was (samples
    that are all alike) is shifted: ``+ 1`` for floats, the next id for integers.
    """
    size = batch.batch_size
    others = [row for row in range(size) if row not in set(fixed)]
    source = list(range(size))
    for n, row in enumerate(others):
        source[row] = fixed[n % len(fixed)]
    leaves, unchanged = list(batch.leaves), set(others)
    made: dict[tuple[int, int], torch.Tensor] = {}  # one tensor given twice stays one
    for i, (leaf, dim) in enumerate(zip(batch.leaves, batch.dims, strict=True)):
        if dim is None or not isinstance(leaf, torch.Tensor) or not others or (
                _is_mask(leaf)):
            continue
        if (id(leaf), dim) in made:
            leaves[i] = made[id(leaf), dim]
            continue
        new = leaf.index_select(dim, torch.tensor(source, device=leaf.device))
        same = _same_rows(new, leaf, dim, others)
        if same:
            rows = torch.tensor(same, device=leaf.device)
            new.index_copy_(dim, rows, _shifted(new.index_select(dim, rows), leaf))
            same = _same_rows(new, leaf, dim, same)
        unchanged &= set(same)
        leaves[i] = made[id(leaf), dim] = new
    return replace(batch, leaves=tuple(leaves)), sorted(unchanged)


def _is_mask(tensor: torch.Tensor) -> bool:
    """A bool tensor, or an integer one holding only 0 and 1 (an attention mask)."""
    if tensor.dtype == torch.bool:
        return True
    if tensor.is_floating_point() or tensor.is_complex() or not tensor.numel():
        return False
    return bool(((tensor == 0) | (tensor == 1)).all())


def _same_rows(new: torch.Tensor, old: torch.Tensor, dim: int, rows: list[int]) -> list[int]:
    """Those of ``rows`` that are equal in ``new`` and ``old`` (NaN equal to NaN)."""
    if not rows:
        return []
    index = torch.tensor(rows, device=old.device)
    a, b = new.index_select(dim, index).movedim(dim, 0), old.index_select(dim, index).movedim(
        dim, 0)
    equal = (a == b) | (a != a) & (b != b)
    flags = equal.reshape(len(rows), -1).all(1).tolist()
    return [row for row, flag in zip(rows, flags, strict=True) if flag]


def _shifted(rows: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Other valid values for ``rows`` of ``whole``: ``+ 1``, or for integers the next id
    (wrapping within the ids that ``whole`` holds)."""
    if rows.is_floating_point() or rows.is_complex():
        return rows + 1
    top = int(whole.max()) + 1 if whole.numel() else 1
    low = min(int(whole.min()), 0) if whole.numel() else 0
    return (rows - low + 1) % max(top - low, 1) + low


