"""The pipeline: a :class:`~divtrace.plan.make.Plan` carried out, stage by stage.

record run a → measure run b against it → explain (the probes'
passes and columns) → report (:class:`~divtrace.Comparison`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from divtrace.assembly import Parts, parts_for
from divtrace.errors import BatchMixingError, DivtraceValueError, DivtraceWarning, user_level
from divtrace.explain.context import Context
from divtrace.explain.probe import Hooks, Probe
from divtrace.explain.registry import chosen
from divtrace.kinds.kind import Kind
from divtrace.kinds.registry import kind_of
from divtrace.measure.chunked import compare_stores
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.plan.make import Plan
from divtrace.plan.walk import Walk
from divtrace.progress import Progress
from divtrace.record.graphs import GraphedRun
from divtrace.record.guard import RandomDraws, SeededOps, collector_held, cuda_devices, untouched
from divtrace.record.loop import InputCopies
from divtrace.record.rows import RowStore
from divtrace.record.runner import Runner
from divtrace.report.comparison import Comparison, Origin
from divtrace.report.environment import environment, run_settings
from divtrace.report.meta import Meta
from divtrace.report.table import build

__all__ = ["execute", "record"]


def record(ctx: Context, runner: Runner, chunks: tuple[tuple[int, int], ...]) -> RowStore:
    """Runs ``chunks`` of the batch with ``runner``, keeping the compared samples' rows
    (notes in ``ctx`` what the output was when it held no tensor)."""
    plan = ctx.plan
    store = ctx.kind.store(plan, list(plan.samples), offload=plan.offload, pinned=plan.keep)

    def label(start: int, stop: int) -> str:
        inside = [s for s in plan.samples if start <= s < stop]
        return f"{runner.name}, chunk of rows {start}:{stop} (samples {inside})"

    ctx.progress.stage(runner.name)
    graphed = None if plan.graphs is False else GraphedRun(plan.graphs)
    obstacle = plan.graph_obstacle or ctx.kind.cannot.get("graphs")
    ctx.output_type = runner.execute(store, plan.batch, list(chunks), label,
                                     ctx.progress.advance, ctx.check, ctx.copies, graphed,
                                     obstacle)
    if graphed is not None and graphed.outcome is not None:
        ctx.graphed["a" if runner is ctx.a else "b"] = graphed.outcome.to_dict()
    return store


def _measure(ctx: Context, meter: Meter) -> None:
    """The compared run, measured against the stored rows: in its hooks when it takes
    the whole batch, row by row from its own recording when it is chunked too."""
    plan, compared = ctx.plan, ctx.b
    size = plan.batch.batch_size
    if plan.b_chunks:
        compare_stores(meter, record(ctx, compared, plan.b_chunks), size)
        return
    ctx.progress.stage(compared.name)
    ctx.output_type = compared.execute(
        ctx.kind.sink(plan, meter, ctx.store), plan.batch, [(0, size)],
        lambda _s, _e: f"{compared.name} (B={size})",
        ctx.progress.advance, ctx.check, ctx.copies)


def _random_check(plan: Plan, draws: RandomDraws, runners: tuple[Runner, Runner]
                  ) -> Callable[[str], None]:
    """After each run: refuses a model that drew random numbers (unless allowed). A moved
    generator is checked once with one pass of that run under :class:`SeededOps`, which
    sees this thread's ops only: draws by another thread do not count."""

    warned: list[str] = []

    def check(run: str) -> None:
        if not draws.drew() or plan.allow_train:
            return
        runner = runners[0] if run == runners[0].name else runners[1]
        start, stop = plan.a_chunks[0] if runner is runners[0] else (
            0, plan.batch.batch_size)
        seeded = SeededOps()
        args, kwargs = runner.feed(*plan.batch.rows(start, stop, copy=True))
        with runner.run.flags(), seeded:
            runner.model(*args, **kwargs)
        draws.drew()  # this pass's own draws are not the model's
        if not seeded.seen:
            draws.seen = False
            if not warned:
                warned.append(run)
                warnings.warn(
                    f"the random generator moved during the {run}, but no op of this "
                    f"comparison drew from it (another thread drawing random numbers?): "
                    f"the comparison is not affected, but the generators are put back as "
                    f"they were before it, which rewinds that thread's draws too",
                    DivtraceWarning, stacklevel=user_level())
            return
        raise BatchMixingError(
            f"the model drew random numbers in the {run} ({', '.join(sorted(set(seeded.seen)))}"
            f": F.dropout with training=True, a module left in train mode, torch.rand, "
            f"...): batched and split runs would differ for reasons that are not numerical. "
            f"Make the forward pass deterministic (model.eval(), training=False), or pass "
            f"allow_train=True to compare anyway")

    return check


def _meta(plan: Plan, ctx: Context, stored_bytes: int, draws: RandomDraws,
          probes: tuple[Probe, ...]) -> Meta:
    run_a = plan.a
    return Meta(
        batch_size=plan.batch.batch_size, a_chunk=run_a.chunk or plan.batch.batch_size,
        samples=plan.samples, batch_dim=plan.batch.batch_dim,
        a_passes=len(plan.a_chunks), stored_bytes=stored_bytes, rtol=plan.rtol,
        atol=plan.atol, train_mode=bool(plan.train_mode), mixing=plan.train_mode,
        torch=torch.__version__,
        explain={p.label: p.settings() for p in chosen(probes)},
        ops=plan.ops,
        resources={"keep": plan.keep, "offload": plan.offload, "graphs": plan.graphs},
        names=(plan.name("a"), plan.name("b")),
        runs=None if plan.default_pair else (run_a.label(), plan.b.label()),
        random_draws=draws.seen, output_type=ctx.output_type, graphed=dict(ctx.graphed),
        environment=environment(),
        settings={"a": run_settings(run_a, ctx.a.model),
                  "b": run_settings(plan.b, ctx.b.model)},
        notes={p.label: note for p in probes
               if (note := p.note()) is not None}, kind=ctx.kind.name)


def _meter(plan: Plan, ctx: Context, host: Host, parts: Parts,
           hooks: list[Hooks]) -> Meter:
    """The measured run's meter, as the kind makes it."""
    sites = [partial(h.site, ctx) for h in hooks if h.site is not None]
    calls = [partial(h.call, ctx) for h in hooks if h.call is not None]
    return ctx.kind.meter(plan, ctx.store, host, keep=parts.keeps_batched(plan),
                          prints=parts.prints_batched, site_watchers=sites,
                          call_watchers=calls)


def _each(hooks: list[Hooks], when: str, ctx: Context) -> None:
    """The probes' hooks of that time (``before``, ``start``, ``after``), in order."""
    for hook in hooks:
        work = getattr(hook, when)
        if work is not None:
            work(ctx)


def _kind(plan: Plan) -> tuple[Kind, Plan]:
    """The kind ``plan`` is of and the plan as it carries it out, its checks passed
    (before anything runs)."""
    kind = kind_of(plan)
    plan = kind.prepared(plan)
    kind.check(plan)
    obstacle = kind.cannot.get("graphs")
    if plan.graphs is True and obstacle is not None:
        raise DivtraceValueError(
            f"Resources(graphs=True), but the split run cannot be replayed from a CUDA "
            f"graph: {obstacle}. Pass Resources(graphs='auto') or False")
    return kind, plan


@collector_held()
def execute(plan: Plan, model: nn.Module, parts: Parts | None = None,
            origin: Origin | None = None) -> Comparison:
    """Carries out ``plan`` on ``model`` with ``parts`` (default: those the plan asks for,
    :func:`~divtrace.assembly.parts_for`); the model comes back untouched. ``origin``:
    how the comparison runs again, for :meth:`Comparison.remedies`."""
    kind, plan = _kind(plan)
    parts = parts_for(plan, model) if parts is None else parts
    walk = plan.walk if plan.walk is not None and plan.walk.model is model else Walk.of(model)
    reference = replace(Runner.of(plan.a, model, plan.modules, plan.output_only,
                                  plan.name("a"), parts.recorder, walk=walk),
                        around=partial(kind.around, "a"), wrap=kind.wrap)
    compared = replace(Runner.of(plan.b, model, plan.modules, plan.output_only,
                                 plan.name("b"), parts.recorder, beside=reference, walk=walk),
                       around=partial(kind.around, "b"), wrap=kind.wrap)
    host = Host()
    probes = copy.deepcopy(parts.probes)  # fresh ones: this run's findings are their own
    devices = cuda_devices((walk, reference.model, compared.model), plan.batch.leaves)
    theirs = plan.b.other_model is not None and plan.b.other_model is not model
    with Progress(parts.passes(plan), plan.progress) as progress, untouched(walk, devices), (
            untouched(Walk.of(compared.model), []) if theirs else nullcontext()):
        draws = RandomDraws(devices)
        ctx = Context(plan, model, reference, compared, host, progress,
                      check=_random_check(plan, draws, (reference, compared)),
                      copies=InputCopies(plan.batch), recorder=parts.recorder,
                      probes=probes, kind=kind)
        hooks = [probe.hooks() for probe in probes]
        _each(hooks, "before", ctx)
        ctx.store = record(ctx, reference, plan.a_chunks)
        stored_bytes = ctx.store.stored_bytes
        meter = ctx.meter = _meter(plan, ctx, host, parts, hooks)
        _each(hooks, "start", ctx)
        _measure(ctx, meter)
        meter.flush()  # the queued copies go before the probes' passes
        _each(hooks, "after", ctx)
        for site in meter.sites:
            site.prints = None  # the probes are done with them
            if not plan.keep:
                site.kept, site.kept_parts = None, None
    if ctx.copies is not None and ctx.copies.changed_given:
        warnings.warn(
            "the model changed its input in place in a pass that ran on x itself (the "
            "first pass, on a copy, did not): rows of x were changed", DivtraceWarning,
            stacklevel=user_level())
    return build(plan, probes, meter, _meta(plan, ctx, stored_bytes, draws, probes), host,
                 parts.figures, origin)
