"""The registry of figures: the table's numeric columns, made from a site's fields.

A figure turns the per-sample fields of one site (:mod:`~divtrace.measure.fields`) into
one number of the table. Adding a column that the existing fields can give is adding
one :class:`Figure` to :data:`FIGURES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from divtrace.measure.fields import INDEX

__all__ = ["FIGURES", "Figure", "SiteFields", "cosine", "many_site_figures", "rel_l2",
           "sample_figures", "site_figures"]


class SiteFields:
    """The per-sample fields of one site, ``[samples, fields]`` on the host."""

    def __init__(self, stats: np.ndarray, elements_per_sample: int | np.ndarray,
                 totals: np.ndarray | None = None, maxima: np.ndarray | None = None,
                 numel: int | None = None) -> None:
        self.stats = stats
        self.per_sample = elements_per_sample  # one count, or one per sample
        self.numel = (int(np.broadcast_to(elements_per_sample, (stats.shape[0],)).sum())
                      if numel is None else numel)
        # each field summed and maximised over the samples, when computed for many sites
        # at once (:func:`many_site_figures`): the same numbers, without a call per figure
        self._totals, self._maxima = totals, maxima

    def column(self, name: str) -> np.ndarray:
        return self.stats[:, INDEX[name]]

    def sum(self, name: str) -> float:
        if self._totals is not None:
            return self._totals[INDEX[name]]
        return self.column(name).sum()

    def max(self, name: str) -> float:
        if self._maxima is not None:
            return float(self._maxima[INDEX[name]])
        return float(self.column(name).max())

    def norm(self, name: str) -> float:
        """The square root of a summed square (``sq_diff``, ``sq_ref``, ``sq_out``)."""
        return math.sqrt(self.sum(name))

    def share(self, name: str) -> float:
        """A count as a fraction of the site's elements."""
        return self.sum(name) / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class Figure:
    """One numeric column of the table: a name, its rule and what it means."""

    name: str
    compute: Callable[[SiteFields], float]
    doc: str = ""


def rel_l2(diff_norm: float | np.ndarray, ref_norm: float | np.ndarray) -> np.ndarray | float:
    """‖batched − split‖ / ‖split‖: 0 when both are 0, inf when only the split is 0."""
    if isinstance(diff_norm, float) and isinstance(ref_norm, float):  # one site: no numpy
        if diff_norm == 0:
            return 0.0
        if ref_norm == 0:  # as numpy divides: ±inf, or NaN for NaN
            return (math.copysign(math.inf, diff_norm) * math.copysign(1.0, ref_norm)
                    if diff_norm == diff_norm else math.nan)
        return float(diff_norm) / float(ref_norm)  # Python floats: no numpy warnings
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = np.divide(diff_norm, ref_norm)
    ratio = np.where(np.asarray(diff_norm) == 0, 0.0, ratio)
    return float(ratio) if np.ndim(ratio) == 0 else ratio


def cosine(diff_square: float, out_norm: float, ref_norm: float) -> float:
    """Cosine similarity of two runs' rows from ‖b − r‖², ‖b‖ and ‖r‖: 1 when both are
    zero, 0 when only one is.

    It is 1 − (‖b − r‖² − (‖b‖ − ‖r‖)²) / (2‖b‖‖r‖), the same number as b·r / (‖b‖‖r‖),
    written so that it keeps its precision where the runs nearly agree: there 1 − cos is
    about rel_l2² / 2 (near 1e-14 for float32 rounding), far below the rounding of a dot
    product summed in float32, and the difference of nearly equal norms loses no more
    than a few digits of that small number.
    """
    if out_norm == 0 and ref_norm == 0:
        return 1.0
    if out_norm == 0 or ref_norm == 0:
        return 0.0
    if not (math.isfinite(diff_square) and math.isfinite(out_norm)
            and math.isfinite(ref_norm)):
        return math.nan  # norms beyond float64 (e.g. masks of the dtype's lowest value)
    gap = out_norm - ref_norm  # divided step by step: no overflow of the products
    away = 0.5 * (diff_square / out_norm / ref_norm - (gap / out_norm) * (gap / ref_norm))
    return float(min(1.0, max(-1.0, 1.0 - away)))


def _mean_abs(f: SiteFields) -> float:
    finite = f.numel - f.sum("nonfinite")
    return f.sum("sum_abs") / finite if finite else math.nan


def _rel_l2(f: SiteFields) -> float:
    """rel_l2, or NaN where sums of squares underflowed to 0 or overflowed to inf while
    the values differ (never a false 0). float64 rows are summed at their own scale
    (:mod:`~divtrace.measure.scale`), so this is left to rows whose error is below about
    1e-154 of their values, or samples of one site more than about 1e150 apart."""
    rel = float(rel_l2(f.norm("sq_diff"), f.norm("sq_ref")))
    if rel == 0 and f.max("max_abs") > 0:
        return math.nan
    if f.sum("nonfinite") == 0 and not (math.isfinite(f.sum("sq_diff"))
                                        and math.isfinite(f.sum("sq_ref"))):
        return math.nan
    return rel


def _cosine(f: SiteFields) -> float:
    if f.sum("mismatch") == 0:
        return 1.0
    if math.isnan(_rel_l2(f)) and f.sum("nonfinite") == 0:
        return math.nan  # the squares underflowed or overflowed
    return cosine(f.sum("sq_diff"), f.norm("sq_out"), f.norm("sq_ref"))


#: The figures, in the order of the table's columns.
FIGURES: tuple[Figure, ...] = (
    Figure("numel", lambda f: float(f.numel), "compared elements"),
    Figure("mismatch", lambda f: f.share("mismatch"),
           "fraction of elements not bit-identical (+0.0 vs -0.0 and NaN vs NaN do not count)"),
    Figure("exceed", lambda f: f.share("exceed"), "fraction beyond rtol/atol"),
    Figure("max_abs", lambda f: f.max("max_abs"), "max |batched - split|"),
    Figure("mean_abs", _mean_abs, "mean |batched - split| over finite pairs"),
    Figure("rel_l2", _rel_l2, "‖batched − split‖ / ‖split‖ (NaN where the sums of squares "
           "cannot hold it, never a false 0)"),
    Figure("max_ulp", lambda f: f.max("max_ulp"), "max ULP distance in the tensor's own dtype"),
    Figure("cosine", _cosine, "cosine similarity of the two runs' rows"),
    Figure("nonfinite", lambda f: f.sum("nonfinite"), "elements NaN or infinite in either run"),
)


def site_figures(stats: np.ndarray, elements_per_sample: int | np.ndarray,
                 figures: tuple[Figure, ...] = FIGURES) -> dict[str, float]:
    """The site-level figures of one site from its per-sample ``[S, fields]`` stats."""
    fields = SiteFields(stats, elements_per_sample)
    return {figure.name: figure.compute(fields) for figure in figures}


def many_site_figures(stats: list[np.ndarray], elements: list[int | np.ndarray],
                      figures: tuple[Figure, ...] = FIGURES
                      ) -> tuple[list[dict[str, float]], np.ndarray, np.ndarray, np.ndarray]:
    """:func:`site_figures` and :func:`sample_figures` of many sites with the same
    samples at once: per site its figures, and ``[sites, samples]`` arrays of mismatch,
    rel_l2 and max_abs. Every number is the one a site alone gives: sums run along each
    field's samples as a contiguous row (numpy's summation of a 1-D column), maxima are
    exact."""
    stack = np.stack(stats)  # [sites, samples, fields]
    totals = np.ascontiguousarray(stack.transpose(0, 2, 1)).sum(-1)
    maxima = stack.max(1)
    counts = _counts(elements, stack.shape[1])
    numels = counts.sum(1).astype(np.int64).tolist()  # exact: counts are whole numbers
    found = []
    for i, (array, e) in enumerate(zip(stats, elements, strict=True)):
        site = SiteFields(array, e, totals[i], maxima[i], numels[i])
        found.append({figure.name: figure.compute(site) for figure in figures})
    mismatch = np.divide(stack[:, :, INDEX["mismatch"]], counts,
                         out=np.zeros(counts.shape), where=counts > 0)
    rel = _unmeasured(np.asarray(rel_l2(np.sqrt(stack[:, :, INDEX["sq_diff"]]),
                                        np.sqrt(stack[:, :, INDEX["sq_ref"]])), dtype=float),
                      stack)
    return found, mismatch, rel.reshape(counts.shape), stack[:, :, INDEX["max_abs"]]


def _unmeasured(rel: np.ndarray, stack: np.ndarray) -> np.ndarray:
    """Per sample, NaN where the squares underflowed or overflowed (see :func:`_rel_l2`)."""
    lost = (rel == 0) & (stack[..., INDEX["max_abs"]] > 0)
    lost |= (stack[..., INDEX["nonfinite"]] == 0) & ~(
        np.isfinite(stack[..., INDEX["sq_diff"]]) & np.isfinite(stack[..., INDEX["sq_ref"]]))
    return np.where(lost, np.nan, rel)


def _counts(elements: list[int | np.ndarray], samples: int) -> np.ndarray:
    """``[sites, samples]``: each site's compared elements per sample, as floats."""
    if all(isinstance(e, int) for e in elements):  # one count per site: one array
        return np.repeat(np.array(elements, dtype=float)[:, None], samples, axis=1)
    return np.stack([np.broadcast_to(np.asarray(e, dtype=float), (samples,))
                     for e in elements])


def sample_figures(stats: np.ndarray, elements_per_sample: int | np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample: ``mismatch`` (a fraction), ``rel_l2`` and ``max_abs``."""
    fields = SiteFields(stats, elements_per_sample)
    counts = np.broadcast_to(np.asarray(elements_per_sample, dtype=float), (len(stats),))
    mismatch = np.divide(fields.column("mismatch"), counts, out=np.zeros(len(stats)),
                         where=counts > 0)
    rel = _unmeasured(np.atleast_1d(rel_l2(np.sqrt(fields.column("sq_diff")),
                                           np.sqrt(fields.column("sq_ref")))), stats)
    return mismatch, rel, fields.column("max_abs")
