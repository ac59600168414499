"""One of the compared runs, ready to execute: configuration, model, recorder, name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from divtrace.align.sites import ROOT
from divtrace.compat import pytree
from divtrace.plan.inputs import BatchedInput
from divtrace.plan.runs import Run
from divtrace.plan.selection import select_modules
from divtrace.record.hooks import ModuleHooks
from divtrace.record.loop import drive
from divtrace.record.recorder import Sink

__all__ = ["Runner"]


@dataclass(frozen=True)
class Runner:
    """A :class:`~divtrace.Run` bound to the model it runs (the user's own, or a changed
    copy) and the recorder that observes it."""

    run: Run
    model: nn.Module
    recorder: ModuleHooks
    name: str

    @classmethod
    def of(cls, run: Run, model: nn.Module, modules: Any, output_only: bool,
           name: str) -> Runner:
        """The runner of ``run`` on ``model``, observing ``modules`` (or only the output)."""
        mine = run.model(model)
        selected = {ROOT: mine} if output_only else select_modules(mine, modules)
        return cls(run, mine, ModuleHooks(selected), name)

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The observed modules by qualified name (the model itself under ``(model)``)."""
        return self.recorder.modules

    def feed(self, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The inputs as this run feeds them (moved, cast, reformatted)."""
        run = self.run
        if run.device is None and run.dtype is None and not run.channels_last:
            return args, kwargs
        mapped = pytree.tree_map(run.tensor, (args, kwargs))
        return mapped[0], mapped[1]

    def execute(self, sink: Sink, batch: BatchedInput, chunks: list[tuple[int, int]],
                label: Callable[[int, int], str], step: Callable[[], object] | None = None,
                ) -> None:
        """Runs ``chunks`` of ``batch`` under this run's flags, handing tensors to ``sink``."""
        with self.run.flags():
            drive(self.model, self.recorder, sink, batch, chunks, label, self.feed, step)
