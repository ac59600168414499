"""Local error: each leaf replayed on the reference run's inputs, with the measured run's
kernels — the error a layer adds on its own, and how much it amplifies what it got."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, ClassVar

import pandas as pd
import torch

from divtrace.align.sites import CONSTANT, INPUT, flatten_output, site_key
from divtrace.align.status import Status
from divtrace.compat import pytree
from divtrace.explain.context import Context
from divtrace.explain.probe import Explained, Findings, Hooks, Judged, Probe, Settings, Spec
from divtrace.explain.view import TableView, sums
from divtrace.measure.fields import INDEX
from divtrace.measure.figures import rel_l2
from divtrace.measure.host import Deferred
from divtrace.measure.measured import CallRecord, LeafCall
from divtrace.measure.scale import ratio
from divtrace.plan.checks import patterns
from divtrace.record.lineage import Origin
from divtrace.record.oplineage import op_outputs, per_sample
from divtrace.record.stored import StoredRows

__all__ = ["Local", "ReplayStatus"]


class ReplayStatus(StrEnum):
    """Whether a leaf was replayed (``local_status``), or why not."""

    OK = "ok"
    TRAIN_MODE = "train_mode"  # modules in train mode are never replayed
    SKIPPED = "skipped"  # named by Local(skip=...)
    NO_INPUT = "no_input"  # an input's reference rows are not there (or were overwritten)


def _with_reference_rows(ctx: Context, call: LeafCall, sources: list[StoredRows | None]
                         ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Copies of the call's arguments, the compared rows replaced by the reference run's
    (copies: a module that works in place must not change the measured run's tensors);
    None when some rows do not fit."""
    leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
    stored_rows = iter(sources)
    replaced = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            replaced.append(leaf)
            continue
        stored = next(stored_rows)
        copy = leaf.clone() if stored is None else ctx.meter.with_reference(
            leaf, stored, bool(call.site.op))
        if copy is None:
            return None
        replaced.append(copy)
    args, kwargs = pytree.tree_unflatten(replaced, spec)
    return args, kwargs


class Local(Probe):
    """``"local"``: replays every leaf module of the measured run on the reference
    run's inputs for the compared rows (same values, the measured run's kernels)."""

    spec: ClassVar[Spec] = Spec(
        name="local", columns=("local_rel_l2", "local_max_abs", "amplification",
                               "local_status", "adds_error"),
        shown=("local_rel_l2", "adds_error", "amplification"),
        needs=frozenset({"whole_batch", "op_inputs"}))

    def __init__(self, skip: Iterable[str] | str = ()) -> None:
        """``skip``: glob patterns of module names not to replay (stateful modules, or
        ones with side effects)."""
        self.skip = patterns(skip, "Local(skip=...)")
        self.local: dict[tuple[str, str], Deferred] = {}  # (call, output site) -> stats
        self.status: dict[str, ReplayStatus] = {}

    def settings(self) -> dict[str, Any]:
        return {"skip": list(self.skip)}

    def _start(self, ctx: Context) -> None:
        """A site's reference rows stay until every call that reads them has replayed."""
        ctx.store.hold(key for parts in ctx.store.lineage.values() for _, key in parts
                       if key is not None)

    def _on_call(self, ctx: Context, call: LeafCall, record: CallRecord) -> None:
        store = ctx.store
        sources = [store.rows.get(part.key)
                   if part.origin != Origin.UNKNOWN and part.key is not None else None
                   for part in call.parts]
        try:
            self.status[call.site.key] = self._replay(ctx, call, sources)
        finally:  # the last reader of a site's reference rows releases them
            for part in call.parts:
                if part.key is not None:
                    store.release(part.key)

    def _replay(self, ctx: Context, call: LeafCall, sources: list[StoredRows | None]
                ) -> ReplayStatus:
        if call.training:
            return ReplayStatus.TRAIN_MODE
        names = (call.site.module, call.site.op.rsplit(".", 1)[0]) if call.site.op else (
            call.site.module,)
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.skip for name in names):
            return ReplayStatus.SKIPPED
        # the model's own input rows are the same in both runs: nothing to replace, unless
        # the module changed them in place (then the values it read are gone)
        same = [part.key in (INPUT, CONSTANT) for part in call.parts]
        if any(is_input and part.tensor is call.output
               for is_input, part in zip(same, call.parts, strict=True)):
            return ReplayStatus.NO_INPUT
        if any((stored is None or not stored.held) and not as_is
               for stored, as_is in zip(sources, same, strict=True)):
            return ReplayStatus.NO_INPUT
        inputs = _with_reference_rows(ctx, call, sources)
        if inputs is None:
            return ReplayStatus.NO_INPUT
        args, kwargs = inputs
        call.tracker.replaying = True
        try:
            output = call.run(*args, **kwargs)
        finally:
            call.tracker.replaying = False
        self._measure(ctx, call, output)
        return ReplayStatus.OK

    def _measure(self, ctx: Context, call: LeafCall, output: Any) -> None:
        meter, store = ctx.meter, ctx.meter.store
        site = call.site
        outputs: list[tuple[str, torch.Tensor, Status | None]]
        if site.op:  # an op's outputs, as the op recorder hands them on
            batch, dim = ctx.plan.batch.batch_size, store.batch_dim
            outputs = [(p, per_sample(t, dim, batch), None) for p, t in op_outputs(output)
                       if t.dim() > 0 or not p]
        else:
            outputs = ([("", output, None)] if isinstance(output, torch.Tensor)
                       else flatten_output(output))
        for path, tensor, opaque in outputs:
            if opaque is not None:
                continue
            key = (f"{site.key}/{path}" if path else site.key) if site.op else site_key(
                site.module, site.call, path)
            stats = meter.stats_at(key, tensor)
            if stats is not None:
                self.local[call.site.key, key] = ctx.host.add(stats)

    def hooks(self) -> Hooks:
        return Hooks(start=self._start, call=self._on_call)

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)), cls._findings(result.table, result.meta))

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        for row in rows:
            if view.call(row) is None:
                continue
            call_key = view.call_key(row)
            status = self.status.get(call_key)
            row["local_status"] = "" if status is None else status.value
            local = self.local.get((call_key, row["site"]))
            row["adds_error"] = None  # not replayed: not known
            if local is not None:
                own = sums([(local.get(), 1)])
                row["local_rel_l2"] = rel_l2(own.diff, own.ref)
                row["local_max_abs"] = float(local.get()[:, INDEX["max_abs"]].max())
                row["adds_error"] = bool(own.diff > 0)
            fields, inputs = view.fields.get(row["site"]), view.inputs(call_key)
            if fields is not None and inputs is not None:
                out = sums([fields])
                row["amplification"] = (
                    ratio(out.diff, out.scale, inputs.diff, inputs.scale) if inputs.diff > 0
                    else (math.inf if out.diff > 0 else math.nan))

    @classmethod
    def _findings(cls, table: pd.DataFrame, meta: Settings) -> Findings:
        return Findings(entries=_entries(table))

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        table = result.table
        if "local_rel_l2" not in table:
            return []
        ok = table[table["status"] == "ok"]
        diverged = ok[ok["leaf"] & (ok["mismatch"] > 0)]
        adders = diverged[diverged["adds_error"] == True]  # noqa: E712 (None: not known)
        carriers = diverged[diverged["adds_error"] == False]  # noqa: E712
        lines = []
        if not adders.empty:
            own = ", ".join(f"'{r.site}' ({r.module_type}) {r.local_rel_l2:.2g}"
                            for r in adders.head(6).itertuples())
            more = "" if len(adders) <= 6 else f" and {len(adders) - 6} more"
            verb = "layers add error of their own" if len(adders) > 1 else (
                "layer adds error of its own")
            lines.append(f"Replayed on identical inputs with the batched run's kernels, "
                         f"{len(adders)} {verb} (local rel_l2): {own}{more}.")
        if not carriers.empty:
            names = ", ".join(f"'{r.site}'" for r in carriers.head(6).itertuples())
            more = "" if len(carriers) <= 6 else f" and {len(carriers) - 6} more"
            lines.append(f"{len(carriers)} divergent layer{'s' * (len(carriers) > 1)} add "
                         f"none: {'they only pass' if len(carriers) > 1 else 'it only passes'} "
                         f"on the error {'they receive' if len(carriers) > 1 else 'it receives'}"
                         f" ({names}{more}).")
        amp = ok["amplification"].replace(math.inf, math.nan).dropna()
        if not amp.empty and amp.max() > 0:
            top = ok.loc[amp.idxmax()]
            growth = top["growth"]
            relative = "" if math.isnan(growth) else (
                f"; relative to the values there, the error grows {growth:.3g}×"
                + (" (the layer copies or scales values: the relative error stays)"
                   if 2 / 3 < growth < 1.5 else ""))
            lines.append(f"The largest amplification of the incoming error's norm is "
                         f"{top['amplification']:.3g}× at '{top['site']}' "
                         f"({top['module_type']}){relative}.")
        return lines


def _entries(table: pd.DataFrame) -> tuple[tuple[pd.Series, float, str], ...]:
    """The layers whose own error, on identical inputs, is not zero."""
    if "local_rel_l2" not in table:
        return ()
    return tuple((row, row["local_rel_l2"], "own")
                 for _, row in table[table["local_rel_l2"] > 0].iterrows())
