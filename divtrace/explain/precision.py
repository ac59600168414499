"""The precision test: does the difference shrink with the unit roundoff?

Rounding error scales with the unit roundoff of the arithmetic; a difference by design
(position ids taken from the padded length, a scale by ``x.shape[0]``, a code path chosen
by the batch's shape) does not. So both runs are replayed in float64 — the same chunks
of run a, the same pass of run b, on a float64 copy of the model (the user's stays
untouched) — and compared with each other, site by site. A rounding difference shrinks by
about ``u(float64) / u(the runs' precision)`` (2**-29 from float32); one by design keeps
its size. Per site where the runs differ, the ratio ``r`` of the float64 runs' rel_l2 to
the runs' own:

* ``r <= e ** (2/3)`` (``e`` the expected shrink; 1.5e-6 from float32), or the float64
  runs within float64's rounding budget: it **shrinks** (rounding);
* ``r >= e ** (1/3)`` (1.2e-3 from float32): it **keeps its size** — the computation
  depends on the batch's shape (``depends_on_shape`` True);
* in between: inconclusive there (``depends_on_shape`` missing).

It decides only what the independence test leaves open: it runs when the runs differ and
no compared row moved with the other samples.
"""

from __future__ import annotations

import copy
import math
from dataclasses import fields, replace
from functools import partial
from typing import Any, ClassVar

import pandas as pd
import torch

from divtrace.explain.context import Context
from divtrace.explain.float64 import replayed
from divtrace.explain.mixed import first_flagged
from divtrace.explain.probe import Explained, Findings, Hooks, Judged, Probe, Settings, Spec
from divtrace.explain.rounding import MODELS, two_models
from divtrace.explain.view import TableView
from divtrace.measure.fields import INDEX
from divtrace.plan.runs import Run, made_as
from divtrace.record.runner import Runner
from divtrace.words import sci

__all__ = ["FLOOR", "Precision", "decisive", "first_by_shape", "first_unsure", "judged",
           "shrink"]

_LABEL = "precision test (float64)"

#: Its passes as planned: run a and run b again in float64 (more when they are chunked).
_PASSES = 2
_FLOAT64 = 2.0**-53
#: float64's rounding budget (that of the verdict, :mod:`divtrace.explain.rounding`):
#: float64 runs this close agree whatever the first runs' difference.
FLOOR = (8 + 2.0**10) * _FLOAT64


def shrink(dtype: str) -> float | None:
    """How much a rounding difference at a site of ``dtype`` (a name: ``"float32"``)
    shrinks in float64: float64's unit roundoff over the dtype's (None: not a floating
    dtype). Reduced-precision maths (TF32) rounds more coarsely still, so it shrinks more:
    the dtype's own figure is the cautious one."""
    found = getattr(torch, dtype or "", None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        return None
    return _FLOAT64 / (float(torch.finfo(found).eps) / 2)


def judged(d32: float, d64: float, expected: float) -> bool | None:
    """Whether a site's difference keeps its size in float64 (True), shrinks (False) or
    neither clearly (None): ``d32`` and ``d64`` the runs' rel_l2 in their own precision
    and in float64, ``expected`` the shrink of rounding (:func:`shrink`)."""
    if d64 <= FLOOR or d64 <= d32 * expected ** (2 / 3):
        return False
    if d64 >= d32 * expected ** (1 / 3):
        return True
    return None


def _why_not(ctx: Context) -> str | None:
    """Why the runs cannot be replayed in float64 here (None: they can)."""
    plan = ctx.plan
    if plan.a.dtype != plan.b.dtype:
        return "the two runs differ in dtype, and a float64 replay would make them one"
    cannot = ctx.kind.cannot.get("precision")
    if cannot is not None:
        return cannot
    floating = [p for p in ctx.model.parameters() if p.is_floating_point()]
    if floating and all(p.dtype == torch.float64 for p in floating) and (
            plan.a.dtype in (None, torch.float64)):
        return "the model already runs in float64"
    return None


class Precision(Probe):
    """``"precision"`` (on by default; ``"-precision"`` turns it off): both runs replayed
    in float64 and compared with each other (the verdict's second test)."""

    spec: ClassVar[Spec] = Spec(
        name="precision", default=True, columns=("depends_on_shape", "fp64_rel_l2"),
        shown=("depends_on_shape",), leads=True)

    def __init__(self) -> None:
        self.fp64: dict[str, float] = {}  # site -> rel_l2 of the float64 runs
        self.found: dict[str, Any] = {"ran": False, "why": None}
        self._done = self._planned = 0  # the replay's passes done, and planned

    def _after(self, ctx: Context) -> None:
        ctx.progress.stage(_LABEL)
        why = _why_not(ctx) or self._needless(ctx)
        if why is not None:
            self.found["why"] = why
            ctx.progress.more(-_PASSES)  # none of its passes run: the bar ends full
            return
        self._done = 0
        try:
            self._replay(ctx)
        except (RuntimeError, NotImplementedError, TypeError) as error:
            head = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.found["why"] = (f"the model could not run in float64 "
                                 f"({type(error).__name__}: {head[:160]})")
            ctx.progress.more(self._done - self._planned)  # the passes it did not run

    def _step(self, ctx: Context) -> None:
        self._done += 1
        ctx.progress.advance()

    def _needless(self, ctx: Context) -> str | None:
        """Why there is nothing for the test to decide: the samples mix, or the runs agree
        bit for bit at every compared site (one wait for the device)."""
        independence = ctx.finding("independence") or {}
        if independence.get("state"):
            return "the model keeps state across calls"
        if independence.get("moved") and not (independence.get("noisy")
                                               or independence.get("routed")):
            return "the independence test found batch mixing"
        mismatch = INDEX["mismatch"]
        counts: dict[torch.device, list[torch.Tensor]] = {}
        for site in ctx.meter.sites:
            if site.stats is None:
                continue
            try:
                stats = site.stats.peek()
            except RuntimeError:  # fetched already (both runs chunked): the test runs
                return None
            counts.setdefault(stats.device, []).append(stats[:, mismatch])  # a view
        if not any(bool((torch.cat(found) > 0).any()) for found in counts.values()):
            return "the runs are bit-identical at every compared site"
        return None

    def _replay(self, ctx: Context) -> None:
        plan = ctx.plan
        double = torch.float64
        a = replace(Runner.of(replace(plan.a, dtype=double), ctx.model, plan.modules,
                              plan.output_only, f"{_LABEL}, {ctx.a.name}", ctx.recorder),
                    wrap=ctx.a.wrap, around=ctx.a.around)
        b = replace(self._other(ctx, a), wrap=ctx.b.wrap, around=ctx.b.around)
        passes = self._planned = len(plan.a_chunks) + max(1, len(plan.b_chunks))
        ctx.progress.more(passes - _PASSES)
        step = partial(self._step, ctx)
        self.fp64 = replayed(ctx, a, b, step)
        floating = next((p.dtype for p in ctx.a.model.parameters() if p.is_floating_point()),
                        plan.a.dtype or torch.get_default_dtype())
        self.found |= {"ran": True, "runs": not plan.default_pair,
                       "passes": passes,
                       "dtype": str(floating).removeprefix("torch.")}

    @staticmethod
    def _other(ctx: Context, a: Runner) -> Runner:
        """Run b in float64: on run a's float64 copy when both run the same copy of the
        model (their flags may differ: each run's are set around its passes), else on a
        float64 copy of its own (another model's too)."""
        plan, double = ctx.plan, torch.float64
        name = f"{_LABEL}, {ctx.b.name}"
        other = plan.b.other_model
        cast = Run(**{f.name: getattr(plan.b, f.name) for f in fields(Run)} | {
            "dtype": double})
        if other is None and plan.a.same_copy(plan.b):  # one float64 copy for both
            return Runner(cast, a.model, a.modules, a.recorder, name)
        if other is None:  # run b's own kind of run (compiled code stays compiled)
            return Runner.of(replace(plan.b, dtype=double), ctx.model, plan.modules,
                             plan.output_only, name, ctx.recorder)
        mine = replace(plan.b, other=copy.deepcopy(  # type: ignore[call-arg]
            other, made_as(other, None, double)).to(double))
        own = Runner.of(mine, ctx.model,
                        plan.modules, plan.output_only, name, ctx.recorder)
        return replace(own, run=cast)  # its inputs cast to float64 too

    def hooks(self) -> Hooks:
        return Hooks(after=self._after, passes=_PASSES)

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)), cls._findings(result.table, result.meta))

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        if not self.found["ran"]:
            return
        for row in rows:
            d64 = self.fp64.get(row["site"], math.nan)
            row["fp64_rel_l2"] = d64
            row["depends_on_shape"] = pd.NA
            d32 = row.get("rel_l2", math.nan)
            if math.isnan(d64) or not math.isfinite(d32) or not math.isfinite(d64):
                continue
            if d32 == 0 or row.get("mismatch", 0) == 0:
                row["depends_on_shape"] = False if d64 == 0 else pd.NA
                continue
            row["depends_on_shape"] = self._judged(row, d32, d64)

    def _judged(self, row: dict[str, Any], d32: float, d64: float) -> bool | None:
        expected = shrink(row["dtype"]) or shrink(self.found.get("dtype", ""))
        if expected is None:
            return None
        return judged(d32, d64, expected)

    def note(self) -> Any:
        return self.found

    @classmethod
    def _findings(cls, table: pd.DataFrame, meta: Settings) -> Findings:
        return Findings(designed=_designed(table, meta), precise=_precise(table, meta))

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        found = result.meta.notes.get("precision")
        if found is None:
            return []
        if not found["ran"]:
            if found["why"] in ("the independence test found batch mixing",
                                "the model keeps state across calls",
                                "the runs are bit-identical at every compared site"):
                return []
            return [f"The precision test did not run: {found['why']}."]
        table = result.table
        row = first_by_shape(table)
        passes = found["passes"]
        head = (f"Precision test (both runs again in float64, {passes} more pass"
                f"{'es' * (passes > 1)})")
        if row is not None:
            return [f"{head}: at '{row['site']}' ({row['module_type']}) the float64 runs "
                    f"still differ by rel_l2 {sci(row['fp64_rel_l2'])}, against "
                    f"{sci(row['rel_l2'])} in {row['dtype']}: the difference does not "
                    f"shrink with the unit roundoff, so it is not rounding."]
        unsure = first_unsure(table)
        if unsure is not None:
            return [f"{head}: inconclusive from '{unsure['site']}' "
                    f"({unsure['module_type']}) on — the float64 runs differ there by "
                    f"rel_l2 {sci(unsure['fp64_rel_l2'])} against {sci(unsure['rel_l2'])} "
                    f"in {unsure['dtype']}, neither shrunk as rounding shrinks nor of the "
                    f"same size."]
        judged_ = decisive(table)
        judged_ = judged_[judged_["depends_on_shape"].notna()]
        if judged_.empty:
            return [f"{head}: no site where the runs differ could be compared in float64."]
        out = result.output
        at = "" if out is None or math.isnan(out.get("fp64_rel_l2", math.nan)) else (
            f"; at the output rel_l2 {sci(out['rel_l2'])} becomes "
            f"{sci(out['fp64_rel_l2'])}")
        return [f"{head}: at each of the {len(judged_)} sites where the runs differ, the "
                f"difference shrinks in float64 as rounding does{at}."]


def decisive(table: pd.DataFrame) -> pd.DataFrame:
    """The sites that decide the test: those where the runs differ, module sites only when
    some differ (two runs on other kernel paths pair up op sites by their index in a
    scope, and such pairs are no measure of a layer's rounding)."""
    differ = table[(table["status"] == "ok") & (table["mismatch"] > 0)]
    modules = differ[differ["op"] == ""]
    return modules if not modules.empty else differ


def first_by_shape(table: pd.DataFrame) -> pd.Series | None:
    """The first site whose difference kept its size in float64, or None."""
    return first_flagged(decisive(table), "depends_on_shape") if (
        "depends_on_shape" in table) else None


def first_unsure(table: pd.DataFrame) -> pd.Series | None:
    """The first site where the runs differ and the precision test could not decide."""
    if "depends_on_shape" not in table or "fp64_rel_l2" not in table:
        return None
    rows = decisive(table)
    unsure = rows[rows["depends_on_shape"].isna() & rows["fp64_rel_l2"].notna()]
    return None if unsure.empty else unsure.iloc[0]


def _shrink_words(dtype: str, fallback: str) -> str:
    factor = shrink(dtype) or shrink(fallback)
    if factor is None:
        return "by the ratio of the unit roundoffs"
    return f"2**{round(-math.log2(factor))}-fold"


def _designed(table: pd.DataFrame, meta: Settings) -> tuple[str, str] | None:
    """The first site whose difference keeps its size in float64, and what that means
    (None: none)."""
    row = first_by_shape(table)
    if row is None:
        return None
    found = meta.notes.get("precision") or {}
    where = f"'{row['site']}' ({row['module_type']})"
    still = (f"at {where} the runs still differ in float64 by rel_l2 "
             f"{sci(row['fp64_rel_l2'])} (in {row['dtype']} {sci(row['rel_l2'])}), where a "
             f"rounding difference would have shrunk about "
             f"{_shrink_words(row['dtype'], found.get('dtype', ''))} (precision test)")
    if two_models(meta):
        return where, f"the two models compute differently: {still}. {MODELS}"
    if found.get("runs"):
        return where, (f"the two configurations compute differently by design: "
                       f"{still}.")
    return where, (
        f"the computation depends on the batch's shape: {still}. That is a difference "
        f"by design, whatever its size: look there for a value taken from the batch's "
        f"size or padded length (position ids, a mask, a scale by x.shape[0]) or a "
        f"code path chosen by the shape.")


def _precise(table: pd.DataFrame, meta: Settings) -> str:
    """Whether the difference was shown to shrink as rounding does."""
    found = meta.notes.get("precision")
    if not found or not found.get("ran"):
        return "untested"
    if first_unsure(table) is not None:
        return "inconclusive"
    return "inconclusive" if decisive(table)["depends_on_shape"].isna().all() else "shrinks"
