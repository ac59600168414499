"""``Comparison.remedies()``: candidate remedies, each verified by running the comparison
again under it, then costed."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from divtrace.align.sites import ROOT
from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.explain.probe import Judged
from divtrace.explain.routing import Routing, routers_in
from divtrace.explain.tokens import PerToken
from divtrace.kinds.padded import Padded
from divtrace.kinds.registry import kind_of
from divtrace.pipeline import execute
from divtrace.plan.compiled import Compiled
from divtrace.plan.make import Plan
from divtrace.plan.runs import backend_flags
from divtrace.remedies.catalog import (
    REDUCTIONS,
    CudnnOff,
    Deterministic,
    FixedBatch,
    Float64,
    MathAttention,
    PrecisionOff,
)
from divtrace.remedies.cost import costs, quiet
from divtrace.remedies.head import Float32Head, Float32Router, output_head
from divtrace.remedies.inductor import DynamicShapes, EagerRegions, InductorSettings
from divtrace.remedies.remedy import Custom, Remedy, Scoped, Situation
from divtrace.remedies.result import Remedies
from divtrace.report.comparison import Comparison
from divtrace.report.tokens import token_figures
from divtrace.report.verdict import blocked
from divtrace.words import sci

__all__ = ["NAMES", "Again", "find"]

#: How ``candidates=`` names the remedies divtrace tries, in the table's order.
NAMES = ("cudnn", "cudnn-everywhere", "float64", "fixed-batch", "precision",
         "math-attention", "deterministic", "float32-head", "float32-router", "inductor",
         "dynamic", "eager-region")
#: A scoped remedy that leaves the runs apart is widened to the sources of its own run,
#: at most this many times.
ROUNDS = 8


@dataclass(frozen=True)
class Again:
    """A comparison's plan and model: what :meth:`Comparison.remedies` runs again."""

    plan: Plan
    model: nn.Module

    def remedies(self, result: Comparison, candidates: Any, repeats: int,
                 progress: bool) -> Remedies:
        return find(result, self.plan, self.model, candidates, repeats, progress)


def situation(plan: Plan, model: nn.Module) -> Situation:
    """What the remedies may need to know of ``plan``'s comparison."""
    flags = backend_flags()
    on_cuda = any(t.is_cuda for t in plan.batch.leaves if isinstance(t, torch.Tensor)) or (
        any(p.is_cuda for p in model.parameters()))
    reduced = tuple(name for name, on in (
        ("TF32 matmuls", flags["tf32_matmul"] and on_cuda),
        ("TF32 convolutions", flags["tf32_cudnn"] and on_cuda),
        ("bfloat16 CPU matmuls", flags["bf16_matmul_cpu"] and not on_cuda),
        ("reduced-precision reductions of half-precision matmuls", on_cuda and any(
            getattr(torch.backends.cuda.matmul, flag, False) for flag in REDUCTIONS))) if on)
    if not reduced and flags["matmul_precision"] != "highest":  # else it is said above
        reduced = (f"matmul precision {flags['matmul_precision']!r}",)
    attention = tuple(name or ROOT for name, module in model.named_modules()
                      if isinstance(module, nn.MultiheadAttention)
                      or "attention" in type(module).__name__.lower())
    batch_only = replace(plan.a, chunk=None) == replace(plan.b, chunk=None)
    head = output_head(model)
    weight = getattr(dict(model.named_modules()).get(head[-1]) if head else None, "weight",
                     None)
    head_dtype = str(weight.dtype).removeprefix("torch.") if isinstance(
        weight, torch.Tensor) else None
    compiled = any(isinstance(run, Compiled) for run in (plan.a, plan.b))
    routing = routers_in(_given(plan))
    routers = routing.names(model)
    first = next((p for p in dict(model.named_modules())[routers[0]].parameters()), None
                 ) if routers else None
    return Situation(plan.batch.batch_size, plan.batch.batch_dim, on_cuda,
                     dict(kind_of(plan).cannot), plan.a.chunk, batch_only, reduced, attention,
                     head, head_dtype, compiled, routers,
                     None if first is None else str(first.dtype).removeprefix("torch."),
                     routing)


def _given(plan: Plan) -> list[Any]:
    """``explain=`` as a list."""
    return [] if plan.explain is None else (
        [plan.explain] if isinstance(plan.explain, str) else list(plan.explain))


def scope(result: Comparison) -> list[str]:
    """The modules where error enters: the sources' and, with the ``"local"`` probe, those
    that add error of their own (else the first divergent site's)."""
    table = result.table
    found = list(table.loc[table["role"] == "source", "module"])
    if "adds_error" in table:
        found += list(table.loc[table["adds_error"] == True, "module"])  # noqa: E712
    if not found and result.first_divergence is not None:
        found.append(result.first_divergence["module"])
    return list(dict.fromkeys(found))


def _one(item: Any, where: list[str], sit: Situation) -> Remedy | Sequence[Remedy]:
    if isinstance(item, Remedy):
        return item
    if isinstance(item, type) and issubclass(item, Remedy):
        return item(where) if issubclass(item, Scoped) else item()
    if isinstance(item, str):
        makers: dict[str, Callable[[], Remedy | Sequence[Remedy]]] = {
                "cudnn": lambda: CudnnOff(where), "cudnn-everywhere": CudnnOff,
                "float64": lambda: Float64(where),
                "fixed-batch": lambda: FixedBatch(sit.batch_size, sit.batch_dim),
                "precision": PrecisionOff, "math-attention": MathAttention,
                "deterministic": Deterministic, "float32-head": Float32Head,
                "float32-router": lambda: Float32Router(sit.routing),
                "inductor": lambda: InductorSettings.defaults(sit.on_cuda),
                "dynamic": DynamicShapes, "eager-region": lambda: EagerRegions(where)}
        made = makers.get(item)
        if made is None:
            raise DivtraceValueError(f"unknown remedy {item!r}; the names are "
                                     f"{', '.join(NAMES)} and 'defaults' (all of them)")
        return made()
    if callable(item):
        return Custom(item)
    raise DivtraceTypeError(
        f"a candidate must be a divtrace.remedies.Remedy, a Remedy class, a name "
        f"({', '.join(NAMES)}) or a callable model -> context manager; got "
        f"{type(item).__name__}")


def candidates(given: Any, where: list[str], sit: Situation) -> list[Remedy]:
    """The remedies to try: ``given`` (None or ``"defaults"``: every one divtrace has)."""
    items: list[Any] = list(NAMES) if given is None else (
        [given] if isinstance(given, str | Remedy) or callable(given) else list(given))
    expanded = [name for item in items for name in (NAMES if item == "defaults" else [item])]
    if not expanded:
        raise DivtraceValueError("candidates is empty; leave it out to try every remedy")
    if not where:
        expanded = [i for i in expanded if i not in ("cudnn", "float64", "eager-region")]
    made = [_one(item, where, sit) for item in expanded]
    return [one for item in made for one in ([item] if isinstance(item, Remedy) else item)]


def verify(remedy: Remedy, plan: Plan, model: nn.Module, kept: Sequence[Any] = ()
           ) -> tuple[Remedy, Comparison, int]:
    """The comparison run again under ``remedy`` (with the default probes and ``kept``:
    the per-token probe, whose log-probabilities are what a rollout's user watches); a
    scoped remedy that leaves the runs apart is widened to its run's own sources and run
    again. Returns the remedy as finally tried, its comparison and the rounds it took."""
    for rounds in range(1, ROUNDS + 1):
        padded = remedy.pads()
        again = remedy.replanned(replace(
            plan, explain=list(kept) or None, keep=False, progress=False,
            kind=plan.kind if padded is None else Padded(padded),
            graphs=False if padded else plan.graphs))
        try:
            with remedy.applied(model), quiet():
                found = _model_sites(execute(again, model), remedy)
        finally:
            _fresh(plan)  # a compiled copy is made anew under each remedy
            _fresh(again)
        if found.verdict == "identical" or remedy.modules is None:
            break
        wider = remedy.widened(_wider(found, remedy.modules))
        if wider is None or wider.modules == remedy.modules or rounds == ROUNDS:
            break
        remedy = wider
    return remedy, found, rounds


def _fresh(plan: Plan) -> None:
    """The compiled copies of the model the runs made, dropped: the next comparison
    compiles its own under its remedy, and none stays with the result."""
    for run in (plan.a, plan.b):
        if isinstance(run, Compiled):
            run.copies.clear()


def _model_sites(found: Comparison, remedy: Remedy) -> Comparison:
    """``found`` without the sites that show the remedy's own workings (:meth:`Remedy.own`)."""
    table, samples = found.table, found.per_sample
    own = [remedy.own(m, o) for m, o in zip(table["module"], table["op"], strict=True)]
    if not any(own):
        return found
    kept = table[[not o for o in own]].reset_index(drop=True)
    samples = samples[samples["site"].isin(kept["site"])].reset_index(drop=True)
    return Comparison(kept, samples, found.meta, {}, found.probes)


def _inside(module: str, modules: Sequence[str]) -> bool:
    return any(module == m or m == ROOT or module.startswith(m + ".") for m in modules)


def _wider(found: Comparison, modules: Sequence[str]) -> list[str]:
    """The modules to add to a scope that left the runs apart: the sources of its own run
    outside it; where there are none, the first divergent layer outside it, or, when that
    layer only carries error that entered in code between modules (a functional call),
    the module around it."""
    outside = [m for m in scope(found) if not _inside(m, modules)]
    if outside:
        return outside
    table = found.table
    diverged = table[(table["status"] == "ok") & (table["mismatch"] > 0) & table["leaf"]]
    for row in diverged.itertuples():
        if _inside(row.module, modules):
            continue
        chosen = row.module if row.role == "source" else (
            row.module.rpartition(".")[0] or ROOT)
        if not _inside(chosen, modules):
            return [chosen]
    return []


def _on_copies(remedy: Remedy, sit: Situation) -> str | None:
    """Why a remedy cannot reach runs of copies of the model (None: it can)."""
    if not sit.compiled or remedy.reaches_copies:
        return None
    return ("it acts through hooks on the model, and the compiled runs run copies of it "
            "(the eager-region remedy leaves a region eager instead)")


def _per_token(found: Comparison) -> str:
    """The log-probabilities under a remedy, for the note: what a rollout's user watches."""
    table = token_figures(found).logprobs
    if table.empty:
        return ""
    flips = int(table["flip"].sum())
    return (f"max |Δlogprob| {sci(float(table['delta'].max()))}, {flips} argmax "
            f"flip{'' if flips == 1 else 's'}")


def _output(result: Comparison) -> float:
    out = result.output
    return math.nan if out is None else float(out["rel_l2"])


def _row(remedy: Remedy, found: Comparison | None, before: float, note: str
         ) -> dict[str, Any]:
    ok = None if found is None else found.table.query("status == 'ok'")
    rel = math.nan if found is None else _output(found)
    return {
        "remedy": remedy.name, "kind": remedy.kind,
        "modules": None if remedy.modules is None else len(remedy.modules),
        "identical": None if found is None else found.verdict == "identical",
        "identical_sites": None if ok is None else int((ok["mismatch"] == 0).sum()),
        "sites": None if ok is None else len(ok),
        "output_rel_l2": rel,
        "output_ratio": rel / before if before > 0 else math.nan,
        "verdict": None if found is None else found.verdict,
        "cost": math.nan, "a_cost": math.nan, "output_change": math.nan, "note": note}


def _refused(plan: Plan) -> None:
    cannot = kind_of(plan).cannot.get("remedies")
    if cannot is not None:
        raise DivtraceValueError(cannot)
    changed = [w for w, run in (("a", plan.a), ("b", plan.b))
               if run.changes_model and not isinstance(run, Compiled)]
    if changed:
        raise DivtraceValueError(
            f"remedies() puts hooks on the model and runs the comparison again, but run "
            f"{changed[0]} runs a changed copy of it (another device, dtype, memory format "
            f"or torch.compile); compare runs of the model as it is, e.g. move the model "
            f"and x first")


def find(result: Comparison, plan: Plan, model: nn.Module, given: Any = None,
         repeats: int = 5, progress: bool = True) -> Remedies:
    """The remedies of ``result`` (see :meth:`Comparison.remedies`)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise DivtraceValueError(f"repeats must be an int >= 1; got {repeats!r}")
    _refused(plan)
    sit = situation(plan, model)
    base = result
    judged = Judged(result.table, result.meta)
    tested = next((t for p in result.probes if (t := p.explain(judged).findings.independent)),
                  None)
    routing = [p for p in _given(plan) if isinstance(p, Routing)]  # the user's routers
    if tested in (None, "untested"):
        with quiet():  # the verdict must rest on the independence test
            base = execute(replace(plan, explain=routing or None, keep=False,
                                   progress=False), model)
    before = _output(base)
    reason = blocked(base.table, base.meta, base.probes)
    if base.verdict == "identical" or reason is not None:
        return Remedies.untried(base, reason)
    where = scope(base)
    chosen = candidates(given, where, sit)
    kept = [p for p in _given(plan) if p == "tokens" or isinstance(p, PerToken) or p is PerToken]
    kept += routing
    rows, tried, comparisons = [], [], {}
    bar = tqdm(total=len(chosen) + repeats + 1, desc="divtrace: remedies",
               disable=not progress, leave=False)
    with bar:
        for index, remedy in enumerate(chosen):
            why = remedy.unusable(sit) or _on_copies(remedy, sit)
            if why is not None:
                rows.append(_row(remedy, None, before, f"not tried: {why}"))
            else:
                remedy, found, rounds = verify(remedy, plan, model, kept)
                chosen[index] = remedy
                note = "; ".join(filter(None, [
                    _per_token(found) if kept else "", remedy.caveat(sit)]))
                if rounds > 1:
                    note = "; ".join(filter(None, [
                        f"widened {rounds - 1}× to the sources of its own run", note]))
                rows.append(_row(remedy, found, before, note))
                tried.append(index)
                comparisons[remedy.name] = found
            bar.update()
        for index, measured in zip(
                tried, costs(plan, model, [chosen[i] for i in tried], repeats, bar.update),
                strict=True):
            for column, value in zip(("cost", "a_cost", "output_change"), measured,
                                     strict=True):
                rows[index][column] = value
    return Remedies(_table(rows), tuple(chosen), comparisons, before, base.meta.names,
                    verdict=base.verdict)


def _table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    table = pd.DataFrame(list(rows))
    for column in ("modules", "identical_sites", "sites"):
        table[column] = table[column].astype("Int64")
    table["identical"] = table["identical"].astype("boolean")
    for column in ("remedy", "kind", "verdict", "note"):
        table[column] = table[column].astype("str")
    return table
