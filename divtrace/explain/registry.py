"""The probes ``compare()`` knows, in the order of their columns in the table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from divtrace.explain.independence import Independence
from divtrace.explain.kernels import Kernels
from divtrace.explain.local import LocalReplay
from divtrace.explain.observer import ObserverCheck
from divtrace.explain.probe import Probe
from divtrace.explain.repeat import RepeatNoise
from divtrace.explain.roles import Roles
from divtrace.explain.truth import Fp64Truth

__all__ = ["EXPLAIN_COLUMNS", "PROBES", "probes_for"]

#: Every probe; a new explain option is one more entry here (and its own file).
PROBES: tuple[type[Probe], ...] = (Roles, Independence, LocalReplay, Fp64Truth, RepeatNoise,
                                   Kernels, ObserverCheck)

#: The columns each explain option of ``compare()`` adds: ``local=True``,
#: ``truth="fp64"``, ``repeat=n`` and ``kernels=True``.
EXPLAIN_COLUMNS: dict[str, tuple[str, ...]] = {
    probe.option: probe.columns for probe in PROBES if probe.option and probe.columns}


def probes_for(options: Mapping[str, Any], model: nn.Module) -> tuple[Probe, ...]:
    """The probes that ``options`` (``compare()``'s explain keywords) switch on for
    ``model``."""
    made = (probe.create(options, model) for probe in PROBES)
    return tuple(probe for probe in made if probe is not None)
