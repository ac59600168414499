"""One of the compared runs, ready to execute: configuration, model, recorder, name."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn

from divtrace.align.sites import ROOT
from divtrace.compat import pytree
from divtrace.plan.inputs import BatchedInput, each_once
from divtrace.plan.runs import Run
from divtrace.plan.selection import select_modules
from divtrace.plan.walk import Walk
from divtrace.record.experts import Routers, flattened_inside
from divtrace.record.graphs import GraphedRun
from divtrace.record.hooks import ModuleHooks
from divtrace.record.loop import InputCopies, drive
from divtrace.record.recorder import Recorder, Sink
from divtrace.record.rows import RowStore

__all__ = ["RecorderFactory", "Runner", "module_hooks"]

#: Makes the recorder of a run from its model and the selected modules (qualified name
#: -> module, the model itself under ``(model)``).
RecorderFactory = Callable[[nn.Module, dict[str, nn.Module]], Recorder]


def module_hooks(model: nn.Module, modules: dict[str, nn.Module],
                 routers: Routers | None = None) -> Recorder:
    """The default recorder: forward hooks on the selected modules (those inside a
    mixture-of-experts block, of ``routers`` or Hugging Face's, read per token)."""
    return ModuleHooks(modules, *flattened_inside(model, modules, routers))


@dataclass(frozen=True)
class Runner:
    """A :class:`~divtrace.Run` bound to the model it runs (the user's own, or a changed
    copy), the modules observed there and the recorder that observes them."""

    run: Run
    model: nn.Module
    modules: dict[str, nn.Module]
    recorder: Recorder
    name: str
    #: what every pass hands its tensors to, before the sink it is given (the kind's,
    #: :meth:`divtrace.Kind.wrap`: every rank's part of a sharded model's tensors)
    wrap: Callable[[Sink], Sink] | None = None
    #: a context around each of its executions (the kind's, :meth:`divtrace.Kind.around`)
    around: Callable[[], AbstractContextManager[Any]] = nullcontext

    @classmethod
    def of(cls, run: Run, model: nn.Module, modules: Any, output_only: bool, name: str,
           recorder: RecorderFactory = module_hooks, beside: Runner | None = None,
           walk: Walk | None = None) -> Runner:
        """The runner of ``run`` on ``model``, observing ``modules`` (or only the output).

        ``beside``: a runner of the same comparison (the same selection); when this run
        runs the very model it runs, its modules and recorder serve this run too.
        ``walk``: a walk of ``model`` already made (used when the run runs ``model``).
        """
        mine = run.model(model)
        if beside is not None and beside.model is mine:
            return cls(run, mine, beside.modules, beside.recorder, name)
        walked = walk.named if walk is not None and walk.model is mine else None
        selected = {ROOT: mine} if output_only else select_modules(mine, modules, walked)
        selected = run.renamed(selected)
        return cls(run, mine, selected, recorder(mine, selected), name)

    def feed(self, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The inputs as this run feeds them (moved, cast, reformatted)."""
        if not self.run.changes_inputs:
            return args, kwargs
        leaves, spec = pytree.tree_flatten((args, kwargs))
        mapped = pytree.tree_unflatten(each_once(leaves, self.run.tensor), spec)
        return mapped[0], mapped[1]

    def execute(self, sink: Sink, batch: BatchedInput, chunks: list[tuple[int, int]],
                label: Callable[[int, int], str], step: Callable[[], object] | None = None,
                check: Callable[[str], object] | None = None,
                copies: InputCopies | None = None, graphs: GraphedRun | None = None,
                unsuitable: str | None = None) -> str | None:
        """Runs ``chunks`` of ``batch`` under this run's flags, handing tensors to ``sink``
        (see :func:`~divtrace.record.loop.drive`); then ``check(self.name)``.

        ``graphs``: replays passes from a CUDA graph where it can (``sink`` is then a row
        store; ``unsuitable`` says why it cannot, when that is known beforehand).
        """
        if self.wrap is not None:
            sink = self.wrap(sink)
        with self.run.flags(), self.around():
            feed = self.run.tensor if self.run.changes_inputs else None
            if graphs is not None and isinstance(sink, RowStore):
                kind = graphs.drive(self.model, self.recorder, sink, batch, chunks, label,
                                    feed, step, copies, unsuitable)
            else:
                kind = drive(self.model, self.recorder, sink, batch, chunks, label, feed,
                             step, copies)
        if check is not None:
            check(self.name)
        return kind
