"""The rows one run produced at one site for the compared samples, as the row store
keeps them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from divtrace.align.sites import Site
from divtrace.align.status import Status

__all__ = ["StoredRows", "runs_of"]


def runs_of(indices: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of sorted indices as ``(position in list, first index, length)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, index in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == index:
            first_pos, first, length = runs[-1]
            runs[-1] = (first_pos, first, length + 1)
        else:
            runs.append((pos, index, 1))
    return runs


@dataclass
class StoredRows:
    """What one run produced at one site for the compared samples.

    ``rows`` is ``[samples, *row_shape]`` with the batch dimension moved to the front;
    ``filled`` counts the sample slots written. ``status`` is OK unless the site could
    not be recorded.
    """

    site: Site
    shape: tuple[int, ...]
    rows: torch.Tensor | None
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    filled: int = 0
    status: Status = Status.OK
    #: one tensor per compared sample, for rows of different shapes (prompts of different
    #: lengths: each prompt's real tokens); then ``rows`` is None
    parts: list[torch.Tensor | None] | None = None
    #: per part: the index in its sequence of the part's first token (None: every part
    #: from its sequence's start), for token layouts whose sites hold some tokens only
    firsts: list[int] | None = None

    @property
    def held(self) -> bool:
        """Whether the rows are still there (not released, not dropped)."""
        return self.rows is not None or self.parts is not None

    def drop(self, status: Status | None = None) -> None:
        """Releases the rows (and the views into them); optionally marks the site."""
        self.rows, self.parts = None, None
        if status is not None:
            self.status = status
