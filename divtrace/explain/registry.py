"""The built-in probes, in the order of their columns, and ``explain=`` made into probes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from torch import nn

from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.explain.fp64 import Fp64
from divtrace.explain.independence import Independence
from divtrace.explain.kernels import Kernels
from divtrace.explain.local import Local
from divtrace.explain.observer import Observer
from divtrace.explain.precision import Precision
from divtrace.explain.probe import Probe
from divtrace.explain.regions import Regions
from divtrace.explain.repeat import Repeat
from divtrace.explain.replay import Replay
from divtrace.explain.roles import Roles
from divtrace.explain.routing import Routing
from divtrace.explain.tokens import PerToken

__all__ = ["BY_DEFAULT", "EXPLAIN_COLUMNS", "NAMES", "PROBES", "Explain", "chosen", "probes_for"]

#: Every built-in probe; a new one is one more entry here (and its own file).
PROBES: tuple[type[Probe], ...] = (Roles, Independence, Precision, Local, Fp64, Repeat,
                                   Kernels, Observer, PerToken, Regions, Routing, Replay)

#: The names ``explain=`` takes, each with its probe.
NAMES: dict[str, type[Probe]] = {probe.spec.name: probe for probe in PROBES if probe.spec.name}

#: The probes that run unless ``explain=`` turns them off, each as it runs then (the
#: observer only for models with hook-sensitive modules; named, for every model).
BY_DEFAULT: dict[str, Callable[[], Probe]] = {
    name: probe for name, probe in NAMES.items() if probe.spec.default} | {
    "observer": partial(Observer, always=False)}

#: The columns each named probe adds.
EXPLAIN_COLUMNS: dict[str, tuple[str, ...]] = {
    name: probe.spec.columns for name, probe in NAMES.items() if probe.spec.columns}

#: What ``explain=`` takes: names, ``"-name"`` (a default probe off), probes.
Explain = Iterable["str | Probe | type[Probe]"] | str | None


def _named(item: Any) -> tuple[str, Probe | None]:
    """An ``explain=`` entry as (name, probe); ``"-name"`` gives (name, None)."""
    if isinstance(item, type) and issubclass(item, Probe):
        item = item()
    if isinstance(item, Probe):
        return item.label, item
    if not isinstance(item, str):
        raise DivtraceTypeError(
            f"explain= takes probe names ({', '.join(NAMES)}), '-name' to turn a default "
            f"one off, or divtrace.Probe instances; got {type(item).__name__}")
    name = item.removeprefix("-")
    if name not in NAMES:
        raise DivtraceValueError(
            f"explain= has no probe {name!r}; the probes are {', '.join(NAMES)} (or a "
            f"divtrace.Probe of your own)")
    if item.startswith("-"):
        if name not in BY_DEFAULT:
            raise DivtraceValueError(
                f"explain={item!r} turns off a default probe, but {name!r} runs only when "
                f"named; leave it out")
        return name, None
    return name, NAMES[name]()


def chosen(probes: Iterable[Probe]) -> tuple[Probe, ...]:
    """Of ``probes``, those ``explain=`` chose: every one but a built-in probe without a
    name (the roles, which always run)."""
    return tuple(p for p in probes if p.spec.name or type(p) not in PROBES)


def probes_for(explain: Explain, model: nn.Module) -> tuple[Probe, ...]:
    """The probes ``explain=`` asks for on ``model``, in column order (the built-in ones
    first, then the others as given): the default probes unless turned off, each probe
    checked against the model (left out where it has nothing to do)."""
    items = [] if explain is None else [explain] if isinstance(explain, str) else list(explain)
    chosen: dict[str, Probe] = {}
    off: set[str] = set()
    for item in items:
        name, probe = _named(item)
        if name in chosen or name in off:
            raise DivtraceValueError(f"explain= names {name!r} twice")
        if probe is None:
            off.add(name)
        else:
            chosen[name] = probe
    for name, made in BY_DEFAULT.items():
        if name not in chosen and name not in off:
            chosen[name] = made()
    order = {kind: i for i, kind in enumerate(PROBES)}
    built_in = sorted((p for p in chosen.values() if type(p) in order),
                      key=lambda p: order[type(p)])
    others = [p for p in chosen.values() if type(p) not in order]
    probes = (Roles(), *built_in, *others)
    return tuple(probe for probe in probes if probe.check(model))
