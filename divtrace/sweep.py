"""Sweeps over run settings: many comparisons at once, one per setting."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from divtrace.compare import compare
from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.inputs import each_once
from divtrace.plan.make import make_plan
from divtrace.plan.runs import Run, split_run
from divtrace.remedies.cost import sync
from divtrace.report import saved
from divtrace.report.comparison import Comparison
from divtrace.report.result import Result, rows_of
from divtrace.words import readable, sci

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Sweep", "model_type", "sweep"]

_RUN_FIELDS = {f.name for f in fields(Run)} - {"name"}


def _settings(settings: Mapping[str, Any] | Sequence[Run]) -> dict[str, Run]:
    """Named runs from a list of runs, a dict of named runs, or a settings matrix."""
    if isinstance(settings, Mapping):
        values = list(settings.values())
        if values and all(isinstance(v, Run) for v in values):
            return {str(k): v for k, v in settings.items()}
        unknown = [k for k in settings if k not in _RUN_FIELDS]
        if unknown:
            raise DivtraceValueError(
                f"settings {unknown} are not Run fields; a settings matrix maps Run fields "
                f"({', '.join(sorted(_RUN_FIELDS))}) to lists of values")
        lists = [v if isinstance(v, list | tuple) else [v] for v in values]
        runs = [Run(**dict(zip(settings, combo, strict=True)))
                for combo in itertools.product(*lists)]
        return {run.label(): run for run in runs}
    runs = list(settings)
    bad = [r for r in runs if not isinstance(r, Run)]
    if bad:
        raise DivtraceTypeError(f"settings must hold divtrace.Run objects; got {bad[0]!r}")
    return {run.label(): run for run in runs}


@dataclass(frozen=True)
class Sweep(Result):
    """Comparisons of several run settings against one reference run.

    Attributes:
        table: One row per setting: the output's divergence, the first divergent site,
            the number of sources, the verdict, and ``cost``: the time of run b's bare
            passes under the setting over that of the same passes of the model as is
            (medians of 5 taken in turn, measured in the sweep).
        comparisons: The full :class:`~divtrace.Comparison` of each setting, by name.
    """

    table: pd.DataFrame
    comparisons: dict[str, Comparison]
    document: ClassVar[str] = "sweep"
    title: ClassVar[str] = "divtrace sweep"

    def summary(self) -> str:
        """A line per setting: its verdict, where its runs first part, the output's rel_l2;
        and, for reduced precision, what bit-identical runs do not say."""
        same = [str(n) for n in self.table.loc[self.table["verdict"] == "identical",
                                               "setting"]]
        lines = [f"{len(self.table)} setting(s); bit-identical at every compared site under "
                 f"{len(same)}: {'; '.join(same)}." if same else
                 f"{len(self.table)} setting(s); under none of them are the runs "
                 f"bit-identical at every compared site."]
        for row in self.table.itertuples():
            if row.verdict == "identical":
                continue
            where = "" if row.first_divergence is None else (
                f", first at '{row.first_divergence}'")
            lines.append(f"{row.setting}: {row.verdict}{where}; output rel_l2 "
                         f"{sci(row.output_rel_l2)}; its passes take {row.cost:.3g}× as "
                         f"long as the model's as is.")
        coarse = [name for name, c in self.comparisons.items() if _coarse(c)]
        if coarse:
            lines.append(
                f"{'; '.join(coarse)}: both runs compute in reduced precision (bfloat16, "
                f"float16, TF32 or matmul_precision below 'highest'), so runs that agree say "
                f"nothing of their error against float32; compare them with a float32 run "
                f"(a=divtrace.Run()) to see it.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        same = int((self.table["verdict"] == "identical").sum())
        return f"<divtrace.Sweep: {len(self.table)} settings, {same} bit-identical>"

    @property
    def sites(self) -> pd.DataFrame:
        """The compact view: :attr:`table`, figures as text (``cost`` as ``1.02×``)."""
        view = readable(self.table)
        view["cost"] = ["" if c != c else f"{c:.3g}×" for c in self.table["cost"]]
        return view

    def rows(self) -> pd.DataFrame:
        """A row per setting: its output's figures."""
        return rows_of(self.table, "{setting}", mismatch="output_mismatch",
                       rel_l2="output_rel_l2")

    def _fields(self) -> dict[str, Any]:
        return {"table": saved.frame_to_json(self.table),
                "comparisons": [[name, saved.comparison_fields(c)]
                                for name, c in self.comparisons.items()]}

    @classmethod
    def _restored(cls, doc: dict[str, Any],
                  comparison: Callable[[dict[str, Any]], Comparison]) -> Sweep:
        return cls(saved.frame_from_json(doc["table"]),
                   {name: comparison(value) for name, value in doc["comparisons"]})

    def _parts(self) -> list[str]:
        from divtrace.report.html import drawn

        return [drawn(self.plot, (10, 4))]

    def plot(self, ax: Axes | None = None, metric: str = "output_rel_l2") -> Axes:
        """One bar per setting; bit-identical settings are drawn on a grey floor."""
        from divtrace.report.plot_sweeps import plot_sweep

        return plot_sweep(self, ax=ax, metric=metric, model=model_type(self.comparisons))


def model_type(comparisons: Mapping[Any, Comparison]) -> str | None:
    """The model's type, from the output row of a sweep's first comparison."""
    first = next(iter(comparisons.values()), None)
    out = None if first is None else first.output
    return None if out is None else str(out["module_type"])


def _coarse(result: Comparison) -> bool:
    """Whether both runs of a comparison computed in reduced precision."""
    settings = result.meta.settings

    def reduced(run: Mapping[str, Any]) -> bool:
        return (str(run.get("dtype", "")).endswith(("bfloat16", "float16"))
                or bool(run.get("tf32_matmul")) or bool(run.get("bf16_matmul_cpu"))
                or run.get("matmul_precision") in ("high", "medium"))
    return bool(settings) and all(reduced(settings[k]) for k in ("a", "b") if k in settings)


def _passes(model: nn.Module, x: Any, run: Run, batch_dim: Any = 0
            ) -> Callable[[], float]:
    """A timer of run ``run``'s bare passes on ``x``: each call returns one time."""
    other = Run() if run == Run(chunk=1) else Run(chunk=1)  # any run a: only b is timed
    plan = make_plan(model, x, a=other, b=run, batch_dim=batch_dim, progress=False)
    mine = run.model(model)
    chunks = plan.b_chunks or ((0, plan.batch.batch_size),)
    passes = [plan.batch.build(each_once(plan.batch.row_leaves(start, stop, copy=True),
                                         run.tensor)) for start, stop in chunks]
    devices = {t.device for t in plan.batch.leaves if isinstance(t, torch.Tensor)}
    if run.device is not None:
        devices.add(torch.device(run.device))

    loops = [1]  # the passes are repeated until a timing takes 20 ms or more

    def once() -> float:
        with run.flags(), torch.no_grad():
            sync(devices)
            start = time.perf_counter()
            for _ in range(loops[0]):
                for args, kwargs in passes:
                    mine(*args, **kwargs)
            sync(devices)
            took = (time.perf_counter() - start) / loops[0]
        loops[0] = max(loops[0], min(1000, math.ceil(0.02 / max(took, 1e-9))))
        return took
    return once


def _cost(model: nn.Module, x: Any, run: Run, batch_dim: Any, repeats: int = 5) -> float:
    """Run ``run``'s bare passes over the same passes of the model as is: medians of
    ``repeats`` timings taken in turn with those of the model as is (after one each)."""
    setting, bare = _passes(model, x, run, batch_dim), _passes(model, x, Run(), batch_dim)
    setting(), bare(), setting(), bare()  # warm up, and learn how often to repeat
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(repeats):
        for which, timer in ((0, setting), (1, bare))[::1 if i % 2 else -1]:
            times[which].append(timer())
    base = statistics.median(times[1])
    return statistics.median(times[0]) / base if base > 0 else math.nan


def sweep(model: nn.Module, x: Any, settings: Mapping[str, Any] | Sequence[Run], *,
          a: Run | None = None, chunk: int | None = None, progress: bool = True,
          **options: Any) -> Sweep:
    """Runs the model under several settings: does each one diverge, and where?

    Without ``a``, each setting answers "do batched and split runs part under this
    setting?": run a in chunks of ``chunk`` and run b on the whole batch, both with the
    setting. With ``a``, each setting is run b, compared with run a.

    Args:
        model: The model.
        x: Its input, as for :func:`divtrace.compare`.
        settings: A list of :class:`Run`, a dict of named runs, or a settings matrix: a
            dict of Run fields to lists of values, every combination of which is run,
            e.g. ``{"cudnn": [True, False], "tf32_matmul": [False, True]}``.
        a: The run each setting is compared with (default: none — split vs batched
            under each setting).
        chunk: Run a's batch size (as in every face): without ``a``, that of each
            setting's split run (default 1: per sample); with ``a``, ``a``'s.
        progress: A progress bar over the settings, on stderr.
        **options: Passed to :func:`divtrace.compare` (``samples``, ``modules``, ...).

    Returns:
        A :class:`Sweep`.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
        >>> found = divtrace.sweep(net, torch.randn(6, 4), {"dtype": [torch.float64]},
        ...                        a=divtrace.Run(), progress=False)
        >>> list(found.table.setting)
        ['dtype=float64']
    """
    named = _settings(settings)
    if a is not None:
        a = split_run(a, chunk)
    if not named:
        raise DivtraceValueError("settings is empty; give at least one Run")
    rows, comparisons = [], {}
    for name, run in tqdm(named.items(), desc="divtrace: sweep", disable=not progress,
                          leave=False):
        if a is None:  # split vs batched, both under this setting
            first, second = replace(run, chunk=1 if chunk is None else chunk), (
                replace(run, chunk=None))
        else:
            first, second = a, run
        result = compare(model, x, a=first, b=second, progress=False, **options)
        comparisons[name] = result
        out = result.output
        table = result.table
        ok = table[table["status"] == "ok"]
        first = result.first_divergence
        rows.append({
            "setting": name,
            "output_rel_l2": math.nan if out is None else out["rel_l2"],
            "output_mismatch": math.nan if out is None else out["mismatch"],
            "output_max_abs": math.nan if out is None else out["max_abs"],
            "first_divergence": None if first is None else first["site"],
            "sources": len(result.sources),
            "identical_sites": int((ok["mismatch"] == 0).sum()),
            "sites": len(ok),
            "verdict": result.verdict,
            "cost": _cost(model, x, second, options.get("batch_dim", 0)),
        })
    return Sweep(pd.DataFrame(rows), comparisons)
