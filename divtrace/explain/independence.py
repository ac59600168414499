"""The independence test: is each sample's result a function of that sample alone?

Kernels are chosen from shapes, not from values. So the measured run (the whole batch in
one pass) runs once more with the same shapes: the compared samples' rows unchanged, at
their own positions, every other sample's rows given other valid data
(:meth:`divtrace.Kind.held`: the kind lays it out). At every site the compared rows
of the two passes are compared bit for bit, by their fingerprints
(:mod:`~divtrace.measure.prints`: eight bytes per row, not a copy of the rows). Rows
that move have let other samples in (batch mixing: a statistic over the batch, a wrong
``batch_dim``, padding that is not masked) — whatever the size of the move. When every
sample is compared, one half is held while the other is replaced, then the other way
round.

When some rows move, the pass is repeated on the unchanged batch with the rows kept: a
site where the repetition moves too (a kernel that is not deterministic) makes the test
inconclusive from there on; each moving pass then runs once more, measured against the
kept rows, for how far the rows moved (``others_rel_l2``). So does a mixture-of-experts
block whose rows move after its router gave the compared tokens the same experts: its
experts are called on as many tokens as the other samples send them, a shape that follows
values, and a kernel chosen by it may round otherwise.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import pandas as pd
import torch

from divtrace.devices import upload
from divtrace.explain.causes import cause_of, deterministic, op_cause
from divtrace.explain.context import Context
from divtrace.explain.held import READS, differing, figures_of, groups, held_store, moved_in_calls
from divtrace.explain.mixed import first_dependent, through_shared, unmoved
from divtrace.explain.probe import Explained, Findings, Hooks, Judged, Probe, Settings, Spec
from divtrace.explain.routed import routed_move, routed_sentence
from divtrace.explain.routing import routers_in
from divtrace.explain.view import TableView
from divtrace.measure.host import Deferred, Host
from divtrace.record.experts import Routers
from divtrace.record.rows import RowStore
from divtrace.words import sci

__all__ = ["Independence", "first_dependent", "groups"]

_LABEL = "independence test"


def _noisy(ctx: Context, store: RowStore, host: Host) -> dict[str, Deferred]:
    """Per site: whether ``store`` (a repetition on the unchanged batch) differs there
    from the measured pass, by their fingerprints (1.0 or 0.0 after ``host`` fetched)."""
    meter, found = ctx.meter, {}
    at = torch.tensor([meter.store.samples.index(s) for s in store.samples])
    index: dict[torch.device, torch.Tensor] = {}  # one upload per device
    for measured in meter.sites:
        stored = store.rows.get(measured.site.key)
        if measured.prints is None or stored is None or not stored.held or (
                not store.complete(stored)):
            continue
        device = measured.prints.device
        if device not in index:
            index[device] = upload(at, device)
        was = measured.prints.index_select(0, index[device])
        now = meter.fingerprints(stored.rows if stored.rows is not None else [
            p.unsqueeze(0) for p in stored.parts or () if p is not None])
        if now.shape == was.shape:
            found[measured.site.key] = host.add((now != was).any().double().reshape(1))
    return found


class Independence(Probe):
    """``"independence"`` (on by default; ``"-independence"`` turns it off): the
    independence test behind the verdict."""

    spec: ClassVar[Spec] = Spec(
        name="independence", default=True, columns=("depends_on_others", "others_rel_l2"),
        shown=("depends_on_others",), leads=True, needs=frozenset({"b_prints"}))

    def __init__(self) -> None:
        #: the sites whose compared rows moved: how far (rel_l2; NaN where not measured)
        self.moved: dict[str, float] = {}
        self.noisy: list[str] = []  # sites that moved on a repetition with the same input
        self.tested: set[str] = set()
        self.found: dict[str, Any] = {"ran": False, "why": None}
        self._routers = Routers()


    def _after(self, ctx: Context) -> None:
        plan = ctx.plan
        ctx.progress.stage(_LABEL)
        size = plan.batch.batch_size
        calls = plan.b_chunks == ((0, size),)  # one pass of several forward calls
        if plan.b_chunks and not calls:
            self._skip(ctx, "run b takes the batch in chunks, not in one pass")
            return
        self._routers = routers_in(ctx.probes)
        held = groups(list(plan.samples))
        ctx.progress.more(len(held) - 1)
        host, checks, unchanged_rows = Host(), [], set()
        for group, (batch, unchanged) in zip(held, ctx.held_each(held), strict=True):
            if len(unchanged) == size - len(group):
                ctx.progress.advance()
                continue  # no other row could be given other values
            unchanged_rows.update(unchanged)
            checks.append((group, self._moved(ctx, group, batch, host)
                           if calls else ctx.moved(group, batch, host, _LABEL)))
            del batch  # one replaced input at a time
        if not checks:
            self.found["why"] = ("the other samples could not be given other values (they "
                                 "are all alike, or only masks)")
            return
        host.fetch()  # one wait for every pass of the test
        moving = []
        for group, check in checks:
            moved = [key for key, deferred in check.items() if deferred.get().any()]
            self.tested.update(check)
            self.moved.update(dict.fromkeys(moved, math.nan))
            if moved:
                moving.append(group)
        self.found |= {"ran": True, "passes": len(checks), "groups": len(checks)}
        if unchanged_rows:
            self.found["unchanged"] = sorted(unchanged_rows)
        if moving and calls:
            self._repeated(ctx, moving)
        elif moving:
            self._sized(ctx, moving)
        self.found["moved"] = bool(self.moved)
        routed = routed_move(ctx, self.tested, self.moved, self._routers)
        if routed is not None:  # a mixture of experts' shapes follow the other samples
            self.found["routed"] = routed

    def _moved(self, ctx: Context, group: list[int], batch: Any, host: Host
               ) -> dict[str, Deferred]:
        """One more pass of run b over ``batch``, recorded call by call, and where the
        rows of ``group`` moved (run b of several forward calls: a token layout's)."""
        again = ctx.kind.store(ctx.plan, list(ctx.plan.samples), learn_lineage=False)
        ctx.rerun(again, batch, _LABEL)
        return moved_in_calls(ctx.meter, ctx.store, again, group, host)

    def _repeated(self, ctx: Context, moving: list[list[int]]) -> None:
        """Rows moved in a run b of several forward calls: the unchanged batch once more;
        where its rows move too, run b is not deterministic there (how far rows moved is
        not measured for such a run)."""
        ctx.progress.more(1)
        host = Host()
        noise = self._moved(ctx, sorted({s for group in moving for s in group}),
                            ctx.plan.batch, host)
        host.fetch()
        self.noisy = [key for key, deferred in noise.items() if deferred.get().any()]
        self.found["passes"] += 1
        self.found["noisy"] = self.noisy
        self._causes(ctx)

    def _sized(self, ctx: Context, moving: list[list[int]]) -> None:
        """Rows moved: the unchanged batch once more, its rows kept (where it moves too,
        the batched run is not deterministic), then each moving pass again, measured
        against them (how far the rows moved)."""
        ctx.progress.more(1 + len(moving))
        kept = ctx.kept(sorted({s for group in moving for s in group}), f"{_LABEL}, repeated")
        host = Host()
        noise = _noisy(ctx, kept, host)
        meters = [ctx.measure(held_store(kept, group), ctx.held(group)[0], host, _LABEL, READS)
                  for group in moving]
        host.fetch()
        self.noisy = [key for key, deferred in noise.items() if deferred.get().any()]
        values: dict[str, float] = {}  # the fingerprints saw bits; here values count
        sized: set[str] = set()
        for meter in meters:
            for key, (share, rel) in figures_of(meter, ctx.plan.batch.batch_size).items():
                if key in self.moved:
                    sized.add(key)
                    if share > 0:
                        values[key] = max(values.get(key, 0.0), rel)
        for key in sized:
            if key in values:
                self.moved[key] = values[key]
            elif key not in self.noisy:
                del self.moved[key]  # only the signs of zeros or the payloads of NaNs
        self.found["passes"] += 1 + len(meters)
        self.found["noisy"] = self.noisy
        if self.noisy:
            self._stateful(ctx, kept.samples)
        self._causes(ctx)

    def _stateful(self, ctx: Context, samples: list[int]) -> None:
        """A repetition moved: two more on the unchanged batch, deterministic algorithms
        in force, told apart by their fingerprints. Where they still differ, the model
        keeps state across calls (a counter, a cache filled by an earlier call)."""
        ctx.progress.more(2)
        with warnings.catch_warnings(), deterministic():
            warnings.simplefilter("ignore", UserWarning)  # ops with no deterministic kind
            one, two = (ctx.kept(samples, f"{_LABEL}, repeated") for _ in range(2))
        self.found["passes"] += 2
        self.found["state"] = differing(one, two, ctx.meter)

    def _causes(self, ctx: Context) -> None:
        """What the modules whose rows moved say of why (:func:`cause_of`)."""
        causes = {}
        along: dict[str, int] = getattr(ctx.b.recorder, "along_batch", {})
        for measured in ctx.meter.sites:
            module = ctx.b.modules.get(measured.site.module)
            if measured.site.key in self.moved and measured.site.key in along:
                causes[measured.site.key] = op_cause(measured.site.op,
                                                     along[measured.site.key])
            elif measured.site.key in self.moved and not measured.site.op and module is not None:
                cause = cause_of(module, ctx.plan.batch.batch_dim)
                if cause is not None:
                    causes[measured.site.key] = cause
        self.found["causes"] = causes

    def _skip(self, ctx: Context, why: str) -> None:
        self.found["why"] = why
        ctx.progress.advance()

    def hooks(self) -> Hooks:
        return Hooks(after=self._after, passes=1)

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)), cls._findings(result.table, result.meta))

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        if not self.found["ran"]:
            return
        noisy = set(self.noisy)
        unsure = False  # from the first site a repetition moved, nothing is sure
        first: dict[str, Any] | None = None
        routed = (self.found.get("routed") or {}).get("site")
        for row in rows:
            key = row["site"]
            unsure |= key in noisy
            if key not in self.tested:
                row["depends_on_others"] = pd.NA
                continue
            moved = key in self.moved
            row["others_rel_l2"] = self.moved.get(key, 0.0)
            unsure |= key == routed  # from here the experts' shapes follow the others
            if moved and unsure:
                row["depends_on_others"] = pd.NA
            else:
                row["depends_on_others"] = moved
                if moved and first is None:
                    first = row
        if first is not None:
            self.found["through"] = through_shared(first, rows, view)

    def note(self) -> Any:
        return self.found

    @classmethod
    def _findings(cls, table: pd.DataFrame, meta: Settings) -> Findings:
        return Findings(mixing=_mixing(table, meta), independent=_independent(meta))

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        found = result.meta.notes.get("independence")
        if found is None:
            return []
        if not found["ran"]:
            return [f"The independence test did not run: {found['why']}; a dependence on "
                    f"the other samples' values is not ruled out."]
        table = result.table
        passes = found["passes"]
        count, groups_ = len(result.meta.samples), found.get("groups", passes)
        held = ("the compared sample held" if count == 1 else
                f"the compared samples held in {groups_} groups, so that each one was "
                f"held, at least once, while any other one was replaced")
        row = first_dependent(table)
        if row is None and found.get("routed"):
            return [f"Independence test ({passes} more batched passes, {held}): "
                    + routed_sentence(found["routed"])]
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
            head = (f"Independence test ({passes} more batched pass"
                    f"{'es' * (passes > 1)}, {held}, the other rows given other values, "
                    f"the shapes kept{kept})")
            return [head + unmoved(table, result.meta)]
        through = found.get("through") or []
        via = f", through {', '.join(repr(t) for t in through)} (not per sample)" if (
            through) else ""
        return [f"Independence test: the compared rows change at '{row['site']}' "
                f"({row['module_type']}){via} when only the other samples change, the "
                f"shapes kept{_how_far(row)}: each sample's result depends on the other "
                f"samples' values (batch mixing)."]


def _how_far(row: pd.Series) -> str:
    """`` (rel_l2 …)``: how far the compared rows moved, where that was measured."""
    far = row.get("others_rel_l2")
    return "" if far is None or pd.isna(far) else f" (rel_l2 {sci(far)})"


def _mixing(table: pd.DataFrame, meta: Settings) -> tuple[str, str] | None:
    """Where and why the samples were seen to depend on each other (None: not seen)."""
    found = meta.notes.get("independence") or {}
    state = table[table["site"].isin(found.get("state") or [])]
    if not state.empty:
        row = state.iloc[0]
        where = f"'{row['site']}' ({row['module_type']})"
        return where, (
            f"the model keeps state across calls: the same pass on the same input, "
            f"repeated with deterministic algorithms, differs from {where} on (a "
            f"counter, a cache filled by an earlier call), so no two runs compare "
            f"like with like. Reset that state before each call, or compare a model "
            f"that keeps none.")
    row = first_dependent(table)
    if row is None:
        return None
    through = found.get("through") or []
    via = f", through {', '.join(repr(t) for t in through)}," if through else ""
    where = f"'{row['site']}' ({row['module_type']})"
    causes = found.get("causes") or {}
    cause = causes.get(row["site"])
    hint = ("Check for a statistic over the batch in eval mode, a wrong batch_dim, "
            "padding that is not masked, activations quantized with a scale over the "
            "batch (dynamic quantization), or routing or shapes that depend on the "
            "whole batch (capacity-limited experts).") if cause is None else (
            f"The cause: {cause}.")
    return where, (
        f"batch mixing: at {where}{via} the compared samples' rows change when only "
        f"the other samples change, the shapes kept{_how_far(row)}, so each sample's "
        f"result depends on the other samples' values — a bug "
        f"whatever its size. {hint}")


def _independent(meta: Settings) -> str:
    """How far the samples were shown independent."""
    found = meta.notes.get("independence")
    if not found or not found.get("ran"):
        return "untested"
    return "inconclusive" if found.get("noisy") or found.get("routed") else "independent"
