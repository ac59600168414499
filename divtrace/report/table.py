"""From the runs' device-side figures to the table of a :class:`Comparison` (the one host
synchronisation happens here)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from divtrace.align.order import merge
from divtrace.align.ragged import joined
from divtrace.align.status import Status
from divtrace.explain.probe import Probe
from divtrace.explain.registry import PROBES
from divtrace.explain.view import TableView
from divtrace.measure.elements import ELEMENTWISE
from divtrace.measure.figures import FIGURES, Figure, many_site_figures
from divtrace.measure.host import Host
from divtrace.measure.measured import Measured
from divtrace.measure.meter import Meter
from divtrace.plan.make import Plan
from divtrace.record.rows import RowStore
from divtrace.report.comparison import Comparison, Origin
from divtrace.report.meta import Meta

__all__ = ["COLUMNS", "SAMPLE_COLUMNS", "SITE_COLUMNS", "build", "columns"]

#: What a site is: the columns before the figures.
SITE_COLUMNS = ("site", "module", "module_type", "call", "path", "op", "scope", "leaf",
                "status", "shape", "dtype")
#: Figures that count elements: integer columns.
_COUNTS = ("numel", "nonfinite")
#: The per-sample table's columns.
SAMPLE_COLUMNS = ("site", "sample", "mismatch", "rel_l2", "max_abs")


def columns(figures: tuple[Figure, ...], probes: tuple[type[Probe], ...]) -> tuple[str, ...]:
    """The table's columns: the site, its figures, ``growth``, then each probe's."""
    return (*SITE_COLUMNS, *(f.name for f in figures), "growth",
            *(c for probe in probes for c in probe.spec.columns))


#: The columns of :attr:`Comparison.table` of a plain ``compare()`` (the options that are
#: on by default), in order. They are an API: stable names.
COLUMNS = columns(FIGURES, tuple(p for p in PROBES if not p.spec.name or p.spec.default))


def _site_row(site: Measured, blank: dict[str, Any]) -> dict[str, Any]:
    """A site's row: what it is, then ``blank`` (its figures NaN; blank probe columns)."""
    info = site.site
    return {
        "site": info.key, "module": info.module, "module_type": info.module_type,
        "call": info.call, "path": info.path, "op": info.op, "scope": info.scope,
        "leaf": info.leaf, "status": site.status.value,
        "shape": str(site.shape), "dtype": _dtype_name(site.dtype),
    } | blank


def _blank(figures: tuple[Figure, ...]) -> dict[str, float]:
    """Each figure NaN (a site not compared)."""
    return dict.fromkeys((f.name for f in figures), math.nan)


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _measured_rows(plan: Plan, figures: tuple[Figure, ...], sites: list[Measured]
                   ) -> tuple[list[dict[str, Any]], Callable[[], pd.DataFrame],
                              dict[str, tuple[np.ndarray, int]], dict[str, tuple[bool, ...]]]:
    """Per measured site: its row, its fields and its argmax flips; and how to make the
    per-sample table (figures computed for all sites at once; the table made only when
    it is asked for)."""
    batch, samples = plan.batch.batch_size, plan.samples
    blank = _blank(figures)
    rows = [_site_row(site, blank) for site in sites]
    fields: dict[str, tuple[np.ndarray, int]] = {}
    flips = {site.site.key: tuple(site.flips.get().astype(bool).tolist())
             for site in sites if site.flips is not None}
    measured = [(i, site) for i, site in enumerate(sites) if site.stats is not None]
    if not measured:
        return rows, functools.partial(pd.DataFrame, columns=list(SAMPLE_COLUMNS)), fields, flips
    arrays = [site.stats.get() for _, site in measured if site.stats is not None]
    elements = [site.per_sample(batch) for _, site in measured]
    found, mismatch, rel, max_abs = many_site_figures(arrays, elements, figures)
    for (i, site), array, counts, values in zip(measured, arrays, elements, found,
                                                strict=True):
        fields[site.site.key] = (array, counts * len(samples) if isinstance(counts, int)
                                 else int(counts.sum()))
        rows[i] |= values
    keys = [site.site.key for _, site in measured]
    per_sample = functools.partial(_per_sample, keys, samples, mismatch, rel, max_abs)
    return rows, per_sample, fields, flips


def _per_sample(keys: list[str], samples: tuple[int, ...], mismatch: np.ndarray,
                rel: np.ndarray, max_abs: np.ndarray) -> pd.DataFrame:
    """The per-sample table: a row per measured site and compared sample."""
    return pd.DataFrame({
        "site": pd.array(np.repeat(np.array(keys, dtype=object), len(samples)), dtype="str"),
        "sample": np.tile(np.asarray(samples, dtype=np.int64), len(keys)),
        "mismatch": mismatch.reshape(-1), "rel_l2": rel.reshape(-1),
        "max_abs": max_abs.reshape(-1)}, columns=list(SAMPLE_COLUMNS))


def _growth(rel_l2: list[float], leaf: list[bool], mismatch: list[float], op: list[str]
            ) -> list[float]:
    """rel_l2 over that of the nearest preceding divergent leaf site (NaN if none); module
    sites and op sites each among their own kind."""
    growth = []
    previous = {False: math.nan, True: math.nan}
    for rel, is_leaf, share, name in zip(rel_l2, leaf, mismatch, op, strict=True):
        kind = name != ""
        growth.append(rel / previous[kind] if previous[kind] > 0 else math.nan)
        if is_leaf and share > 0 and rel > 0:
            previous[kind] = rel
    return growth


def _in_order(rows: list[dict[str, Any]], store: RowStore, probes: tuple[Probe, ...],
              figures: tuple[Figure, ...]) -> list[dict[str, Any]]:
    """The rows with those of the sites only the reference run reached, in order."""
    reference = [key for key, stored in store.rows.items() if stored.site.input is None]
    blank = _blank(figures) | {k: v for probe in probes for k, v in probe.spec.blank.items()}
    ordered: list[dict[str, Any]] = []
    measured, seen = iter(rows), {row["site"] for row in rows}
    for key in merge([row["site"] for row in rows], reference):
        if key in seen:
            ordered.append(next(measured))
            continue
        stored = store.rows[key]
        missing = Measured(stored.site, Status.MISSING_IN_BATCHED, stored.shape, stored.dtype)
        ordered.append(_site_row(missing, blank))
    return ordered


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _flags(values: list[Any]) -> bool:
    """Whether a column's values are booleans, some of them missing."""
    present = [v for v in values if not _missing(v)]
    return bool(present) and all(isinstance(v, bool | np.bool_) for v in present)


def build(plan: Plan, probes: tuple[Probe, ...], meter: Meter, meta: Meta, host: Host,
          figures: tuple[Figure, ...] = FIGURES, origin: Origin | None = None) -> Comparison:
    """Assembles the :class:`Comparison` of a finished run (fetches the figures first);
    ``origin``: how to run it again, for :meth:`Comparison.remedies`."""
    host.fetch()
    rows, samples, fields, flips = _measured_rows(plan, figures, meter.sites)
    call_keys = {s.site.key: s.site.call_key for s in meter.sites if s.site.op}
    view = TableView(fields, meter.calls, plan.batch.batch_size, len(plan.samples), call_keys)
    for probe in probes:
        probe.fill(rows, view)
    rows = _in_order(rows, meter.store, probes, figures)
    names = columns(figures, tuple(type(p) for p in probes))
    data: dict[str, Any] = {c: [row.get(c, math.nan) for row in rows]
                            for c in names if c != "growth"}
    data["growth"] = np.asarray(
        _growth(data["rel_l2"], data["leaf"], data["mismatch"], data["op"]), dtype=float)
    for count in _COUNTS:  # counts, missing where a site was not compared
        if count in data:
            data[count] = pd.array(data[count], dtype="Int64")
    for probe in probes:  # yes/no columns, missing where a site was not judged
        for column in probe.spec.columns:
            if _flags(data[column]):
                data[column] = pd.array([None if _missing(v) else bool(v)
                                         for v in data[column]], dtype="boolean")
    table = pd.DataFrame({c: data[c] for c in names}, columns=list(names))
    pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {
        s.site.key: (s.kept, meter.store.rows[s.site.key].rows)
        for s in meter.sites if s.kept is not None}
    for s in meter.sites:  # prompts of different lengths: their real tokens, end to end
        parts = meter.store.rows[s.site.key].parts if s.kept_parts is not None else None
        if s.kept_parts is not None and parts is not None:
            pairs[s.site.key] = (joined(s.kept_parts), joined(parts))
    views = {s.site.key: dict(zip(ELEMENTWISE, s.elements_view.get().tolist(), strict=True))
             for s in meter.sites if s.elements_view is not None}
    notes = {**meta.notes, "output_elements": views} if views else meta.notes
    return Comparison(table, samples, replace(meta, flips=flips, notes=notes), pairs,
                      tuple(type(p) for p in probes), origin)
