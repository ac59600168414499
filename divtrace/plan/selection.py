"""Which modules are observed, and which ones would make the runs differ by design."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.compat import BATCH_NORM, DROPOUT, is_compiled
from divtrace.errors import BatchMixingError, DivtraceTypeError, DivtraceValueError
from divtrace.plan.walk import holders

__all__ = ["ModuleSpec", "check_modules", "mixing_modules", "refuse_mixing", "select_modules"]

#: What ``modules=`` takes: glob patterns on qualified names and/or module types.
ModuleSpec = str | type | Iterable[str | type] | None

_MIXING = (BATCH_NORM, DROPOUT)


def _describe(spec: object) -> str:
    return spec.__name__ if isinstance(spec, type) else repr(spec)


def check_modules(model: nn.Module, modules: ModuleSpec,
                  walked: Sequence[tuple[str, nn.Module]] | None = None
                  ) -> tuple[str | type, ...] | None:
    """Validates ``modules=`` against ``model``: every entry must match some module.
    ``walked``: the model's ``named_modules()``, when already listed."""
    if modules is None:
        return None
    if not isinstance(modules, str | type | Iterable):
        raise DivtraceTypeError(
            f"modules must be glob patterns (str) or module types, or a list of them; got "
            f"{modules!r} ({type(modules).__name__})")
    specs = (modules,) if isinstance(modules, str | type) else tuple(modules)
    for spec in specs:
        if not isinstance(spec, str | type):
            raise DivtraceTypeError(
                f"modules must hold glob patterns (str) or module types; got {spec!r}"
            )
    named = [(name, mod) for name, mod in walked or model.named_modules() if name]
    for spec in specs:
        if not _matching(named, spec):
            names = [name for name, _ in named]
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            types = sorted({type(mod).__name__ for _, mod in named})
            raise DivtraceValueError(
                f"modules entry {_describe(spec)} matches no module of the model. "
                f"Names: {shown or '(none)'}; types: {', '.join(types) or '(none)'}"
            )
    return specs


def _matching(named: list[tuple[str, nn.Module]], spec: str | type
              ) -> list[tuple[str, nn.Module]]:
    return [(name, mod) for name, mod in named
            if (isinstance(spec, str) and fnmatch.fnmatchcase(name, spec))
            or (isinstance(spec, type) and isinstance(mod, spec))]


def select_modules(model: nn.Module, modules: ModuleSpec,
                   walked: Sequence[tuple[str, nn.Module]] | None = None
                   ) -> dict[str, nn.Module]:
    """The modules to observe, by qualified name, in registration order.

    ``modules`` holds glob patterns matched against qualified names (``features.*``) and
    module types (``nn.Conv2d``); ``None`` selects every module. The model itself is
    always observed, under the name :data:`~divtrace.align.sites.ROOT`, so that its final
    output is compared. ``walked``: the model's ``named_modules()``, when already listed.
    """
    named = [(name, mod) for name, mod in walked or model.named_modules()]
    hidden = unobservable(named)
    named = [(name, mod) for name, mod in named  # a TorchScript module's own output counts
             if name and not any(name.startswith(s + ".") or (
                 name == s and kind != "TorchScript") for s, kind in hidden.items())]
    specs = check_modules(model, modules, walked)
    if specs is None:
        return {ROOT: model} | dict(named)
    chosen = {name for spec in specs for name, _ in _matching(named, spec)}
    return {ROOT: model} | {name: mod for name, mod in named if name in chosen}


def _hooks_fire(module: nn.Module) -> bool:
    """Whether ``module`` takes forward hooks (a traced module does, a scripted one does
    not); the hook tried is removed at once."""
    try:
        module.register_forward_hook(lambda *_: None).remove()
    except RuntimeError:
        return False
    return True


def unobservable(named: Iterable[tuple[str, nn.Module]]) -> dict[str, str]:
    """The outermost modules among ``named`` that cannot be observed inside, and why: a
    TorchScript module's children run inside TorchScript, where no hook fires (a traced
    module's own forward hooks do: its output is compared; a scripted one takes none); what
    ``torch.compile`` wraps (``<name>._orig_mod``) runs as compiled code, which hooks
    would make it recompile (and a graph compiled before would skip them)."""
    found: dict[str, str] = {}
    for name, module in named:
        if any(name.startswith(s + ".") or not s for s in found):
            continue
        for held in holders(module):  # parameters, not layers: no site of their own
            found[f"{name}.{held}" if name else held] = "parameters"
        if isinstance(module, torch.jit.ScriptModule):
            found[name] = "TorchScript" if _hooks_fire(module) else "scripted"
        elif is_compiled(module):
            found[f"{name}._orig_mod" if name else "_orig_mod"] = "torch.compile"
    return found


def mixing_modules(named: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Modules that, in train mode, mix samples (BatchNorm) or draw random numbers (Dropout),
    among ``named`` (a model's ``named_modules()``)."""
    found = []
    for name, module in named:
        if not module.training or not isinstance(module, _MIXING):
            continue
        if isinstance(module, DROPOUT) and getattr(module, "p", None) == 0:
            continue
        found.append(f"{name or 'the model'} ({type(module).__name__})")
    return found


def refuse_mixing(named: Iterable[tuple[str, nn.Module]], allow_train: bool, *,
                  who: str = "the model",
                  apart: str = "batched and split runs would differ",
                  fix: str = "Call model.eval() first") -> tuple[str, ...]:
    """The modules among ``named`` that mix samples or draw random numbers in train mode;
    refused (naming them, what would differ and the fix) unless ``allow_train``."""
    mixing = mixing_modules(named)
    if mixing and not allow_train:
        raise BatchMixingError(
            f"{who} is in train mode and these modules mix samples or draw random numbers "
            f"there: {', '.join(mixing)}; {apart} for reasons that are not numerical. "
            f"{fix}, or pass allow_train=True to compare anyway")
    return tuple(mixing)
