"""Kernels: what each site launched in one profiled pass of each run."""

from __future__ import annotations

from typing import Any, ClassVar

from divtrace.explain.context import Context
from divtrace.explain.probe import Explained, Hooks, Judged, Probe, Spec
from divtrace.explain.profiling import kernel_family, kernels_by_site
from divtrace.explain.view import TableView

__all__ = ["Kernels"]


class Kernels(Probe):
    """``"kernels"``: ``torch.profiler`` over one pass of each run, a range per module
    call; per site, the GPU kernels it launched (on the CPU, its innermost ops)."""

    spec: ClassVar[Spec] = Spec(
        name="kernels", columns=("kernels_a", "kernels_b", "kernels_differ"),
        shown=("kernels_differ",), needs=frozenset({"whole_batch"}))

    def __init__(self) -> None:
        self.batched: dict[str, list[str]] = {}
        self.split: dict[str, list[str]] = {}


    def _after(self, ctx: Context) -> None:
        ctx.progress.stage("profiling")
        batch = ctx.plan.batch
        start, stop = ctx.plan.a_chunks[0]
        for runner, rows, count, into in (
                (ctx.a, batch.rows(start, stop, copy=True), stop - start, self.split),
                (ctx.b, batch.whole(copy=True), batch.batch_size, self.batched)):
            with runner.run.flags():
                into.update(kernels_by_site(runner.model, runner.recorder, count,
                                             *runner.feed(*rows)))
            ctx.progress.advance()

    def hooks(self) -> Hooks:
        return Hooks(after=self._after, passes=2)

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)))

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        for row in rows:
            key = view.call_key(row)
            batched, split = self.batched.get(key, []), self.split.get(key, [])
            row["kernels_b"] = "; ".join(batched)
            row["kernels_a"] = "; ".join(split)
            row["kernels_differ"] = sorted(set(batched)) != sorted(set(split))

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        if "kernels_b" not in result.table:
            return []
        lines = []
        for r in result.sources.head(4).itertuples():
            batched = [kernel_family(k) for k in str(r.kernels_b).split("; ") if k]
            split = [kernel_family(k) for k in str(r.kernels_a).split("; ") if k]
            if not batched and not split:
                continue
            only_b = [k for k in dict.fromkeys(batched) if k not in split]
            only_s = [k for k in dict.fromkeys(split) if k not in batched]
            if not only_b and not only_s:
                lines.append(f"'{r.site}' launched the same kinds of kernel in both runs "
                             f"({', '.join(dict.fromkeys(batched))}): the difference comes "
                             f"from how they split the work.")
            else:
                a_name, b_name = result.meta.names
                lines.append(f"'{r.site}' ({r.module_type}): the {b_name} launched "
                             f"{', '.join(only_b) or 'nothing else'}, where the {a_name} "
                             f"launched {', '.join(only_s) or 'nothing else'}.")
        return lines
