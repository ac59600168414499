"""The split run's recording: the compared samples' tensors at every site, and no more."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace.record import Observed, SiteInfo

__all__ = ["Reference", "SplitRecording", "runs_of"]


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
class Reference:
    """What the split run produced at one site for the compared samples.

    ``rows`` is ``[samples, *row_shape]`` with the batch dimension moved to the front;
    ``filled[i]`` says whether sample slot ``i`` was written. ``status`` is ``"ok"``
    unless the site could not be recorded (see :class:`divtrace.Comparison`).
    """

    site: SiteInfo
    shape: tuple[int, ...]
    rows: torch.Tensor | None
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    filled: list[bool]
    status: str = "ok"


@dataclass
class SplitRecording:
    """Records the split run, chunk by chunk, keeping only the compared samples' rows."""

    samples: list[int]
    batch_dim: int
    offload: bool
    refs: dict[str, Reference] = field(default_factory=dict)
    _chunk: tuple[int, int] = (0, 0)
    _runs: list[tuple[int, int, int]] = field(default_factory=list)

    def begin_chunk(self, start: int, stop: int) -> None:
        """Starts a chunk of rows ``start:stop`` of the batch."""
        self._chunk = (start, stop)
        inside = [s for s in self.samples if start <= s < stop]
        first_slot = self.samples.index(inside[0])
        self._runs = [(first_slot + pos, row - start, n) for pos, row, n in runs_of(inside)]

    @property
    def stored_bytes(self) -> int:
        """Bytes held by the recorded rows."""
        return sum(
            ref.rows.numel() * ref.rows.element_size()
            for ref in self.refs.values()
            if ref.rows is not None
        )

    def __call__(self, obs: Observed) -> None:
        tensor = obs.tensor.detach()
        chunk_len = self._chunk[1] - self._chunk[0]
        key = obs.site.key
        ref = self.refs.get(key)
        if tensor.dim() == 0 or tensor.shape[self.batch_dim % tensor.dim()] != chunk_len:
            if ref is None:
                self.refs[key] = Reference(
                    obs.site, tuple(tensor.shape), None, (), tensor.dtype, [], "unbatched")
            else:
                ref.rows, ref.status = None, "unbatched"
            return
        dim = self.batch_dim % tensor.dim()
        row_shape = tuple(tensor.movedim(dim, 0).shape[1:])
        if ref is None:
            device = torch.device("cpu") if self.offload else tensor.device
            rows = torch.empty(
                (len(self.samples), *row_shape),
                dtype=tensor.dtype,
                device=device,
                pin_memory=self.offload and tensor.is_cuda,
            )
            ref = Reference(obs.site, tuple(tensor.shape), rows, row_shape, tensor.dtype,
                            [False] * len(self.samples))
            self.refs[key] = ref
        if ref.rows is None:
            return
        if row_shape != ref.row_shape or tensor.dtype != ref.dtype:
            ref.rows, ref.status = None, "shape_mismatch"
            return
        for slot, row, n in self._runs:
            ref.rows.narrow(0, slot, n).copy_(
                tensor.narrow(dim, row, n).movedim(dim, 0), non_blocking=True
            )
            ref.filled[slot : slot + n] = [True] * n
