"""Float64 truth: how far each run is from a float64 run of the same samples."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import pandas as pd
import torch

from divtrace.align.ragged import joined
from divtrace.explain.context import Context
from divtrace.explain.probe import (
    Explained,
    Findings,
    Hooks,
    Judged,
    Probe,
    Settings,
    Spec,
    output_rows,
)
from divtrace.explain.rounding import CHECK, budget
from divtrace.explain.view import TableView
from divtrace.measure.host import Deferred
from divtrace.measure.measured import Measured
from divtrace.plan.runs import Run
from divtrace.record.rows import RowStore
from divtrace.record.runner import Runner
from divtrace.words import sci

__all__ = ["Fp64"]


def _joined_parts(ctx: Context, key: str, tensor: torch.Tensor,
                  truth: list[torch.Tensor | None]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The float64 run's, the measured run's and the reference run's real tokens of each
    compared prompt at one site, end to end (None when they do not line up)."""
    split = ctx.store.rows[key].parts if key in ctx.store.rows else None
    batched = ctx.meter.real_parts(tensor, [t.shape for t in truth if t is not None])
    if split is None or batched is None or any(p is None for p in (*split, *truth)):
        return None
    if [t.shape for t in truth if t is not None] != [p.shape for p in split if p is not None]:
        return None
    device = tensor.device
    return (joined(truth, device).double(), joined(batched).double(),
            joined(split, device).double())


class Fp64(Probe):
    """``"fp64"``: a float64 copy of the model (the user's stays untouched) runs
    the compared samples first; each run's rel_l2 against it, per site."""

    spec: ClassVar[Spec] = Spec(name="fp64", columns=("a_err_fp64", "b_err_fp64"),
                                shown=("a_err_fp64", "b_err_fp64"))

    def __init__(self) -> None:
        self.found: dict[str, Deferred] = {}
        self._truth: RowStore | None = None


    def _before(self, ctx: Context) -> None:
        """Runs the float64 copy on the compared samples and stores every site's rows."""
        ctx.progress.stage("float64 truth run")
        plan = ctx.plan
        device = next((p.device for p in ctx.model.parameters()), torch.device("cpu"))
        exact = Run(device="cpu" if device.type == "mps" else device,  # mps: no float64
                    dtype=torch.float64)
        runner = replace(Runner.of(exact, ctx.model, plan.modules, False,
                                   "float64 truth run", ctx.recorder), wrap=ctx.a.wrap)
        picked, self._truth, passes = ctx.kind.alone(plan)
        runner.execute(self._truth, picked, passes, lambda _s, _e: "float64 truth run",
                       check=ctx.check)
        ctx.progress.advance()

    def _on_site(self, ctx: Context, measured: Measured, tensor: torch.Tensor,
                rows: torch.Tensor) -> None:
        stored = self._truth.rows.get(measured.site.key) if self._truth is not None else None
        if stored is None or not stored.held or not tensor.is_floating_point():
            return
        if stored.parts is not None:  # prompts of different lengths: their real tokens
            found = _joined_parts(ctx, measured.site.key, tensor, stored.parts)
            if found is None:
                return
            exact, batched, split = found
        else:
            exact = RowStore.rows_on(stored, tensor.device).double()
            if exact.shape != rows.shape:
                return
            batched, split = ctx.store.pick(tensor).double(), rows.double()
        norm = torch.linalg.vector_norm(exact)
        errors = torch.stack([torch.linalg.vector_norm(batched - exact),
                              torch.linalg.vector_norm(split - exact)])
        stored.drop()
        self.found[measured.site.key] = ctx.host.add(
            torch.where(norm > 0, errors / norm, errors))

    def hooks(self) -> Hooks:
        return Hooks(before=self._before, site=self._on_site, passes=1)

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)), cls._findings(result.table, result.meta))

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        for row in rows:
            found = self.found.get(row["site"])
            if found is not None:
                errors = found.get()
                row["b_err_fp64"], row["a_err_fp64"] = float(errors[0]), float(
                    errors[1])

    @classmethod
    def _findings(cls, table: pd.DataFrame, meta: Settings) -> Findings:
        return Findings(beyond=_beyond(output_rows(table), meta))

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        out = result.output
        if out is None or math.isnan(out.get("b_err_fp64", math.nan)):
            return []
        b, s_ = out["b_err_fp64"], out["a_err_fp64"]
        a_name, b_name = result.meta.names
        low, high = min(b, s_), max(b, s_)
        if high == 0:
            verdict = "both equal it"
        elif low > 0 and high / low < 1.25:
            verdict = ("neither run is clearly closer to the exact answer (their errors are "
                       "within 1.25× of each other)")
        else:
            worse, better = (b_name, a_name) if b > s_ else (a_name, b_name)
            factor = "infinitely" if low == 0 else f"{high / low:.3g}×"
            verdict = f"the {worse} is {factor} further from it than the {better}"
        return [f"Against a float64 run of the same samples, the output of the {b_name} "
                f"is off by rel_l2 {sci(b)} and that of the {a_name} by {sci(s_)}: {verdict}."]


def _beyond(outputs: pd.DataFrame, meta: Settings) -> str | None:
    """Why floating point does not explain the output rows ``outputs``: one run far
    from float64 and the other not (None: it does)."""
    if "depends_on_shape" in outputs and not outputs.empty:
        shape = outputs["depends_on_shape"].astype("boolean")
        if shape.notna().all() and not shape.any():
            return None  # the precision test showed the output's difference is rounding
    for _, out in outputs.iterrows():
        if "b_err_fp64" not in out or math.isnan(out["b_err_fp64"]):
            continue
        b, a = out["b_err_fp64"], out["a_err_fp64"]
        high, low = max(b, a), min(b, a)
        limit, _, _ = budget(out["dtype"], meta)
        if high > limit and (low == 0 or high / low > 100):
            a_name, b_name = meta.names
            worse, better = (b_name, a_name) if b > a else (a_name, b_name)
            return (f"against a float64 run of the same samples the {worse} is off by "
                    f"rel_l2 {sci(high)} and the {better} by {sci(low)}: floating "
                    f"point does not explain that. {CHECK}")
    return None
