"""Run-to-run noise: the measured run repeated, and compared with its first pass."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from divtrace.errors import DivtraceValueError
from divtrace.explain.context import Context
from divtrace.explain.held import READS, TWO
from divtrace.explain.probe import Explained, Hooks, Judged, Probe, Spec
from divtrace.explain.view import TableView
from divtrace.measure.figures import site_figures
from divtrace.measure.host import Deferred
from divtrace.plan.checks import whole_number
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows

__all__ = ["Repeat"]

_LABEL = "repeated batched run"


class Repeat(Probe):
    """``Repeat(n)`` (``"repeat"``: two): n more passes of the measured run, each compared
    with the first."""

    spec: ClassVar[Spec] = Spec(
        name="repeat", columns=("noise_mismatch", "noise_rel_l2"),
        shown=("noise_mismatch",), needs=frozenset({"whole_batch", "b_kept"}))

    def __init__(self, times: int = 2) -> None:
        """``times``: how many more passes (at least 1)."""
        if isinstance(times, bool) or not hasattr(times, "__index__") or times < 1:
            raise DivtraceValueError(f"Repeat(times) takes a whole number >= 1; got {times!r}")
        self.times = whole_number(times, "Repeat(times)")
        self.noise: list[dict[str, Deferred]] = []  # per repeat: site key -> stats

    def settings(self) -> dict[str, Any]:
        return {"times": self.times}

    def _after(self, ctx: Context) -> None:
        first = RowStore(ctx.store.samples, ctx.store.batch_dim, False, pinned=True)
        for measured in ctx.meter.sites:
            if measured.kept is not None:
                first.put(measured.site, measured.shape, measured.kept)
            elif measured.kept_parts is not None:  # prompts of different lengths
                first.rows[measured.site.key] = StoredRows(
                    measured.site, measured.shape, None, (), measured.dtype,
                    filled=len(first.samples), parts=list(measured.kept_parts))
        for _ in range(self.times):
            ctx.progress.stage(_LABEL)
            again = ctx.measure(first, label=_LABEL, reads=READS)  # what fill reads
            self.noise.append({m.site.key: m.stats for m in again.sites if m.stats is not None})

    def hooks(self) -> Hooks:
        return Hooks(after=self._after, passes=self.times)

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)))

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        for i, repeat in enumerate(self.noise):
            for row in rows:
                stats = repeat.get(row["site"])
                if stats is None:
                    continue
                figures = site_figures(stats.get(), int(row["numel"]) // view.n_samples, TWO)
                row["noise_mismatch"] = max(row.get("noise_mismatch", 0.0), figures["mismatch"])
                row["noise_rel_l2"] = max(row.get("noise_rel_l2", 0.0), figures["rel_l2"])
                if i == 0 and math.isnan(figures["rel_l2"]):
                    row["noise_rel_l2"] = math.nan

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        table = result.table
        if "noise_mismatch" not in table:
            return []
        ok = table[table["status"] == "ok"]
        noisy = ok[ok["noise_mismatch"] > 0]
        times = f"{result.meta.explain['repeat']['times']} more time(s)"
        if noisy.empty:
            return [f"Repeating the batched run {times} gave bit-identical results: the "
                    f"divergence comes from the batch size, not from run-to-run "
                    f"nondeterminism."]
        return [f"The batched run is not deterministic: repeated {times}, it differed from "
                f"itself at {len(noisy)} site(s), first at '{noisy.iloc[0]['site']}' "
                f"(rel_l2 up to {noisy['noise_rel_l2'].max():.3g}); part of the divergence "
                f"is run-to-run noise."]
