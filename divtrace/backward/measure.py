"""The gradients of the two runs, measured: each site's output gradient per compared
sample (the split run's rows stored, the batched run's measured against them in its
backward pass), each parameter's gradient whole, and the loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

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


@dataclass
class GradStore:
    """The split run's output gradients: per site, per compared sample, its row."""

    rows: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def sink(self, samples: list[int]) -> Callable[[GradSite, torch.Tensor], None]:
        """The sink of a pass whose compared rows are ``samples``, in order."""
        def keep(site: GradSite, rows: torch.Tensor) -> None:
            kept = self.rows.setdefault(site.key, {})
            for i, sample in enumerate(samples):
                kept[sample] = rows.select(0, i).clone()  # batch_dim moved first below
        return keep


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
        kept = self.store.rows.get(site.key, {})
        dtype = str(rows.dtype).removeprefix("torch.")
        if any(s not in kept for s in self.samples):
            self.found.append((site, Status.MISSING_IN_SPLIT, dtype, None, 0))
            return
        reference = torch.stack([kept[s] for s in self.samples])
        if reference.shape != rows.shape or reference.dtype != rows.dtype:
            status = (Status.SHAPE_MISMATCH if reference.shape != rows.shape
                      else Status.DTYPE_MISMATCH)
            self.found.append((site, status, dtype, None, 0))
            return
        per_sample = rows[0].numel() if len(rows) else 0
        self.found.append((site, Status.OK, dtype,
                           _fields(rows, reference, self.rtol, self.atol), per_sample))

    def rows(self) -> list[dict[str, Any]]:
        """The table's rows (one host synchronisation per site's statistics)."""
        return [_row(site.key, "grad", site.module, site.module_type, status, dtype,
                     None if stats is None else stats.double().cpu().numpy(), per_sample)
                for site, status, dtype, stats, per_sample in self.found]


def param_rows(batched: dict[str, torch.Tensor | None], split: dict[str, torch.Tensor | None],
               types: dict[str, str], rtol: float | None, atol: float | None
               ) -> list[dict[str, Any]]:
    """One row per named parameter: the batched run's gradient against the accumulated one."""
    found = []
    for name, b in batched.items():
        r = split.get(name)
        module = name.rpartition(".")[0]
        if b is None or r is None:
            found.append(_row(name, "param", module, types.get(module, ""),
                              Status.MISSING_IN_SPLIT if r is None and b is not None else (
                                  Status.MISSING_IN_BATCHED if r is not None else
                                  Status.UNBATCHED), "", None, 0))
            continue
        dtype = str(b.dtype).removeprefix("torch.")
        stats = _fields(b.reshape(1, -1), r.reshape(1, -1), rtol, atol)
        found.append(_row(name, "param", module, types.get(module, ""), Status.OK, dtype,
                          stats.double().cpu().numpy(), b.numel()))
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
