"""A run of another model: run b of a two-model comparison (``compare_models``), the
other model's modules named as the first model's (``names``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.runs import Run

__all__ = ["OtherModel", "renamed"]


def renamed(name: str, names: Mapping[str, str]) -> str:
    """``name`` with its longest prefix in ``names`` (a module path, or ``""`` for every
    name) replaced: ``{"decoder": "model"}`` makes ``decoder.layers.0`` ``model.layers.0``."""
    best = max((p for p in names if p == "" or name == p or name.startswith(p + ".")),
               key=len, default=None)
    if best is None:
        return name
    rest = name[len(best):].lstrip(".") if best else name
    target = names[best]
    return ".".join(part for part in (target, rest) if part)


@dataclass(frozen=True, eq=False)
class OtherModel(Run):
    """Run b on ``other`` (the user's own, as given) instead of run a's model.

    Args:
        other: The model run b runs.
        names: ``{prefix in other: prefix in run a's model}``: other's modules named as
            run a's, so that their sites align.
    """

    other: nn.Module | None = field(default=None, repr=False)
    names: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.other, nn.Module):
            raise DivtraceTypeError(f"the other model must be a torch.nn.Module; got "
                                    f"{type(self.other).__name__}")
        if self.changes_model:
            raise DivtraceValueError("a run of another model takes that model as it is "
                                     "(no device, dtype, memory format or compile)")

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def label(self) -> str:
        """The run's name, else the other model's type."""
        return self.name or f"{type(self.other).__name__}, another model"

    def model(self, model: nn.Module) -> nn.Module:
        """The other model, as it is (never a copy)."""
        assert self.other is not None
        return self.other

    @property
    def other_model(self) -> nn.Module | None:
        """The other model."""
        return self.other

    def renamed(self, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """The observed modules under run a's names."""
        names = dict(self.names)
        return {renamed(name, names) if name != "(model)" else name: module
                for name, module in modules.items()}


def names_checked(names: Any) -> tuple[tuple[str, str], ...]:
    """``names=`` as pairs, validated."""
    if names is None:
        return ()
    if not isinstance(names, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise DivtraceTypeError(
            f"names must be a dict {{prefix in b: prefix in a}} of module names (e.g. "
            f"{{'decoder': 'model'}}); got {names!r}")
    return tuple(names.items())
