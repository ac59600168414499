"""A run of the model compiled region by region (:class:`Compiled`): a copy whose blocks
(a transformer's layers, a ResNet's stages) each run ``torch.compile``'d code, the code
between them eager, so that every block's output is a site outside compiled code."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.compat import is_compiled, own_code, recompile_limit
from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.checks import fields_checked
from divtrace.plan.runs import Run

__all__ = ["Compiled", "checked_regions", "inside", "plain", "regions_of", "wrapped"]


def wrapped(model: nn.Module) -> list[str]:
    """The modules of ``model`` that ``torch.compile`` wrapped (``OptimizedModule``), by
    their names once unwrapped (``""``: the model itself)."""
    found = []

    def walk(module: nn.Module, name: str) -> None:
        if is_compiled(module):
            found.append(name)
            module = module._orig_mod  # type: ignore[assignment]
        for child, sub in module.named_children():
            walk(sub, f"{name}.{child}" if name else child)
    walk(model, "")
    return found


def plain(model: nn.Module) -> nn.Module:
    """``model`` without the wrappers ``torch.compile`` put around it or its children:
    ``model`` itself when it has none (or only the outer one), else a copy."""
    while is_compiled(model):
        model = model._orig_mod  # type: ignore[assignment]
    if not wrapped(model):
        return model
    mine = copy.deepcopy(model)
    _unwrap(mine)
    return mine


def _unwrap(module: nn.Module) -> None:
    for child, sub in list(module.named_children()):
        while is_compiled(sub):
            sub = sub._orig_mod  # type: ignore[assignment]
            setattr(module, child, sub)
        _unwrap(sub)


def inside(name: str, regions: Sequence[str]) -> bool:
    """Whether the module ``name`` lies inside one of ``regions`` (not a region itself)."""
    return any(r == ROOT or name.startswith(r + ".") for r in regions if r != name)


def regions_of(model: nn.Module) -> tuple[str, ...]:
    """The blocks compiled as regions by default: the entries of each outermost
    ``nn.ModuleList`` (a transformer's layers); in a model without one, its children that
    hold modules of their own (a ResNet's stages)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not inside(name, found) and name not in (
                found):
            found += [f"{name}.{index}" if name else str(index) for index in range(len(module))]
    if not found:
        found = [name for name, child in model.named_children()
                 if next(child.children(), None) is not None]
    return tuple(found)


@fields_checked
@dataclass(frozen=True, eq=False)
class Compiled(Run):
    """A run of a copy of the model whose ``regions`` run compiled code.

    Each region's ``forward`` is replaced, on the copy, by ``torch.compile`` of its class's
    ``forward`` (one compiled function per class, so every decoder layer shares its code and
    its cache), called with the region: the region's module hooks stay outside the
    compiled code, and its output is a site. No regions: an eager copy (``torch.compile``'s
    wrappers taken off). A Hugging Face model's copy runs without a KV cache
    (``config.use_cache = False``): a cache handed to each layer, a new object at every
    call, would recompile the layer at every call.

    Args:
        regions: Qualified names of the modules compiled, each on its own.
        dynamic: ``torch.compile(dynamic=...)``: False (the default here) compiles each
            batch shape on its own, as a static compile does; True, one kernel for all.
        backend: ``torch.compile(backend=...)``.
        options: ``torch.compile(options=...)``, as pairs (inductor settings).
    """

    regions: tuple[str, ...] = ()
    dynamic: bool | None = False
    backend: str = "inductor"
    options: tuple[tuple[str, Any], ...] = ()
    #: the copy of the model as given, by the model's id: shared by the runs made alike
    copies: dict[int, nn.Module] = field(default_factory=dict, repr=False)
    #: the compilations one comparison's passes ask for: dynamo's recompile limit is at
    #: least this during each pass
    shapes: int = 0
    #: the code objects of divtrace's own that the copies compile (one per region class
    #: and copy): no cache of the user's functions is filled or read
    codes: list[CodeType] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.regions, str) or not all(isinstance(r, str) for r in self.regions):
            raise DivtraceTypeError(
                f"Compiled(regions=...) takes qualified module names; got {self.regions!r}")
        object.__setattr__(self, "regions", tuple(self.regions))
        if self.compile:
            raise DivtraceValueError(
                "a run compiled region by region takes no compile=; give regions=[...]")

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    @property
    def changes_model(self) -> bool:
        return True

    @contextmanager
    def flags(self) -> Iterator[None]:
        with super().flags(), recompile_limit(self.shapes):
            yield

    def same_copy(self, other: Run) -> bool:
        return (isinstance(other, Compiled) and other.copies is self.copies
                and self._settings() == other._settings())

    def _settings(self) -> tuple[Any, ...]:
        return (self.regions, self.dynamic, self.backend, self.options, self.device,
                self.dtype, self.channels_last)

    def label(self) -> str:
        if self.name:
            return self.name
        if not self.regions:
            return "eager"
        return (f"compiled, {len(self.regions)} region{'s' * (len(self.regions) > 1)}"
                f"{', dynamic' if self.dynamic else ''}")

    def model(self, model: nn.Module) -> nn.Module:
        """The copy of ``model`` this run runs (made once per model as given: both runs of
        a comparison share it; a float64 one, the precision test's, is made anew)."""
        kept = self.dtype is None and self.device is None and not self.channels_last
        if kept and id(model) in self.copies:
            return self.copies[id(model)]
        settings = Run(device=self.device, dtype=self.dtype, channels_last=self.channels_last)
        base = plain(model)
        mine = settings.model(base) if settings.changes_model else copy.deepcopy(base)
        config = getattr(mine, "config", None)
        if config is not None and getattr(config, "use_cache", False):  # a cache handed to
            config.use_cache = False  # each layer, new at every call, recompiles the layer
        _compile(mine, self.regions, self.dynamic, self.backend, dict(self.options),
                 self.codes)
        if kept:
            self.copies[id(model)] = mine
        return mine


def checked_regions(model: nn.Module, regions: Sequence[str]) -> dict[str, nn.Module]:
    """``model``'s modules by name, once every one of ``regions`` is among them (else an
    error naming the fix)."""
    found = dict(model.named_modules())
    unknown = [r for r in regions if r not in found]
    if unknown:
        known = [n for n in found if n][:8]
        raise DivtraceValueError(
            f"the model has no module {unknown[0]!r} to compile as a region; give qualified "
            f"names as model.named_modules() lists them (e.g. {', '.join(known)})")
    return found


def _compile(model: nn.Module, regions: Sequence[str], dynamic: bool | None, backend: str,
             options: dict[str, Any], codes: list[CodeType]) -> None:
    """Each region's ``forward`` on ``model`` compiled: one compiled function per class, of
    a copy of the class's ``forward`` whose code object is this copy's own (``codes``)."""
    found = checked_regions(model, regions)
    made: dict[type, Any] = {}
    for name in regions:
        module = found[name]
        kind = type(module)
        if kind not in made:
            mine = own_code(kind.forward)
            codes.append(mine.__code__)
            made[kind] = torch.compile(mine, dynamic=dynamic, backend=backend,
                                       options=options or None)
        module.forward = functools.partial(made[kind], module)  # hooks stay outside
