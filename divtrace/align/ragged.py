"""Prompts of different lengths: a row's real tokens inside a padded pass."""

from __future__ import annotations

import torch

__all__ = ["joined", "real_tokens"]


def real_tokens(tensor: torch.Tensor, row: int, length: int, offset: int, valid: int,
                like: tuple[int, ...] | None = None, packed: bool = False) -> torch.Tensor:
    """Row ``row`` of a pass's tensor (batch first), without the batch dimension and cut,
    along every axis as long as the pass's padded ``length``, to the row's ``valid`` real
    tokens from ``offset``. Axes of another length (hidden size, heads, a pooled output)
    are kept whole; so is every axis when the row has no padding.

    ``like``: the shape the other run recorded for this row; then only axes that are
    ``valid`` long there are cut (a head size that happens to equal the padded length
    stays whole).

    ``packed``: other sequences may share the row (packed one after another): a row
    whose tokens fill it is cut all the same."""
    part = tensor[row]
    if valid == length and not packed:
        return part
    for dim, size in enumerate(part.shape):
        if size == length and (like is None or (len(like) == part.dim()
                                                and like[dim] == valid)):
            part = part.narrow(dim, offset, valid)
    return part


def joined(parts: list[torch.Tensor] | list[torch.Tensor | None],
           device: torch.device | None = None) -> torch.Tensor:
    """Each prompt's tokens, flattened and end to end (on ``device`` if given)."""
    return torch.cat([p.flatten() if device is None else p.to(device).flatten()
                      for p in parts if p is not None])
