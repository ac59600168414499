"""The pipeline: a :class:`~divtrace.plan.make.Plan` carried out, stage by stage.

record the reference run → measure the compared run against it → explain (the probes'
passes and columns) → report (:class:`~divtrace.Comparison`).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch
from torch import nn

from divtrace.explain.probe import Context
from divtrace.explain.registry import PROBES
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.plan.make import Plan
from divtrace.progress import Progress
from divtrace.record.guard import untouched
from divtrace.record.rows import RowStore
from divtrace.record.runner import Runner
from divtrace.report.comparison import Comparison
from divtrace.report.meta import Meta
from divtrace.report.table import build

__all__ = ["execute", "record"]


def record(ctx: Context, runner: Runner, chunks: tuple[tuple[int, int], ...]) -> RowStore:
    """Runs ``chunks`` of the batch with ``runner``, keeping the compared samples' rows."""
    plan = ctx.plan
    store = RowStore(list(plan.samples), plan.batch.batch_dim, plan.offload,
                     runner.run.chunk or plan.batch.batch_size, pinned=plan.keep)

    def label(start: int, stop: int) -> str:
        inside = [s for s in plan.samples if start <= s < stop]
        return f"{runner.name}, chunk of rows {start}:{stop} (samples {inside})"

    ctx.progress.stage(runner.name)
    runner.execute(store, plan.batch, list(chunks), label, ctx.progress.advance)
    return store


def _measure(ctx: Context, meter: Meter) -> None:
    """The compared run, measured against the stored rows: in its hooks when it takes
    the whole batch, row by row from its own recording when it is chunked too."""
    plan, compared = ctx.plan, ctx.compared
    size = plan.batch.batch_size
    if plan.compared_chunks:
        meter.compare_stores(record(ctx, compared, plan.compared_chunks), size)
        return
    ctx.progress.stage(compared.name)
    compared.execute(meter, plan.batch, [(0, size)], lambda _s, _e: f"{compared.name} (B={size})",
                     ctx.progress.advance)


def _plain(value: Any) -> Any:
    """A JSON-ready form of an option's value (NumPy scalars become Python numbers)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return value.item() if hasattr(value, "item") else str(value)


def _meta(plan: Plan, stored_bytes: int) -> Meta:
    reference = plan.reference
    options = {probe.option: _plain(plan.options.get(probe.option))
               for probe in PROBES if probe.option}
    return Meta(
        batch_size=plan.batch.batch_size, chunk=reference.chunk or plan.batch.batch_size,
        samples=plan.samples, batch_dim=plan.batch.batch_dim,
        split_passes=len(plan.reference_chunks), stored_bytes=stored_bytes, rtol=plan.rtol,
        atol=plan.atol, train_mode=bool(plan.train_mode), torch=torch.__version__,
        options=options,
        runs=None if plan.default_pair else (reference.label(), plan.compared.label()))


def execute(plan: Plan, model: nn.Module) -> Comparison:
    """Carries out ``plan`` on ``model``; the model comes back untouched."""
    reference = Runner.of(plan.reference, model, plan.modules, plan.output_only, plan.name("a"),
                          plan.recorder)
    compared = Runner.of(plan.compared, model, plan.modules, plan.output_only, plan.name("b"),
                         plan.recorder)
    host = Host()
    probes = copy.deepcopy(plan.probes)  # fresh ones: this run's findings are their own
    with Progress(plan.passes, plan.progress) as progress, untouched(
            model, restore_buffers=bool(plan.train_mode)):
        ctx = Context(plan, model, reference, compared, host, progress)
        for probe in probes:
            probe.before(ctx)
        ctx.store = record(ctx, reference, plan.reference_chunks)
        stored_bytes = ctx.store.stored_bytes
        meter = ctx.meter = Meter(
            ctx.store, plan.batch.batch_size, host, plan.rtol, plan.atol,
            keep=plan.keeps_batched,
            site_watchers=[partial(p.on_site, ctx) for p in probes if p.watches_sites],
            call_watchers=[partial(p.on_call, ctx) for p in probes if p.watches_calls])
        for probe in probes:
            probe.start(ctx)
        _measure(ctx, meter)
        for probe in probes:
            probe.after(ctx)
        if not plan.keep:
            for site in meter.sites:
                site.kept = None
    return build(plan, probes, meter, _meta(plan, stored_bytes), host)
