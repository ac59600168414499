"""The independence test's input: the batch with every row but the held ones given other
valid data, the shapes kept."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from divtrace.devices import upload

if TYPE_CHECKING:
    from divtrace.plan.inputs import BatchedInput

__all__ = ["flags_for", "replaced", "replacements"]


def replaced(batch: BatchedInput, fixed: list[int], found: list[list[bool]] | None = None
             ) -> tuple[BatchedInput, list[int]]:
    """The same batch, every row but ``fixed`` given other valid data, and the rows
    that could not be made to differ from what they were.

    Shapes stay, and so do the fixed rows and their positions. A floating-point
    tensor's other rows take the values of fixed rows (so that statistics over the
    batch change, as a permutation among the other rows would not); an integer
    tensor of ids likewise; a mask (bool, or only 0 and 1) is kept, so that the
    model takes the same code path. A row that still equals what it was (samples
    that are all alike) is shifted: ``+ 1`` for floats, the next id for integers.
    ``found``: what :func:`flags_for` read for ``fixed`` (None: read here, a wait for
    the device).
    """
    made = _made(batch, fixed)
    if made is None:
        return batch, []
    others, work, index = made
    flags = _read([f for *_, f in work]) if found is None else found
    leaves, unchanged = list(batch.leaves), set(others)
    for (i, new, dim, _), flagged in zip(work, flags, strict=True):
        if flagged[0]:  # a mask: kept, so that the model takes the same code path
            continue
        same = [row for row, equal in zip(others, flagged[1:], strict=True) if equal]
        if same:
            rows = _upload_indices(same, new.device)
            new.index_copy_(dim, rows, _shifted(new.index_select(dim, rows),
                                                batch.leaves[i]))
            again = _read([_equal_rows(new, batch.leaves[i], dim, rows)])[0]
            same = [row for row, equal in zip(same, again, strict=True) if equal]
        unchanged &= set(same)
        leaves[i] = new
    for i, (leaf, given) in enumerate(zip(batch.leaves, batch.dims, strict=True)):
        if given is not None and (id(leaf), given) in index:  # the same tensor again
            leaves[i] = leaves[work[index[id(leaf), given]][0]]
    return replace(batch, leaves=tuple(leaves)), sorted(unchanged)


def replacements(batch: BatchedInput, groups: list[list[int]]
                 ) -> Iterator[tuple[BatchedInput, list[int]]]:
    """:func:`replaced` for each group of ``fixed`` rows in turn, made as the caller asks
    for it (one group's tensors at a time), after one wait for the device for all of them
    (:func:`flags_for`) instead of one before each."""
    for fixed, found in zip(groups, flags_for(batch, groups), strict=True):
        yield replaced(batch, fixed, found)


def flags_for(batch: BatchedInput, groups: list[list[int]]) -> list[list[list[bool]]]:
    """What :func:`replaced` reads for each group of ``fixed`` rows, read for every group
    in one wait for the device (made before the passes that follow, that wait is not one
    for their work), each group's replaced tensors let go as soon as made."""
    flags: list[torch.Tensor] = []
    counts = []
    for fixed in groups:
        made = _made(batch, fixed)
        found = [] if made is None else [f for *_, f in made[1]]
        flags += found
        counts.append(len(found))
        del made  # (its replaced tensors: one group's at a time)
    read, at, out = _read(flags), 0, []
    for count in counts:
        out.append(read[at:at + count])
        at += count
    return out


def _made(batch: BatchedInput, fixed: list[int]) -> tuple[
        list[int], list[tuple[int, torch.Tensor, int, torch.Tensor]],
        dict[tuple[int, int], int]] | None:
    """The rows to replace; per batched tensor (once, however often given), its leaf,
    its replaced copy, its batch dimension and the flags to read (whether it is a mask,
    then per replaced row whether it is equal still); and each tensor's place among
    them. None when every row is fixed."""
    size = batch.batch_size
    others = [row for row in range(size) if row not in set(fixed)]
    if not others:
        return None
    source = list(range(size))
    for n, row in enumerate(others):
        source[row] = fixed[n % len(fixed)]
    made: dict[tuple[int, int], int] = {}  # one tensor given twice stays one
    work: list[tuple[int, torch.Tensor, int, torch.Tensor]] = []  # (leaf, new, dim, flags)
    index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, (leaf, dim) in enumerate(zip(batch.leaves, batch.dims, strict=True)):
        if dim is None or not isinstance(leaf, torch.Tensor) or (id(leaf), dim) in made:
            continue
        if leaf.device not in index:  # from pinned memory: the host does not wait
            index[leaf.device] = (_upload_indices(source, leaf.device),
                                  _upload_indices(others, leaf.device))
        whole, rows = index[leaf.device]
        new = leaf.index_select(dim, whole)
        made[id(leaf), dim] = len(work)
        work.append((i, new, dim, torch.cat([_mask_flag(leaf).reshape(1),
                                             _equal_rows(new, leaf, dim, rows)])))
    return others, work, made


def _read(flags: list[torch.Tensor]) -> list[list[bool]]:
    """Device flags on the host, one transfer per device."""
    if not flags:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for n, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(n)
    out: list[list[bool]] = [[] for _ in flags]
    for positions in by_device.values():
        joined = torch.cat([flags[n].reshape(-1) for n in positions]).tolist()
        at = 0
        for n in positions:
            size = flags[n].numel()
            out[n] = [bool(v) for v in joined[at:at + size]]
            at += size
    return out


def _mask_flag(tensor: torch.Tensor) -> torch.Tensor:
    """Whether ``tensor`` is a mask: bool, or an integer one holding only 0 and 1."""
    if tensor.dtype == torch.bool:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.is_floating_point() or tensor.is_complex() or not tensor.numel():
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    return ((tensor == 0) | (tensor == 1)).all()


def _equal_rows(new: torch.Tensor, old: torch.Tensor, dim: int, rows: torch.Tensor
                ) -> torch.Tensor:
    """Per row in ``rows``, whether it is equal in ``new`` and ``old`` (NaN equal to NaN):
    one boolean per element in all, not copies of the rows."""
    equal = new == old
    if new.is_floating_point() or new.is_complex():
        equal |= new.isnan() & old.isnan()
    per_row = equal.movedim(dim, 0).reshape(equal.shape[dim], -1).all(1)
    return per_row.index_select(0, rows)


def _shifted(rows: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Other valid values for ``rows`` of ``whole``: ``+ 1``, or for integers the next id
    (wrapping within the ids that ``whole`` holds)."""
    if rows.is_floating_point() or rows.is_complex():
        return rows + 1
    top = int(whole.max()) + 1 if whole.numel() else 1
    low = min(int(whole.min()), 0) if whole.numel() else 0
    return (rows - low + 1) % max(top - low, 1) + low


def _upload_indices(values: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on ``device`` (the host does not wait: :func:`divtrace.devices.upload`)."""
    return upload(torch.tensor(values), device)
