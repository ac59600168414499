"""Sweeps over batch sizes: at which batch size does each site start to diverge?"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from divtrace.compare import compare
from divtrace.errors import DivtraceValueError
from divtrace.plan.inputs import prepare_input
from divtrace.report import saved
from divtrace.report.comparison import Comparison
from divtrace.report.result import Result, rows_of
from divtrace.sweep import model_type

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["BatchSweep", "sweep_batch"]


@dataclass(frozen=True)
class BatchSweep(Result):
    """Batched runs of growing batch size against per-sample runs of the same samples.

    Attributes:
        table: Long form: one row per (site, batch_size) with ``mismatch`` and ``rel_l2``.
        onset: One row per site: the smallest swept batch size at which it is no longer
            bit-identical (``NaN``: identical at every size).
        comparisons: The :class:`~divtrace.Comparison` of each batch size.
    """

    table: pd.DataFrame
    onset: pd.DataFrame
    comparisons: dict[int, Comparison]
    document: ClassVar[str] = "batch_sweep"
    title: ClassVar[str] = "divtrace batch sweep"

    def summary(self) -> str:
        """The sizes swept, how many sites stay bit-identical at every one, and where
        divergence sets in first."""
        sizes = sorted(self.comparisons)
        onset = self.onset.dropna(subset=["diverges_from"])
        lines = [f"{len(sizes)} batch size(s) ({', '.join(map(str, sizes))}), each against "
                 f"the same samples run one at a time: {len(self.onset) - len(onset)} of "
                 f"{len(self.onset)} sites bit-identical at every size."]
        if not onset.empty:
            first = int(onset["diverges_from"].min())
            at = onset[onset["diverges_from"] == first]
            lines.append(f"{len(at)} site(s) diverge from B={first} on; the first in "
                         f"execution order: '{at['site'].iloc[0]}'.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<divtrace.BatchSweep: {len(self.comparisons)} batch sizes, "
                f"{len(self.onset)} sites>")

    @property
    def sites(self) -> pd.DataFrame:
        """The compact view: :attr:`onset`."""
        return self.onset

    def rows(self) -> pd.DataFrame:
        """A row per (site, batch size), named ``site at B=size``."""
        table = self.table
        return rows_of(table, "{site} at B={batch_size}", status=table["status"].to_numpy())

    def _fields(self) -> dict[str, Any]:
        return {"table": saved.frame_to_json(self.table),
                "onset": saved.frame_to_json(self.onset),
                "comparisons": [[size, saved.comparison_fields(c)]
                                for size, c in self.comparisons.items()]}

    @classmethod
    def _restored(cls, doc: dict[str, Any],
                  comparison: Callable[[dict[str, Any]], Comparison]) -> BatchSweep:
        return cls(saved.frame_from_json(doc["table"]), saved.frame_from_json(doc["onset"]),
                   {size: comparison(value) for size, value in doc["comparisons"]})

    def _parts(self) -> list[str]:
        from divtrace.report.html import drawn

        return [drawn(self.plot, (10, max(3.0, 0.25 * len(self.onset))))]

    def plot(self, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
        """A site × batch-size heatmap of log10(``metric``); grey where bit-identical."""
        from divtrace.report.plot_sweeps import plot_batch_sweep

        return plot_batch_sweep(self, ax=ax, metric=metric, model=model_type(self.comparisons))


def sweep_batch(model: nn.Module, x: Any, sizes: Iterable[int] | None = None, *,
                samples: Sequence[int] = (0,), batch_dim: int = 0, progress: bool = True,
                **options: Any) -> BatchSweep:
    """At which batch size does each site start to diverge?

    For each batch size s, the first s rows of ``x`` run as one batch and are compared
    with per-sample runs of ``samples`` (which must lie in every swept batch).

    Args:
        model: The model.
        x: Its input, as for :func:`divtrace.compare`, with the largest batch.
        sizes: Batch sizes to sweep (default 2, 4, 8, ... up to B, and B).
        samples: The rows compared at every size.
        batch_dim: The batch dimension.
        progress: A progress bar over the sizes, on stderr.
        **options: Passed to :func:`divtrace.compare` (``modules``, ``rtol``, ...).

    Returns:
        A :class:`BatchSweep`.
    """
    batch = prepare_input(x, batch_dim, stacklevel=3)
    total = batch.batch_size
    if sizes is None:
        sizes = sorted({*(2 ** k for k in range(1, total.bit_length()) if 2 ** k <= total),
                        total})
    sizes = sorted(set(sizes))
    compared = list(samples)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int)
           or not 2 <= s <= total]
    if bad:
        raise DivtraceValueError(f"batch sizes must be whole numbers from 2 to B={total}; "
                                 f"got {bad}")
    if not compared or max(compared) >= sizes[0]:
        raise DivtraceValueError(
            f"samples {compared} must lie in every swept batch; the smallest is "
            f"{sizes[0]} rows, so samples must be below {sizes[0]}")
    rows, comparisons = [], {}
    for size in tqdm(sizes, desc="divtrace: batch sizes", disable=not progress,
                     leave=False):
        args, kwargs = batch.rows(0, size)  # x's first rows, in x's own form
        part: Any = args[0] if isinstance(x, torch.Tensor) else (
            args if isinstance(x, tuple) else kwargs)
        result = compare(model, part, samples=compared, batch_dim=batch_dim,
                         progress=False, **options)
        comparisons[size] = result
        for row in result.table.itertuples():
            rows.append({"site": row.site, "batch_size": size, "status": row.status,
                         "mismatch": row.mismatch, "rel_l2": row.rel_l2})
    table = pd.DataFrame(rows, columns=["site", "batch_size", "status", "mismatch", "rel_l2"])
    diverged = table[table["mismatch"] > 0]
    onset = (diverged.groupby("site", sort=False)["batch_size"].min()
             .reindex(list(dict.fromkeys(table["site"]))).rename("diverges_from")
             .reset_index())
    return BatchSweep(table, onset, comparisons)
