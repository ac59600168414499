"""The gradients of the two runs, measured: each site's output gradient per compared
sample (the split run's rows stored, the batched run's measured against them in its
backward pass), each parameter's gradient whole, and the loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from divtrace.align.sites import ROOT
from divtrace.align.status import Status
from divtrace.backward.grads import GradSite
from divtrace.measure.figures import site_figures
from divtrace.measure.pair import pair_fields
from divtrace.measure.stats import tolerances

__all__ = ["GradMeter", "GradStore", "loss_row", "param_rows"]

_WIDTH = 1 << 18
#: The columns of a gradient's row besides its figures.
KEYS = ("site", "kind", "module", "type", "status", "dtype")


def _fields(b: torch.Tensor, r: torch.Tensor, rtol: float | None, atol: float | None
            ) -> torch.Tensor:
    low, high = tolerances(b.dtype, rtol, atol)
    return pair_fields(b.reshape(len(b), -1), r.reshape(len(r), -1), low, high, _WIDTH)


def _row(site: str, kind: str, module: str, kind_of: str, status: Status, dtype: str,
         stats: np.ndarray | None, per_sample: int) -> dict[str, Any]:
    row: dict[str, Any] = {"site": site, "kind": kind, "module": module, "type": kind_of,
                           "status": str(status), "dtype": dtype}
    if stats is not None:
        row.update(site_figures(stats, per_sample))
    return row


def _fetched(stats: list[torch.Tensor]) -> list[np.ndarray]:
    """``stats`` (each ``[rows, fields]``) on the host: one transfer per device."""
    if not stats:
        return []
    if len({s.device for s in stats}) > 1:
        stats = [s.cpu() for s in stats]
    block = torch.cat(stats).double().cpu().numpy()
    ends = np.cumsum([len(s) for s in stats])
    return np.split(block, ends[:-1])


@dataclass
class GradStore:
    """The split run's output gradients: per site, one block of rows per pass (the pass's
    compared samples, ascending; passes in order, so the blocks joined are the compared
    samples in order)."""

    rows: dict[str, list[tuple[list[int], torch.Tensor]]] = field(default_factory=dict)

    def sink(self, samples: list[int]) -> Callable[[GradSite, torch.Tensor], None]:
        """The sink of a pass whose compared rows are ``samples``."""
        def keep(site: GradSite, rows: torch.Tensor) -> None:
            self.rows.setdefault(site.key, []).append((samples, rows.clone()))
        return keep

    def joined(self, key: str, samples: list[int]) -> torch.Tensor | None:
        """The stored rows of ``samples`` at ``key`` (None: not all of them stored)."""
        blocks = self.rows.get(key, [])
        if [s for seen, _ in blocks for s in seen] != samples:
            return None
        return blocks[0][1] if len(blocks) == 1 else torch.cat([b for _, b in blocks])


@dataclass
class GradMeter:
    """The batched run's output gradients against the stored rows, in backward order."""

    store: GradStore
    samples: list[int]
    batch_dim: int
    rtol: float | None
    atol: float | None
    found: list[tuple[GradSite, Status, str, torch.Tensor | None, int]] = field(
        default_factory=list)

    def sink(self, site: GradSite, rows: torch.Tensor) -> None:
        """Measures one site's compared rows (``[S, ...]``, batch dim first)."""
        reference = self.store.joined(site.key, self.samples)
        dtype = str(rows.dtype).removeprefix("torch.")
        if reference is None:
            self.found.append((site, Status.MISSING_IN_SPLIT, dtype, None, 0))
            return
        if reference.shape != rows.shape or reference.dtype != rows.dtype:
            status = (Status.SHAPE_MISMATCH if reference.shape != rows.shape
                      else Status.DTYPE_MISMATCH)
            self.found.append((site, status, dtype, None, 0))
            return
        per_sample = rows[0].numel() if len(rows) else 0
        self.found.append((site, Status.OK, dtype,
                           _fields(rows, reference, self.rtol, self.atol), per_sample))

    def rows(self) -> list[dict[str, Any]]:
        """The table's rows (the statistics fetched in one transfer)."""
        fetched = iter(_fetched([stats for _, _, _, stats, _ in self.found
                                 if stats is not None]))
        return [_row(site.key, "grad", site.module, site.module_type, status, dtype,
                     None if stats is None else next(fetched), per_sample)
                for site, status, dtype, stats, per_sample in self.found]


def param_rows(batched: dict[str, torch.Tensor | None], split: dict[str, torch.Tensor | None],
               types: dict[str, str], rtol: float | None, atol: float | None
               ) -> list[dict[str, Any]]:
    """One row per named parameter: the batched run's gradient against the accumulated
    one (the statistics fetched in one transfer)."""
    measured: list[tuple[str, torch.Tensor | None, int, str]] = []
    for name, b in batched.items():
        r = split.get(name)
        if b is None or r is None:
            measured.append((name, None, 0, "missing_in_split" if b is not None else (
                "missing_in_batched" if r is not None else "unbatched")))
            continue
        measured.append((name, _fields(b.reshape(1, -1), r.reshape(1, -1), rtol, atol),
                         b.numel(), str(b.dtype).removeprefix("torch.")))
    fetched = iter(_fetched([s for _, s, _, _ in measured if s is not None]))
    found = []
    for name, s, numel, said in measured:
        module = name.rpartition(".")[0] or ROOT
        if s is None:
            found.append(_row(name, "param", module, types.get(module, ""), Status(said), "",
                              None, 0))
        else:
            found.append(_row(name, "param", module, types.get(module, ""), Status.OK, said,
                              next(fetched), numel))
    return found


def loss_row(batched: float, split: float, dtype: str) -> dict[str, Any]:
    """The loss: the batched run's against the split run's weighted losses summed (in
    float64, each weighted loss as the run backpropagated it)."""
    cast = getattr(torch, dtype)
    b, s = torch.tensor([[batched]], dtype=cast), torch.tensor([[split]], dtype=cast)
    row = _row("loss", "loss", "", "", Status.OK, dtype,
               _fields(b, s, None, None).double().numpy(), 1)
    diff = abs(batched - split)
    row.update(max_abs=diff, mean_abs=diff, rel_l2=diff / abs(split) if split else (
        0.0 if diff == 0 else float("inf")))
    return row
