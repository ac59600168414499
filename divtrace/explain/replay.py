"""Routing replay (``explain=["replay"]``): one more pass of run b with run a's expert
choice forced at every mixture-of-experts router, to show how much of the difference is
routing. Run a's rows are kept until that pass (not released site by site as run b
measures them).

At each router (Hugging Face's ``mlp.gate``, or the routing probe's
:class:`~divtrace.Routers`), the compared samples' tokens get run a's chosen experts and
run a's weights for them (the router's outputs ``2`` and ``1``, or the paths the routers
name, as run a recorded them); every other token keeps run b's own. What is left between the runs at
the output is the difference that does not come from routing.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from divtrace.align.sites import ROOT, flatten_output, replaced
from divtrace.explain.context import Context
from divtrace.explain.held import READS, figures_of
from divtrace.explain.probe import Explained, Hooks, Judged, Probe, Spec
from divtrace.explain.routing import routers_in
from divtrace.measure.host import Host
from divtrace.measure.measured import Measured
from divtrace.words import the

__all__ = ["Replay"]


class Replay(Probe):
    """``"replay"``: run b once more with run a's expert choice forced at every router."""

    spec: ClassVar[Spec] = Spec(name="replay")

    def __init__(self) -> None:
        self._keys: dict[tuple[str, int], dict[str, str]] = {}  # (router, call) -> path: key
        self._routers: set[str] | None = None
        self._held: list[str] = []
        self.found: dict[str, Any] | None = None

    def hooks(self) -> Hooks:
        return Hooks(start=self._start, site=self._site, after=self._after, passes=1)

    def _start(self, ctx: Context) -> None:
        """Run a's rows kept past run b's measurement, for the replay's pass to be
        measured against (and its routers' rows to be replayed from)."""
        self._held = list(ctx.store.rows)
        ctx.store.hold(self._held)

    def _site(self, ctx: Context, measured: Measured, tensor: torch.Tensor,
              rows: torch.Tensor) -> None:
        site = measured.site
        if self._routers is None:
            self._routers = set(routers_in(ctx.probes).names(ctx.model))
        if site.module in self._routers and not site.op:
            self._keys.setdefault((site.module, site.call), {})[site.path] = site.key

    def _after(self, ctx: Context) -> None:
        try:
            self._replay(ctx)
        finally:
            for key in self._held:
                ctx.store.release(key)

    def _replay(self, ctx: Context) -> None:
        given = routers_in(ctx.probes)
        routers = set(given.names(ctx.b.model))
        paths = [p for p in (given.weights, given.experts) if p is not None]
        named = dict(ctx.b.model.named_modules())
        why = self._cannot(ctx, routers)
        if why:
            self.found = {"ran": False, "why": why}
            return
        layout = getattr(ctx.plan.batch, "layout", None)
        tokens = None if layout is None else layout(0, ctx.plan.batch.batch_size)
        calls: dict[str, int] = {}

        def forced(name: str) -> Any:
            def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
                call = calls.get(name, 0)
                calls[name] = call + 1
                keys = self._keys.get((name, call), {})
                if not set(paths) <= set(keys):
                    return None
                own = {path: tensor for path, tensor, _ in flatten_output(output)}
                choice = {path: own[path].clone() for path in paths}
                for path, target in choice.items():
                    _place(ctx, keys[path], target, tokens)
                return replaced(output, choice)
            return hook

        handles = [named[name].register_forward_hook(forced(name)) for name in routers
                   if name in named]
        host = Host()
        try:
            meter = ctx.measure(ctx.store, host=host, label=f"{ctx.b.name}, routing replayed",
                                reads=READS)
        finally:
            for handle in handles:
                handle.remove()
        meter.flush()
        host.fetch()
        found = figures_of(meter, ctx.plan.batch.batch_size)
        self.found = {"ran": True, "rel_l2": {  # None: no rel_l2 (a site of integers)
            key: rel if math.isfinite(rel) else None for key, (_, rel) in found.items()}}

    def _cannot(self, ctx: Context, routers: set[str]) -> str | None:
        """Why the replay cannot run here (None: it can)."""
        if not routers:
            return "the model has no mixture-of-experts router"
        if not self._keys:
            return "no router's choice was compared"
        routing = ctx.finding("routing") or {}
        if routing.get("routers") and not any(
                router["flips"] for router in routing["routers"].values()):
            return "no token went to other experts in the two runs"
        batch = ctx.plan.batch
        layout = getattr(batch, "layout", None)
        if layout is not None and (layout(0, batch.batch_size).starts is not None or (
                layout(0, batch.batch_size).rows is not None)):
            return "the replay places tokens of padded prompts and plain batches only"
        return None

    def note(self) -> Any:
        return self.found

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        found = result.meta.notes.get("replay")
        if not found:
            return Explained()
        if not found["ran"]:
            return Explained((f"Routing replay did not run: {found['why']}.",))
        table = result.table
        out = table[table["module"] == ROOT]
        if out.empty:
            return Explained()
        site = str(out.iloc[-1]["site"])
        before = float(out.iloc[-1]["rel_l2"])
        after = found["rel_l2"].get(site)
        if after is None:
            return Explained()
        names = result.meta.names
        return Explained((
            f"Routing replay (one more pass of {the(names[1])}, every router given "
            f"{the(names[0])}'s choice of experts and their weights for the compared "
            f"tokens): at the output rel_l2 {before:.3g} becomes {after:.3g}; what is left "
            f"does not come from routing.",))


def _place(ctx: Context, key: str, target: torch.Tensor, tokens: Any) -> None:
    """Run a's stored rows of site ``key`` written into ``target``, run b's flattened
    tokens of that router, at the compared samples' tokens."""
    stored = ctx.store.rows.get(key)
    if stored is None:
        return
    samples = list(ctx.store.samples)
    if tokens is None:  # a plain batch: (rows, sequence) flattened, row by row
        rows = stored.rows
        if rows is None:
            return
        length = target.shape[0] // ctx.plan.batch.batch_size
        for slot, sample in enumerate(samples):
            target[sample * length:(sample + 1) * length] = rows[slot].reshape(
                length, *target.shape[1:]).to(target.device, target.dtype)
        return
    if stored.parts is None:
        return
    firsts = stored.firsts or [0] * len(stored.parts)
    for slot, sample in enumerate(samples):
        part = stored.parts[slot]
        if part is None:
            continue
        start = sample * tokens.length + tokens.offsets[sample] + firsts[slot]
        target[start:start + part.shape[0]] = part.to(target.device, target.dtype)
