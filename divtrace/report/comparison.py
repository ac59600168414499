"""The result of ``compare()``: a table, per-sample figures, a summary, plots and exports."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pandas as pd
import torch

from divtrace.errors import DivtraceValueError, moved
from divtrace.explain.probe import output_rows
from divtrace.measure.stats import tolerances
from divtrace.report import files, html, text
from divtrace.report.meta import Meta
from divtrace.report.result import ROWS, Result
from divtrace.report.verdict import judge
from divtrace.words import readable, shown

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.explain.probe import Probe

__all__ = ["Comparison", "Origin", "SiteRow"]


class Origin(Protocol):
    """What made a comparison (its plan and model), able to run it again under each
    remedy: :meth:`Comparison.remedies`. Made by the faces (``divtrace.remedies``)."""

    def remedies(self, result: Comparison, candidates: Any, repeats: int,
                 progress: bool) -> Any:
        """The remedies of ``result`` (a :class:`divtrace.remedies.Remedies`)."""


class SiteRow(pd.Series):
    """One site's row (a pandas Series) that prints its fractions as percentages and its
    error figures in scientific notation: ``rel_l2 1.55e-07``, never ``0.0``."""

    @property
    def _constructor(self) -> type[pd.Series]:
        return pd.Series

    def __repr__(self) -> str:
        text = pd.Series({k: shown(str(k), v) for k, v in self.items()}, dtype=object,
                         name=self.name)
        return repr(text)


def _row(frame: pd.DataFrame, position: int = 0) -> SiteRow:
    return SiteRow(frame.iloc[position])


class Comparison(Result):
    """How a batched run and a split run of one model compare, site by site.

    Immutable: :attr:`table` and :attr:`per_sample` return copies, and :meth:`select`
    returns a new object.

    Attributes:
        table: One row per site, in execution order (see :data:`COLUMNS`).
        per_sample: Per-(site, sample) figures: ``mismatch``, ``rel_l2``, ``max_abs``.
        meta: The settings it ran with (:class:`~divtrace.report.meta.Meta`: batch size,
            samples, runs, probes, environment; ``meta.to_dict()`` for plain JSON).
    """

    __slots__ = ("_meta", "_origin", "_pairs", "_probes", "_samples", "_table")
    document = "comparison"
    title = "divtrace report"

    def __init__(self, table: pd.DataFrame,
                 samples: pd.DataFrame | Callable[[], pd.DataFrame], meta: Meta,
                 pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
                 probes: tuple[type[Probe], ...] = (), origin: Origin | None = None) -> None:
        self._origin = origin  # the plan and model, to run it again (None: loaded)
        self._table = table
        self._samples = samples  # or how to make it, on first use
        self._meta = meta
        self._pairs = pairs
        self._probes = probes  # what explains the table: their sentences, their columns

    @property
    def table(self) -> pd.DataFrame:
        return self._table.copy()

    @property
    def sites(self) -> pd.DataFrame:
        """The table as a person reads it: the columns that answer the question (site,
        module type, status, role, mismatch, rel_l2, max_abs, growth, and those the probes
        show), fractions as percentages and error figures in scientific notation (as
        text: a non-zero figure never reads 0). :attr:`table` has every column, as
        numbers."""
        table = self._table
        shown = [*html.COMPACT, *(c for p in self._probes for c in p.spec.shown if c in table)]
        view = readable(table[shown]).astype(object)
        return view.where(view.notna(), "")

    @property
    def per_sample(self) -> pd.DataFrame:
        return self._sample_table().copy()

    def _sample_table(self) -> pd.DataFrame:
        if not isinstance(self._samples, pd.DataFrame):  # made once, when first asked for
            self._samples = self._samples()
        return self._samples

    @property
    def meta(self) -> Meta:
        return self._meta

    @property
    def probes(self) -> tuple[type[Probe], ...]:
        """The explain probes whose columns and sentences this comparison carries."""
        return self._probes

    def select(self, *, leaf: bool | None = None, status: str | None = None) -> Comparison:
        """A new comparison holding only the rows that match (growth is kept as measured)."""
        keep = pd.Series(True, index=self._table.index)
        if leaf is not None:
            keep &= self._table["leaf"] == leaf
        if status is not None:
            keep &= self._table["status"] == status
        table = self._table[keep].reset_index(drop=True)
        samples = self._sample_table()
        samples = samples[samples["site"].isin(table["site"])]
        pairs = {k: v for k, v in self._pairs.items() if k in set(table["site"])}
        return Comparison(table, samples.reset_index(drop=True), self._meta, pairs,
                          self._probes, self._origin)

    # -- lookups -------------------------------------------------------------------

    def _compared(self) -> pd.DataFrame:
        return self._table[self._table["status"] == "ok"]

    @property
    def first_divergence(self) -> pd.Series | None:
        """The first site, in execution order, that is not bit-identical (None if none)."""
        hits = self._compared()
        hits = hits[hits["mismatch"] > 0]
        return None if hits.empty else _row(hits)

    @property
    def verdict(self) -> str:
        """``"identical"``, ``"rounding"`` or ``"not rounding"``: is the divergence the size
        floating-point reordering produces here? (The rule: :mod:`divtrace.report.verdict`;
        :meth:`summary` opens with the reason.)"""
        return judge(self._table, self._meta, self._probes).kind

    @property
    def sources(self) -> pd.DataFrame:
        """The leaf sites where divergence starts: input bit-identical, output not."""
        table = self._table
        return table[table["role"] == "source"].reset_index(drop=True)

    @property
    def output(self) -> pd.Series | None:
        """The row of the model's final output (its first tensor, if it returns several)."""
        rows = output_rows(self._table)
        return None if rows.empty else _row(rows)

    def first_exceeding(self, rtol: float | None = None,
                        atol: float | None = None) -> pd.Series | None:
        """The first site with an element beyond ``rtol``/``atol`` (None if none).

        Elements are judged as ``torch.isclose`` does. Without arguments, the tolerances
        given to ``compare()`` apply (default: ``torch.testing.assert_close``'s per-dtype
        values), using the ``exceed`` column measured during the run. Other tolerances
        need the tensors: run ``compare(..., resources=Resources(keep=True))``.
        """
        same = (rtol is None or rtol == self._meta.rtol) and (
            atol is None or atol == self._meta.atol)
        compared = self._compared()
        if same:
            hits = compared[compared["exceed"] > 0]
            return None if hits.empty else _row(hits)
        if not self._pairs:
            raise DivtraceValueError(
                f"first_exceeding(rtol={rtol}, atol={atol}) differs from the tolerances "
                f"measured during the run (rtol={self._meta.rtol}, "
                f"atol={self._meta.atol}); pass these tolerances to compare(), or run "
                f"compare(..., resources=divtrace.Resources(keep=True)) so that the tensors "
                f"are there to judge"
            )
        for index, row in compared.iterrows():
            batched, split = self.pair(row["site"])
            r, a = tolerances(batched.dtype, rtol, atol)
            if not torch.isclose(batched, split, rtol=r, atol=a).all():
                return SiteRow(compared.loc[index])
        return None

    def pair(self, site: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)``: run a's and run b's rows of the compared samples at ``site`` (needs
        ``resources=Resources(keep=True)``)."""
        if not self._pairs:
            raise DivtraceValueError(
                "run b's rows were not kept; run compare(..., resources=divtrace.Resources("
                "keep=True)) to use pair()")
        if site not in self._pairs:
            known = list(self._pairs)
            shown = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
            raise DivtraceValueError(f"no compared site {site!r}; the sites are: {shown}")
        b, a = self._pairs[site]
        assert a is not None
        assert b is not None
        return a, b

    def remedies(self, candidates: Any = None, *, repeats: int = 5,
                 progress: bool = True) -> Any:
        """Which setting makes the runs bit-identical, and what it costs.

        Each candidate is verified by running this comparison again, on the same model
        and input, with the remedy in force (the default probes only); a remedy scoped
        to the modules where error enters (the sources and, with ``explain=["local"]``,
        the layers that add error of their own) that leaves the runs apart is widened to
        the sources of its own run and tried again. Then the bare passes of both runs
        are timed with each remedy and without, in ``repeats`` interleaved rounds. The
        model, its hooks and every flag are as before afterwards.

        Args:
            candidates: The remedies to try (default: all of
                :data:`divtrace.remedies.NAMES`, in that order): names, ``"defaults"``,
                :class:`divtrace.remedies.Remedy` objects or classes, or callables that
                take the model and return a context manager.
            repeats: Timings per remedy (their median is taken).
            progress: A progress bar on stderr.

        Returns:
            A :class:`divtrace.remedies.Remedies` (``.table``, ``.best``, ``.summary()``).

        Raises:
            DivtraceValueError: The comparison was loaded from a file (or not made by
                :func:`divtrace.compare`), or its runs run a changed copy of the model.

        Example:
            >>> import torch, divtrace
            >>> net = torch.nn.Sequential(torch.nn.Tanh()).eval()  # element-wise
            >>> found = divtrace.compare(net, torch.randn(6, 4), progress=False)
            >>> found.remedies(progress=False).needed
            False
        """
        if self._origin is None:
            raise DivtraceValueError(
                "this comparison does not know the model and input it was made from (it "
                "was loaded from a file, or not made by divtrace.compare); run "
                "divtrace.compare(model, x, ...).remedies() on them")
        return self._origin.remedies(self, candidates, repeats, progress)

    # -- words ---------------------------------------------------------------------

    def summary(self) -> str:
        """A few plain sentences: where divergence starts, how it grows, what it means."""
        return text.summary(self, self._probes)

    def __getattr__(self, name: str) -> Any:
        raise moved(self, name, {
            "info": "meta (the typed settings; meta.to_dict() for a dict)",
            "samples": "per_sample (the per-sample table), or meta.samples (the compared "
                       "rows)"})

    def __repr__(self) -> str:
        first = self.first_divergence
        out = self.output
        where = "no divergence" if first is None else (
            f"first divergence at {first['site']!r} ({first['module_type']})")
        tail = "" if out is None or math.isnan(out["rel_l2"]) else (
            f", output rel_l2 {out['rel_l2']:.3g}")
        return f"<divtrace.Comparison: {len(self._table)} sites, {where}{tail}>"

    def _shade(self) -> str:
        return self.verdict

    def rows(self) -> pd.DataFrame:
        return self._table[list(ROWS)].copy()

    def _shown(self, title: str = "") -> str:
        return html.fragment(self, self._probes)

    def _page(self, title: str) -> str:
        return html.page(self, title, self._probes)

    # -- pictures ------------------------------------------------------------------

    def plot(self, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
        """The snowball plot: ``metric`` against depth over the leaf sites (log scale)."""
        from divtrace.report.plot import plot_snowball

        return plot_snowball(self, ax=ax, metric=metric)

    def plot_samples(self, ax: Axes | None = None, metric: str = "rel_l2") -> Axes:
        """A sample × site heatmap of ``metric`` over the leaf sites."""
        from divtrace.report.plot import plot_samples

        return plot_samples(self, ax=ax, metric=metric)

    def plot_sources(self, ax: Axes | None = None) -> Axes:
        """The sources' divergence, each labelled with the kernels the two runs used."""
        from divtrace.report.plot import plot_sources

        return plot_sources(self, ax=ax)

    # -- files ---------------------------------------------------------------------

    def to_csv(self, path: str | Path) -> Path:
        """Writes :attr:`table` as CSV and returns the path."""
        return files.write_csv(self, path)

    def _fields(self) -> dict[str, Any]:
        from divtrace.report import saved

        return saved.comparison_fields(self)

    @classmethod
    def _restored(cls, doc: dict[str, Any],
                  comparison: Callable[[dict[str, Any]], Comparison]) -> Comparison:
        return comparison(doc)
