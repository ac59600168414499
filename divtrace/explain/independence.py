"""The independence test: is each sample's result a function of that sample alone?

Kernels are chosen from shapes, not from values. So the measured run (the whole batch in
one pass) runs once more with the same shapes: the compared samples' rows unchanged, at
their own positions, every other sample's rows given other valid data
(:meth:`~divtrace.plan.inputs.BatchedInput.replaced`). At every site the compared rows
of the two passes are compared bit for bit. Rows that move have let other samples in
(batch mixing: a statistic over the batch, a wrong ``batch_dim``, padding that is not
masked) — whatever the size of the move. When every sample is compared, one half is held
while the other is replaced, then the other way round.

When some rows move, the pass is repeated on the unchanged batch: a site where the
repetition moves too (a kernel that is not deterministic) makes the test inconclusive
from there on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
from torch import nn

from divtrace.align.status import Status
from divtrace.errors import DivtraceTypeError
from divtrace.explain.probe import Context, Probe, TableView
from divtrace.measure.figures import site_figures
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.plan.inputs import BatchedInput
from divtrace.record.lineage import Origin
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows
from divtrace.words import sci

if TYPE_CHECKING:
    from divtrace.report.comparison import Comparison

__all__ = ["Independence", "first_dependent"]

_LABEL = "independence test"


def _groups(samples: list[int], size: int) -> list[list[int]]:
    """The rows held fixed in each pass: the compared samples, or, when every row is
    compared, each half in turn."""
    if len(samples) < size:
        return [samples]
    half = len(samples) // 2
    return [samples[:half], samples[half:]]


def _kept_store(ctx: Context, group: list[int]) -> RowStore:
    """The measured run's kept rows of the samples in ``group``, as a row store."""
    store = ctx.store
    where = [store.samples.index(s) for s in group]
    lo, n = where[0], len(where)
    contiguous = where == list(range(lo, lo + n))
    kept = RowStore(list(group), store.batch_dim, False, learn_lineage=False, pinned=True)
    for measured in ctx.meter.sites:
        if measured.status != Status.OK or measured.site.key in kept.rows:
            continue
        if measured.kept is not None:
            rows = measured.kept
            part = rows.narrow(0, lo, n) if contiguous else rows[where]
            kept.put(measured.site, measured.shape, part)
        elif measured.kept_parts is not None:  # prompts of different lengths
            kept.rows[measured.site.key] = StoredRows(
                measured.site, measured.shape, None, (), measured.dtype, filled=n,
                parts=[measured.kept_parts[i] for i in where])
    return kept


def _measured(ctx: Context, store: RowStore, batch: BatchedInput, host: Host) -> Meter:
    """A pass of ``batch``, its fixed rows measured against ``store`` (the figures go to
    ``host``)."""
    meter = ctx.meter.over(store, host)
    ctx.compared.execute(meter, batch, [(0, batch.batch_size)], lambda _s, _e: _LABEL,
                         check=ctx.check)
    ctx.progress.advance()
    return meter


def _moves(meter: Meter, batch: int) -> dict[str, tuple[float, float]]:
    """Per site of a measured pass: ``(mismatch, rel_l2)`` (after its host fetched)."""
    found: dict[str, tuple[float, float]] = {}
    for measured in meter.sites:
        if measured.stats is None:
            continue
        figures = site_figures(measured.stats.get(), measured.per_sample(batch))
        found[measured.site.key] = (figures["mismatch"], figures["rel_l2"])
    return found


class Independence(Probe):
    """``independence=True`` (the default): the independence test behind the verdict."""

    option: ClassVar[str] = "independence"
    on_by_default: ClassVar[bool] = True
    columns: ClassVar[tuple[str, ...]] = ("depends_on_others", "others_rel_l2")
    shown: ClassVar[tuple[str, ...]] = ("depends_on_others",)
    keeps_batched: ClassVar[bool] = True
    leads: ClassVar[bool] = True
    passes = 1

    def __init__(self) -> None:
        self.moved: dict[str, tuple[float, float]] = {}  # site -> (mismatch, rel_l2)
        self.noisy: list[str] = []  # sites that moved on a repetition with the same input
        self.tested: set[str] = set()
        self.found: dict[str, Any] = {"ran": False, "why": None}

    @classmethod
    def create(cls, options: Mapping[str, Any], model: nn.Module) -> Independence | None:
        independence = options.get("independence", True)
        if not isinstance(independence, bool):
            raise DivtraceTypeError(
                f"independence must be True (test whether each sample's rows depend on the "
                f"other samples: one more batched pass, two when every sample is compared) "
                f"or False; got {independence!r}")
        return cls() if independence else None

    def after(self, ctx: Context) -> None:
        plan = ctx.plan
        ctx.progress.stage(_LABEL)
        if plan.compared_chunks:
            self._skip(ctx, "run b takes the batch in chunks, not in one pass")
            return
        size = plan.batch.batch_size
        groups = _groups(list(plan.samples), size)
        ctx.progress.more(len(groups) - 1)
        host, meters, unchanged_rows = Host(), [], set()
        for group in groups:
            batch, unchanged = plan.batch.replaced(group)
            if len(unchanged) == size - len(group):
                ctx.progress.advance()
                continue  # no other row could be given other values
            unchanged_rows.update(unchanged)
            meters.append(_measured(ctx, _kept_store(ctx, group), batch, host))
        if not meters:
            self.found["why"] = ("the other samples could not be given other values (they "
                                 "are all alike, or only masks)")
            return
        host.fetch()  # one wait for every pass of the test
        for meter in meters:
            for key, (share, rel) in _moves(meter, size).items():
                self.tested.add(key)
                if share > 0:
                    old = self.moved.get(key, (0.0, 0.0))
                    self.moved[key] = (max(old[0], share), max(old[1], rel))
        self.found |= {"ran": True, "passes": len(meters)}
        if unchanged_rows:
            self.found["unchanged"] = sorted(unchanged_rows)
        if self.moved:  # a repetition on the same input: is it only nondeterminism?
            ctx.progress.more(1)
            again = Host()
            meter = _measured(ctx, _kept_store(ctx, groups[0]), plan.batch, again)
            again.fetch()
            self.noisy = [key for key, (share, _) in _moves(meter, size).items() if share > 0]
            self.found["passes"] += 1
            self.found["noisy"] = self.noisy

    def _skip(self, ctx: Context, why: str) -> None:
        self.found["why"] = why
        ctx.progress.advance()

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        if not self.found["ran"]:
            return
        noisy = set(self.noisy)
        unsure = False  # from the first site a repetition moved, nothing is sure
        first: dict[str, Any] | None = None
        for row in rows:
            key = row["site"]
            unsure |= key in noisy
            if key not in self.tested:
                row["depends_on_others"] = pd.NA
                continue
            share, rel = self.moved.get(key, (0.0, 0.0))
            row["others_rel_l2"] = rel
            if share > 0 and unsure:
                row["depends_on_others"] = pd.NA
            else:
                row["depends_on_others"] = share > 0
                if share > 0 and first is None:
                    first = row
        if first is not None:
            self.found["through"] = _not_per_sample_inputs(first, rows, view)

    def note(self) -> Any:
        return self.found

    @classmethod
    def sentences(cls, result: Comparison) -> list[str]:
        found = result.info.notes.get("independence")
        if found is None:
            return []
        if not found["ran"]:
            return [f"The independence test did not run: {found['why']}; the verdict rests "
                    f"on the size of the error alone."]
        table = result.table
        passes = found["passes"]
        held = ("the compared samples held" if result.info.batch_size > len(
            result.info.samples) else "each half of the samples held in turn")
        row = first_dependent(table)
        if row is None:
            unsure = table[table["depends_on_others"].isna() & (table["status"] == "ok")]
            if found.get("noisy") and not unsure.empty:
                return [f"Independence test ({passes} more batched passes, {held}): "
                        f"inconclusive from '{unsure.iloc[0]['site']}' on — the batched "
                        f"run is not deterministic there (a repetition on the same input "
                        f"differs), so a dependence on other samples cannot be told from "
                        f"that noise."]
            left = found.get("unchanged") or []
            kept = "" if not left else (
                f"; rows {left} could not be given other values and were left as they were")
            return [f"Independence test ({passes} more batched pass"
                    f"{'es' * (passes > 1)}, {held}, the other rows given other values, "
                    f"the shapes kept{kept}): the compared rows stayed bit-identical at "
                    f"every compared site. No sample's result showed a dependence on the "
                    f"other samples, so the batched and split runs differ because the "
                    f"batch's shape differs (the kernels chosen, the order of reduction)."]
        through = found.get("through") or []
        via = f", through {', '.join(repr(t) for t in through)} (not per sample)" if (
            through) else ""
        return [f"Independence test: the compared rows change at '{row['site']}' "
                f"({row['module_type']}){via} when only the other samples change, the "
                f"shapes kept (rel_l2 {sci(row['others_rel_l2'])}): each sample's result "
                f"depends on the other samples' values (batch mixing)."]


def first_dependent(table: pd.DataFrame) -> pd.Series | None:
    """The first site whose compared rows moved with the other samples, or None."""
    if "depends_on_others" not in table:
        return None
    moved = table[table["depends_on_others"].astype("boolean").fillna(False).astype(bool)]
    return None if moved.empty else moved.iloc[0]


def _not_per_sample_inputs(first: dict[str, Any], rows: list[dict[str, Any]],
                           view: TableView) -> list[str]:
    """Where the first moved site's call reads sites that hold no rows per sample (e.g. an
    ``aten.mean`` over the batch, at op level): followed back through such sites to the
    first of them, the likely mixing."""
    by_key = {row["site"]: row for row in rows}
    found: list[str] = []
    todo, seen = [first], set()
    while todo:
        call = view.call(todo.pop())
        for origin, key, _ in call.inputs if call is not None else ():
            row = by_key.get(key) if origin == Origin.SITE and key is not None else None
            if row is None or key is None or key in seen or row["status"] == Status.OK.value:
                continue
            seen.add(key)
            inner = view.call(row)
            deeper = [k for o, k, _ in (inner.inputs if inner is not None else ())
                      if o == Origin.SITE and k in by_key
                      and by_key[k]["status"] != Status.OK.value]
            if not deeper:
                found.append(key)
            todo.append(row)
    return found
