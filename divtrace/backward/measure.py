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
from divtrace.measure.host import Deferred, Host
from divtrace.measure.pair import pair_fields
from divtrace.measure.stats import tolerances

__all__ = ["GradMeter", "GradStore", "Pending", "loss_row", "param_rows"]

_WIDTH = 1 << 18


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


@dataclass(frozen=True)
class Pending:
    """A row of the table whose statistics arrive with the host's one fetch."""

    site: str
    kind: str
    module: str
    type: str
    status: Status
    dtype: str
    stats: Deferred | None = None
    per_sample: int = 0

    def row(self) -> dict[str, Any]:
        """The row (after :meth:`Host.fetch`)."""
        return _row(self.site, self.kind, self.module, self.type, self.status, self.dtype,
                    None if self.stats is None else self.stats.get(), self.per_sample)


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
    host: Host
    rtol: float | None
    atol: float | None
    found: list[Pending] = field(default_factory=list)

    def sink(self, site: GradSite, rows: torch.Tensor) -> None:
        """Measures one site's compared rows (``[S, ...]``, batch dim first)."""
        reference = self.store.joined(site.key, self.samples)
        dtype = str(rows.dtype).removeprefix("torch.")
        status, stats, per_sample = Status.OK, None, 0
        if reference is None:
            status = Status.MISSING_IN_SPLIT
        elif reference.shape != rows.shape:
            status = Status.SHAPE_MISMATCH
        elif reference.dtype != rows.dtype:
            status = Status.DTYPE_MISMATCH
        else:
            stats = self.host.add(_fields(rows, reference, self.rtol, self.atol))
            per_sample = rows[0].numel() if len(rows) else 0
        self.found.append(Pending(site.key, "grad", site.module, site.module_type, status,
                                  dtype, stats, per_sample))


def param_rows(batched: dict[str, torch.Tensor | None], split: dict[str, torch.Tensor | None],
               types: dict[str, str], host: Host, rtol: float | None, atol: float | None
               ) -> list[Pending]:
    """One row per named parameter: the batched run's gradient against the accumulated
    one."""
    found = []
    for name, b in batched.items():
        r = split.get(name)
        module = name.rpartition(".")[0] or ROOT
        kind_of = types.get(module, "")
        if b is None or r is None:
            status = (Status.MISSING_IN_SPLIT if b is not None else
                      Status.MISSING_IN_BATCHED if r is not None else Status.UNBATCHED)
            found.append(Pending(name, "param", module, kind_of, status, ""))
            continue
        stats = host.add(_fields(b.reshape(1, -1), r.reshape(1, -1), rtol, atol))
        found.append(Pending(name, "param", module, kind_of, Status.OK,
                             str(b.dtype).removeprefix("torch."), stats, b.numel()))
    return found


def loss_row(batched: float, split: float, dtype: str) -> dict[str, Any]:
    """The loss: the batched run's against the split run's weighted losses summed (in
    float64, from each chunk's loss and weight)."""
    cast = getattr(torch, dtype)
    b, s = torch.tensor([[batched]], dtype=cast), torch.tensor([[split]], dtype=cast)
    row = _row("loss", "loss", "", "", Status.OK, dtype,
               _fields(b, s, None, None).double().numpy(), 1)
    diff = abs(batched - split)
    row.update(max_abs=diff, mean_abs=diff, rel_l2=diff / abs(split) if split else (
        0.0 if diff == 0 else float("inf")))
    return row
