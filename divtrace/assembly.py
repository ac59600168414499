"""What the pipeline assembles from a plan before anything runs: the explain probes that
``explain=`` asks for, the table's figures and each run's recorder.

The plan (:mod:`divtrace.plan`) is pure data — runs, inputs, samples, selection,
``explain=`` as given; the parts that carry out a comparison come from the later layers
and are put together here, in the faces' layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from divtrace.align.sites import ROOT
from divtrace.errors import DivtraceValueError
from divtrace.explain.probe import Probe
from divtrace.explain.registry import probes_for
from divtrace.explain.routing import routers_in
from divtrace.measure.figures import FIGURES, Figure
from divtrace.plan.make import Plan
from divtrace.record.ops import OpRecorder
from divtrace.record.recorder import Recorder
from divtrace.record.runner import RecorderFactory, module_hooks

__all__ = ["Parts", "parts_for"]


@dataclass(frozen=True)
class Parts:
    """The parts of one comparison.

    Attributes:
        probes: The explain probes, in column order.
        figures: The figures of the table (default: the registry's).
        recorder: Makes each run's recorder (module forward hooks, or with ``ops`` the op
            recorder).
    """

    probes: tuple[Probe, ...]
    figures: tuple[Figure, ...] = FIGURES
    recorder: RecorderFactory = module_hooks

    def passes(self, plan: Plan) -> int:
        """Forward passes in all, for the progress bar."""
        return (len(plan.a_chunks) + max(1, len(plan.b_chunks))
                + sum(probe.hooks().passes for probe in self.probes))

    def keeps_batched(self, plan: Plan) -> bool:
        """Whether the measured run's compared rows are kept (asked for, or needed)."""
        return plan.keep or any("b_kept" in probe.spec.needs for probe in self.probes)

    @property
    def prints_batched(self) -> bool:
        """Whether the measured run's compared rows are fingerprinted."""
        return any("b_prints" in probe.spec.needs for probe in self.probes)


def parts_for(plan: Plan, model: nn.Module) -> Parts:
    """The parts that ``plan`` asks for: each probe is checked against the model here."""
    probes = probes_for(plan.explain, model)
    needing = [probe.label for probe in probes if "whole_batch" in probe.spec.needs]
    if plan.b.chunk is not None and needing:
        raise DivtraceValueError(
            f"explain={needing} need(s) run b to take the whole batch in one pass; got "
            f"b=Run(chunk={plan.b.chunk}). Swap a and b, or leave them out of explain=")
    through_views = not any("op_inputs" in probe.spec.needs for probe in probes)
    return Parts(probes, FIGURES, _recorder(plan, through_views, probes))


def _recorder(plan: Plan, through_views: bool, probes: tuple[Probe, ...]) -> RecorderFactory:
    """The recorder of each run: module hooks (reading per token inside the
    mixture-of-experts blocks of the routing probe's routers), or with ``ops`` the op
    recorder (which follows lineage through views unless the local replay needs every
    op's inputs)."""
    ops = plan.ops
    if not ops:
        routers = routers_in(probes)
        return module_hooks if routers.pattern is None else functools.partial(
            module_hooks, routers=routers)
    modules, batch_dim = plan.modules, plan.batch.batch_dim

    def make(model: nn.Module, selected: dict[str, nn.Module]) -> Recorder:
        scopes = set(selected) if modules is None else set(selected) - {ROOT}
        return OpRecorder(model, selected, scopes, batch_dim, module_sites=ops is True,
                          through_views=through_views)

    return make
