"""The batched run: compare every site with the split run's rows the moment it is produced.

Optionally, per leaf call, replay the module on the split run's inputs (local error), and
compare both runs with a float64 run of the same samples (truth).
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from divtrace import kernels
from divtrace.lineage import input_parts, input_site
from divtrace.metrics import (
    block_stats,
    blocks,
    combine,
    lower_precision,
    mixed_stats,
    tolerances,
)
from divtrace.record import SiteInfo, Tracker
from divtrace.sites import INPUT, ROOT, flatten_output, site_key
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
    kept: torch.Tensor | None = None  # batched rows, when kept
    truth: torch.Tensor | None = None  # [2]: rel_l2 of batched and of split vs float64


@dataclass
class Call:
    """A leaf module call of the batched run: its inputs' lineage and its local error."""

    inputs: list[tuple[str, str | None, Measured | None]]  # (kind, site key, measured)
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # output key -> stats
    local_status: str = ""


@dataclass
class Meter:
    """Measures the batched run's sites against a :class:`SplitRecording`."""

    split: SplitRecording
    rtol: float | None
    atol: float | None
    keep: bool
    local: bool = False
    replay_skip: tuple[str, ...] = ()
    truth: SplitRecording | None = None
    sites: list[Measured] = field(default_factory=list)
    calls: dict[str, Call] = field(default_factory=dict)
    _index: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    _tol: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._runs = runs_of(self.split.samples)
        self._budget = max(_MIN_BLOCK, int(_TEMP_SHARE * self.split.stored_bytes / _TEMP_BYTES))
        # with local=True a site's split rows stay until every call that reads them replayed
        self._readers: Counter[str] = Counter(
            key for parts in self.split.calls.values() for kind, key in parts
            if key is not None) if self.local else Counter()

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
        if tensor.dtype != ref.dtype and not (
                tensor.is_floating_point() and ref.dtype.is_floating_point):
            return "dtype_mismatch"
        if not self.split.complete(ref):
            return "partial_in_split"
        return "ok"

    def _tolerances(self, dtype: torch.dtype) -> tuple[float, float]:
        if dtype not in self._tol:
            self._tol[dtype] = tolerances(dtype, self.rtol, self.atol)
        return self._tol[dtype]

    def _rows_on(self, ref: Reference, device: torch.device) -> torch.Tensor:
        assert ref.rows is not None
        rows = ref.rows
        return rows if rows.device == device else rows.to(device, non_blocking=True)

    def stats(self, tensor: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
        """Per-sample statistics of the compared rows of ``tensor`` against ``rows``."""
        dim = self.split.batch_dim % tensor.dim()
        mixed = tensor.dtype != rows.dtype
        rtol, atol = self._tolerances(lower_precision(tensor.dtype, rows.dtype) if mixed
                                      else tensor.dtype)
        fused = kernels.supports(tensor) and not mixed
        per_run = []
        for slot, row, n in self._runs:
            b = tensor if n == batch else tensor.narrow(dim, row, n)
            b = (b.movedim(dim, 0) if dim else b).reshape(n, -1)
            r = (rows if n == len(rows) else rows.narrow(0, slot, n)).reshape(n, -1)
            if fused:  # one pass, no temporaries beyond a partial row per program
                per_run.append(kernels.fused_stats(b, r, rtol, atol))
                continue
            if mixed:  # two configurations of a run: errors in the finer dtype
                per_run.append(combine([
                    mixed_stats(b[:, lo:hi], r[:, lo:hi], rtol, atol)
                    for lo, hi in blocks(n, b.shape[1], self._block(tensor.device))]))
                continue
            per_run.append(combine([
                block_stats(b[:, lo:hi], r[:, lo:hi], rtol, atol)
                for lo, hi in blocks(n, b.shape[1], self._block(tensor.device))
            ]))
        return per_run[0] if len(per_run) == 1 else torch.cat(per_run)

    def _picked(self, tensor: torch.Tensor) -> torch.Tensor:
        """The compared samples' rows of a batched tensor, batch dimension first."""
        dim = self.split.batch_dim % tensor.dim()
        return tensor.index_select(dim, self._samples_on(tensor.device)).movedim(dim, 0)

    def _truth(self, key: str, tensor: torch.Tensor, split_rows: torch.Tensor
               ) -> torch.Tensor | None:
        ref = self.truth.refs.get(key) if self.truth is not None else None
        if ref is None or ref.rows is None or not tensor.is_floating_point():
            return None
        exact = self._rows_on(ref, tensor.device)
        if exact.shape != split_rows.shape:
            return None
        norm = torch.linalg.vector_norm(exact)
        errors = torch.stack([torch.linalg.vector_norm(self._picked(tensor).double() - exact),
                              torch.linalg.vector_norm(split_rows.double() - exact)])
        ref.drop()
        return torch.where(norm > 0, errors / norm, errors)

    def measure_site(self, info: SiteInfo, tensor: torch.Tensor, batch: int) -> Measured:
        """Measures one tensor against the split run's rows at its site (not kept)."""
        ref = self.split.refs.get(info.key)
        status = self._status(ref, tensor, batch)
        site = Measured(info, status, tuple(tensor.shape), tensor.dtype)
        if status != "ok" or ref is None or ref.rows is None:
            return site
        split_rows = self._rows_on(ref, tensor.device)
        site.stats = self.stats(tensor, split_rows, batch)
        site.truth = self._truth(info.key, tensor, split_rows)
        if info.module == ROOT and tensor.dim() == 2 and tensor.is_floating_point():
            site.flips = (self._picked(tensor).argmax(1) != split_rows.argmax(1)).double()
        if self.keep:
            site.kept = self._picked(tensor).to(ref.rows.device).contiguous()
        elif self._readers[info.key] == 0:
            ref.drop()  # stream: the split rows are not needed any more
        return site

    def measure(self, info: SiteInfo, tensor: torch.Tensor, batch: int) -> None:
        """Measures one observed tensor of the batched run (called from its hook)."""
        self.sites.append(self.measure_site(info, tensor, batch))

    def on_call(self, info: SiteInfo, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker, batch: int) -> None:
        """A leaf call of the batched run: its inputs' lineage, and its local error."""
        parts = input_parts(info, module, args, kwargs, output, tracker)
        inputs: list[tuple[str, str | None, Measured | None]] = []
        for index, part in enumerate(parts):
            measured = (self.measure_site(input_site(info, index), part.tensor, batch)
                        if part.kind == "input" else None)
            inputs.append((part.kind, part.key, measured))
        call = self.calls[info.key] = Call(inputs)
        if self.local:
            self._replay(info, module, args, kwargs, parts, call, tracker, batch)

    def _replay(self, info: SiteInfo, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], parts: list[Any], call: Call, tracker: Tracker,
                batch: int) -> None:
        """Runs the module again on the batched input with the compared rows replaced by
        the split run's: same values in both runs, the batched run's kernels."""
        # the model's own input rows are the same in both runs: nothing to replace
        same = [part.key == INPUT for part in parts]
        sources = [self.split.refs.get(part.key) if part.kind != "unknown" else None
                   for part in parts]
        try:
            if module.training:
                call.local_status = "train_mode"
                return
            if any(fnmatch.fnmatchcase(info.module, pattern) for pattern in self.replay_skip):
                call.local_status = "skipped"
                return
            if any((ref is None or ref.rows is None) and not keep_as_is
                   for ref, keep_as_is in zip(sources, same, strict=True)):
                call.local_status = "no_input"
                return
            leaves, spec = pytree.tree_flatten((args, kwargs))
            refs = iter(sources)
            replaced = []
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    replaced.append(leaf)
                    continue
                ref = next(refs)
                dim = self.split.batch_dim % max(leaf.dim(), 1)
                if leaf.dim() == 0 or leaf.shape[dim] != batch or ref is None:
                    replaced.append(leaf)
                    continue
                copy = leaf.clone()
                rows = self._rows_on(ref, leaf.device).movedim(0, dim).to(leaf.dtype)
                copy.index_copy_(dim, self._samples_on(leaf.device), rows)
                replaced.append(copy)
            new_args, new_kwargs = pytree.tree_unflatten(replaced, spec)
            tracker.replaying = True
            try:
                output = module(*new_args, **new_kwargs)
            finally:
                tracker.replaying = False
            outputs = ([("", output)] if isinstance(output, torch.Tensor)
                       else flatten_output(output))
            for path, tensor in outputs:
                key = site_key(info.module, info.call, path)
                ref = self.split.refs.get(key)
                if ref is not None and ref.rows is not None and (
                        self._status(ref, tensor, batch) == "ok"):
                    call.local[key] = self.stats(tensor, self._rows_on(ref, tensor.device),
                                                 batch)
            call.local_status = "ok"
        finally:  # the last reader of a site's split rows releases them
            for part, ref in zip(parts, sources, strict=True):
                if part.key is None:
                    continue
                self._readers[part.key] -= 1
                if self._readers[part.key] <= 0 and ref is not None and not self.keep:
                    ref.drop()
