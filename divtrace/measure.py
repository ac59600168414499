"""The batched run: compare every site with the split run's rows the moment it is produced."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from divtrace import kernels
from divtrace.metrics import block_stats, blocks, combine, tolerances
from divtrace.record import SiteInfo
from divtrace.sites import ROOT
from divtrace.split import Reference, SplitRecording, runs_of

__all__ = ["Measured", "Meter"]

#: Bytes of temporaries per compared element while a block is measured (an upper bound).
_TEMP_BYTES = 40
#: On an accelerator, temporaries may take this share of the recorded rows' bytes ...
_TEMP_SHARE = 0.05
#: ... but a block of this many elements is always allowed, to keep launches few.
_MIN_BLOCK = 1 << 20
#: On the CPU, blocks of this many elements keep the temporaries in cache.
_CPU_BLOCK = 1 << 18


@dataclass
class Measured:
    """One site of the batched run: what it is and, if it could be compared, its stats."""

    site: SiteInfo
    status: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stats: torch.Tensor | None = None  # [samples, len(FIELDS)], on the site's device
    flips: torch.Tensor | None = None  # [samples] argmax flips, for 2-D model outputs
    kept: torch.Tensor | None = None  # batched rows, when keep=True


@dataclass
class Meter:
    """Measures the batched run's sites against a :class:`SplitRecording`."""

    split: SplitRecording
    rtol: float | None
    atol: float | None
    keep: bool
    sites: list[Measured] = field(default_factory=list)
    _index: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    _tol: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._runs = runs_of(self.split.samples)
        self._budget = max(_MIN_BLOCK, int(_TEMP_SHARE * self.split.stored_bytes / _TEMP_BYTES))

    def _block(self, device: torch.device) -> int:
        return _CPU_BLOCK if device.type == "cpu" else self._budget

    def _samples_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._index:
            self._index[device] = torch.tensor(self.split.samples, device=device)
        return self._index[device]

    def _status(self, ref: Reference | None, tensor: torch.Tensor, batch: int) -> str:
        if ref is None:
            return "missing_in_split"
        if ref.status != "ok":
            return ref.status
        shape = tensor.shape
        dim = self.split.batch_dim % len(shape) if shape else 0
        if not shape or shape[dim] != batch:
            return "unbatched"
        if tuple(shape[:dim] + shape[dim + 1:]) != ref.row_shape:
            return "shape_mismatch"
        if tensor.dtype != ref.dtype:
            return "dtype_mismatch"
        if not self.split.complete(ref):
            return "partial_in_split"
        return "ok"

    def _tolerances(self, dtype: torch.dtype) -> tuple[float, float]:
        if dtype not in self._tol:
            self._tol[dtype] = tolerances(dtype, self.rtol, self.atol)
        return self._tol[dtype]

    def measure(self, info: SiteInfo, tensor: torch.Tensor, batch: int) -> None:
        """Measures one observed tensor of the batched run (called from its hook)."""
        ref = self.split.refs.get(info.key)
        status = self._status(ref, tensor, batch)
        site = Measured(info, status, tuple(tensor.shape), tensor.dtype)
        self.sites.append(site)
        if status != "ok" or ref is None or ref.rows is None:
            return
        dim = self.split.batch_dim % tensor.dim()
        rtol, atol = self._tolerances(tensor.dtype)
        fused = kernels.supports(tensor)
        split_rows = ref.rows
        if split_rows.device != tensor.device:
            split_rows = split_rows.to(tensor.device, non_blocking=True)
        per_run = []
        for slot, row, n in self._runs:
            b = tensor if n == batch else tensor.narrow(dim, row, n)
            b = (b.movedim(dim, 0) if dim else b).reshape(n, -1)
            r = (split_rows if n == len(split_rows) else split_rows.narrow(0, slot, n))
            r = r.reshape(n, -1)
            if fused:  # one pass, no temporaries beyond a partial row per program
                per_run.append(kernels.fused_stats(b, r, rtol, atol))
                continue
            per_run.append(combine([
                block_stats(b[:, lo:hi], r[:, lo:hi], rtol, atol)
                for lo, hi in blocks(n, b.shape[1], self._block(tensor.device))
            ]))
        site.stats = per_run[0] if len(per_run) == 1 else torch.cat(per_run)
        if info.module == ROOT and tensor.dim() == 2 and tensor.is_floating_point():
            picked = tensor.index_select(dim, self._samples_on(tensor.device)).movedim(dim, 0)
            site.flips = (picked.argmax(1) != split_rows.argmax(1)).double()
        if self.keep:
            rows = tensor.index_select(dim, self._samples_on(tensor.device)).movedim(dim, 0)
            site.kept = rows.to(ref.rows.device).contiguous()
        else:
            ref.drop()  # stream: the split rows are not needed any more
