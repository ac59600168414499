"""The result of ``compare()``: a table, per-sample figures, a summary, plots and exports."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from divtrace import report
from divtrace.errors import DivtraceValueError
from divtrace.measure import Measured
from divtrace.metrics import FIELDS, rel_l2, site_figures, tolerances
from divtrace.sites import ROOT
from divtrace.split import SplitRecording

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["COLUMNS", "Comparison", "build"]

#: The columns of :attr:`Comparison.table`, in order. They are an API: stable names.
COLUMNS = (
    "site", "module", "module_type", "call", "path", "leaf", "status", "shape", "dtype",
    "numel", "mismatch", "exceed", "max_abs", "mean_abs", "rel_l2", "max_ulp", "cosine",
    "nonfinite", "growth",
)
_FIGURES = ("numel", "mismatch", "exceed", "max_abs", "mean_abs", "rel_l2", "max_ulp",
            "cosine", "nonfinite")


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Brings device tensors to the host: one transfer (one synchronisation) per device."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_device[t.device].append(i)
    out: list[np.ndarray] = [np.empty(0)] * len(tensors)
    for indices in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices]).cpu().numpy()
        offset = 0
        for i in indices:
            size = tensors[i].numel()
            out[i] = flat[offset:offset + size].reshape(tuple(tensors[i].shape))
            offset += size
    return out


def _row(site: Measured) -> dict[str, Any]:
    obs = site.site
    return {
        "site": obs.key, "module": obs.module, "module_type": obs.module_type,
        "call": obs.call, "path": obs.path, "leaf": obs.leaf, "status": site.status,
        "shape": str(site.shape), "dtype": str(site.dtype).removeprefix("torch."),
    }


def build(sites: list[Measured], split: SplitRecording, meta: dict[str, Any]) -> Comparison:
    """Assembles a :class:`Comparison` (the one host synchronisation happens here)."""
    stats_of = [(s, s.stats) for s in sites if s.stats is not None]
    flips_of = [(s, s.flips) for s, _ in stats_of if s.flips is not None]
    host = _to_host([t for _, t in stats_of] + [t for _, t in flips_of])
    measured = [s for s, _ in stats_of]
    flipped = [s for s, _ in flips_of]
    stats, flips = host[:len(measured)], host[len(measured):]
    per_site = {id(s): a for s, a in zip(measured, stats, strict=True)}

    rows: list[dict[str, Any]] = []
    sample_rows: list[dict[str, Any]] = []
    samples = meta["samples"]
    for site in sites:
        row = _row(site) | dict.fromkeys(_FIGURES, math.nan)
        array = per_site.get(id(site))
        if array is not None:
            per_sample = int(np.prod(site.shape)) // meta["batch_size"]
            row |= site_figures(array, per_sample)
            col = {name: array[:, i] for i, name in enumerate(FIELDS)}
            sample_rel = np.atleast_1d(rel_l2(np.sqrt(col["sq_diff"]), np.sqrt(col["sq_ref"])))
            for j, sample in enumerate(samples):
                sample_rows.append({
                    "site": site.site.key, "sample": sample,
                    "mismatch": col["mismatch"][j] / per_sample if per_sample else 0.0,
                    "rel_l2": float(sample_rel[j]), "max_abs": col["max_abs"][j],
                })
        rows.append(row)

    seen = {s.site.key for s in sites}
    order = list(split.refs)
    for i, key in enumerate(order):  # sites the split run reached and the batched did not
        if key in seen:
            continue
        ref = split.refs[key]
        missing = Measured(ref.site, "missing_in_batched", ref.shape, ref.dtype)
        before = next((k for k in reversed(order[:i]) if k in seen), None)
        at = 0 if before is None else 1 + next(
            j for j, r in enumerate(rows) if r["site"] == before)
        rows.insert(at, _row(missing) | dict.fromkeys(_FIGURES, math.nan))
        seen.add(key)

    table = pd.DataFrame(rows, columns=[c for c in COLUMNS if c != "growth"])
    table["numel"] = table["numel"].astype("Int64")
    table["nonfinite"] = table["nonfinite"].astype("Int64")
    table["growth"] = _growth(table)
    sample_table = pd.DataFrame(
        sample_rows, columns=["site", "sample", "mismatch", "rel_l2", "max_abs"])
    extras = {
        "flips": {s.site.key: a.astype(bool).tolist() for s, a in zip(flipped, flips,
                                                                     strict=True)},
    }
    pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {
        s.site.key: (s.kept, split.refs[s.site.key].rows) for s in sites if s.kept is not None}
    return Comparison(table, sample_table, meta | extras, pairs)


def _growth(table: pd.DataFrame) -> pd.Series:
    """rel_l2 over that of the nearest preceding divergent leaf site (NaN if none)."""
    growth = []
    previous = math.nan
    for rel, leaf, mismatch in zip(table["rel_l2"], table["leaf"], table["mismatch"],
                                   strict=True):
        growth.append(rel / previous if previous > 0 else math.nan)
        if leaf and mismatch > 0 and rel > 0:
            previous = rel
    return pd.Series(growth, index=table.index, dtype=float)


class Comparison:
    """How a batched run and a split run of one model compare, site by site.

    Immutable: :attr:`table` and :attr:`samples` return copies, and :meth:`select`
    returns a new object.

    Attributes:
        table: One row per site, in execution order (see :data:`COLUMNS`).
        samples: Per-(site, sample) figures: ``mismatch``, ``rel_l2``, ``max_abs``.
        meta: The run's settings (batch size, chunk, samples, ...).
    """

    __slots__ = ("_meta", "_pairs", "_samples", "_table")

    def __init__(self, table: pd.DataFrame, samples: pd.DataFrame, meta: dict[str, Any],
                 pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]) -> None:
        self._table = table
        self._samples = samples
        self._meta = meta
        self._pairs = pairs

    @property
    def table(self) -> pd.DataFrame:
        return self._table.copy()

    @property
    def samples(self) -> pd.DataFrame:
        return self._samples.copy()

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._meta))

    def select(self, *, leaf: bool | None = None, status: str | None = None) -> Comparison:
        """A new comparison holding only the rows that match (growth is kept as measured)."""
        keep = pd.Series(True, index=self._table.index)
        if leaf is not None:
            keep &= self._table["leaf"] == leaf
        if status is not None:
            keep &= self._table["status"] == status
        table = self._table[keep].reset_index(drop=True)
        samples = self._samples[self._samples["site"].isin(table["site"])]
        pairs = {k: v for k, v in self._pairs.items() if k in set(table["site"])}
        return Comparison(table, samples.reset_index(drop=True), self._meta, pairs)

    # -- lookups -------------------------------------------------------------------

    def _compared(self) -> pd.DataFrame:
        return self._table[self._table["status"] == "ok"]

    @property
    def first_divergence(self) -> pd.Series | None:
        """The first site, in execution order, that is not bit-identical (None if none)."""
        hits = self._compared()
        hits = hits[hits["mismatch"] > 0]
        return None if hits.empty else hits.iloc[0]

    @property
    def output(self) -> pd.Series | None:
        """The row of the model's final output (its first tensor, if it returns several)."""
        rows = self._table[(self._table["module"] == ROOT) & (self._table["call"] == 0)]
        return None if rows.empty else rows.iloc[0]

    def first_exceeding(self, rtol: float | None = None,
                        atol: float | None = None) -> pd.Series | None:
        """The first site with an element beyond ``rtol``/``atol`` (None if none).

        Elements are judged as ``torch.isclose`` does. Without arguments, the tolerances
        given to ``compare()`` apply (default: ``torch.testing.assert_close``'s per-dtype
        values), using the ``exceed`` column measured during the run. Other tolerances
        need the tensors: run ``compare(..., keep=True)``.
        """
        same = (rtol is None or rtol == self._meta["rtol"]) and (
            atol is None or atol == self._meta["atol"])
        compared = self._compared()
        if same:
            hits = compared[compared["exceed"] > 0]
            return None if hits.empty else hits.iloc[0]
        if not self._pairs:
            raise DivtraceValueError(
                f"first_exceeding(rtol={rtol}, atol={atol}) differs from the tolerances "
                f"measured during the run (rtol={self._meta['rtol']}, "
                f"atol={self._meta['atol']}); pass these tolerances to compare(), or run "
                f"compare(..., keep=True) so that the tensors are there to judge"
            )
        for index, row in compared.iterrows():
            batched, split = self.pair(row["site"])
            r, a = tolerances(batched.dtype, rtol, atol)
            if not torch.isclose(batched, split, rtol=r, atol=a).all():
                return compared.loc[index]
        return None

    def pair(self, site: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(batched, split)``: the compared samples' rows at ``site`` (needs keep=True)."""
        if not self._pairs:
            raise DivtraceValueError(
                "the tensors were not kept; run compare(..., keep=True) to use pair()")
        if site not in self._pairs:
            known = list(self._pairs)
            shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
            raise DivtraceValueError(f"no compared site {site!r}; the sites are: {shown}")
        batched, split = self._pairs[site]
        assert batched is not None
        assert split is not None
        return batched, split

    # -- words ---------------------------------------------------------------------

    def summary(self) -> str:
        """A few plain sentences: where divergence starts, how it grows, what it means."""
        return report.summary(self)

    def __repr__(self) -> str:
        first = self.first_divergence
        out = self.output
        where = "no divergence" if first is None else (
            f"first divergence at {first['site']!r} ({first['module_type']})")
        tail = "" if out is None or math.isnan(out["rel_l2"]) else (
            f", output rel_l2 {out['rel_l2']:.3g}")
        return f"<divtrace.Comparison: {len(self._table)} sites, {where}{tail}>"

    def _repr_html_(self) -> str:
        try:
            return report.html_fragment(self)
        except Exception:  # a notebook must always show something
            return f"<pre>{report.escape(self.summary())}</pre>"

    # -- pictures ------------------------------------------------------------------

    def plot(self, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
        """The snowball plot: ``metric`` against depth over the leaf sites (log scale)."""
        from divtrace.plot import plot_snowball

        return plot_snowball(self, ax=ax, metric=metric)

    def plot_samples(self, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
        """A sample × site heatmap of ``metric`` over the leaf sites."""
        from divtrace.plot import plot_samples

        return plot_samples(self, ax=ax, metric=metric)

    # -- files ---------------------------------------------------------------------

    def to_csv(self, path: str | Path) -> Path:
        """Writes :attr:`table` as CSV and returns the path."""
        path = Path(path)
        self._table.to_csv(path, index=False)
        return path

    def to_json(self, path: str | Path) -> Path:
        """Writes the settings, summary, table and per-sample figures as JSON."""
        path = Path(path)
        doc = {
            "meta": self.meta,
            "summary": self.summary(),
            "table": json.loads(self._table.to_json(orient="records")),
            "samples": json.loads(self._samples.to_json(orient="records")),
        }
        path.write_text(json.dumps(doc, indent=1))
        return path

    def to_html(self, path: str | Path, title: str = "divtrace report") -> Path:
        """Writes a self-contained HTML report (plots embedded) and returns the path."""
        path = Path(path)
        path.write_text(report.html_page(self, title))
        return path
