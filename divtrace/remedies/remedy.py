"""A remedy: a setting in force inside ``applied(model)``, everything restored after it.

A :class:`Remedy` is what :meth:`divtrace.Comparison.remedies` tries, and what a user
applies in production code::

    with remedy.applied(model):
        y = model(x)

Inside the block its flags are set and its hooks sit on the model; after it (also when
the block raises) the backend flags, the deterministic-algorithms setting, the default
dtype and the model's hooks are as they were before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.precision import restored
from divtrace.record.experts import Routers

__all__ = ["Custom", "Remedy", "Scoped", "Situation"]


@dataclass(frozen=True)
class Situation:
    """What a remedy may need to know of the comparison it is tried on.

    Attributes:
        batch_size: B, the rows of the whole batch.
        batch_dim: The batch dimension.
        on_cuda: Whether the model or its input lies on a CUDA device.
        cannot: What the kind of comparison cannot do, with the reason
            (:attr:`divtrace.Kind.cannot`: ``"padded"``, every pass padded to one batch
            size, ...).
        a_chunk: Run a's batch size (None: the whole batch).
        batch_only: The two runs differ in their batch size alone.
        reduced: The reduced-precision settings in force (empty: none).
        attention: The model's attention modules, by qualified name.
        head: The model's output head (its final norm and output embedding), by qualified
            name; empty: it has no output embedding.
        head_dtype: The dtype of the output embedding's weight (None: no head).
        compiled: The runs run code divtrace compiled (``compare_compiled``): on copies
            of the model, so hooks on the model are not in them.
        routers: The model's mixture-of-experts routers, by qualified name.
        router_dtype: The dtype of the first router's weight (None: no router).
        routing: How they were found: the routing probe's :class:`~divtrace.Routers`.
    """

    batch_size: int
    batch_dim: int
    on_cuda: bool
    cannot: Mapping[str, str]
    a_chunk: int | None
    batch_only: bool
    reduced: tuple[str, ...]
    attention: tuple[str, ...]
    head: tuple[str, ...] = ()
    head_dtype: str | None = None
    compiled: bool = False
    routers: tuple[str, ...] = ()
    router_dtype: str | None = None
    routing: Routers = field(default_factory=Routers)


class _Flags:
    """The global state a remedy may change, taken before and put back after."""

    def __init__(self) -> None:
        cudnn = torch.backends.cudnn
        self.cudnn = (cudnn.enabled, cudnn.deterministic, cudnn.benchmark)
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.dtype = torch.get_default_dtype()

    def restore(self) -> None:
        cudnn = torch.backends.cudnn
        cudnn.enabled, cudnn.deterministic, cudnn.benchmark = self.cudnn
        torch.use_deterministic_algorithms(self.deterministic[0],
                                           warn_only=self.deterministic[1])
        torch.set_default_dtype(self.dtype)


class Remedy:
    """A setting that may make the two runs agree; :meth:`applied` puts it in force.

    Subclass it for a remedy of one's own: set :attr:`kind` and override :meth:`enter`
    (add hooks or set flags; register how to undo them on ``stack``). Flags of
    ``torch.backends``, the deterministic-algorithms setting and the default dtype are
    restored by :meth:`applied` itself.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
        >>> with divtrace.remedies.CudnnOff().applied(net):
        ...     torch.backends.cudnn.enabled
        False
    """

    #: A short name: how ``candidates=`` names the remedy, and the table's ``kind``.
    kind: ClassVar[str] = "remedy"

    @property
    def name(self) -> str:
        """A readable name with the remedy's scope, e.g. ``cuDNN off in features.0``."""
        return self.kind

    @property
    def modules(self) -> tuple[str, ...] | None:
        """The modules it acts in (None: everywhere)."""
        return None

    def pads(self) -> int | None:
        """The batch size every call is padded to (None: calls keep their size)."""
        return None

    def unusable(self, situation: Situation) -> str | None:
        """Why the remedy cannot be tried on this comparison (None: it can)."""
        return None

    @property
    def reaches_copies(self) -> bool:
        """Whether it acts through global settings (backend flags, compiler settings)
        rather than hooks on the model: then it reaches runs of copies of the model too
        (``compare_compiled``'s)."""
        return False

    def own(self, module: str, op: str) -> bool:
        """Whether a site (its module, its op; ``""`` for a module's output) shows the
        remedy's own workings rather than the model's numbers, e.g. float64 values
        inside the modules it runs in float64: left out of its verification."""
        return False

    def caveat(self, situation: Situation) -> str:
        """What the remedy trades away or does not promise, for the table's ``note``."""
        return ""

    def widened(self, modules: Sequence[str]) -> Remedy | None:
        """The same remedy over more modules (None: it has no scope to widen)."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """The remedy as plain data, for saved files."""
        return {"kind": self.kind, "name": self.name}

    def replanned(self, plan: Any) -> Any:
        """The plan the remedy is verified and costed on (default: ``plan`` itself; a
        remedy for compiled code compiles the runs' copies otherwise)."""
        return plan

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        """Puts the remedy in force on ``model``; registers its undoing on ``stack``."""
        raise NotImplementedError(f"{type(self).__name__} must define enter(model, stack)")

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """A context inside which the remedy is in force on ``model``; on exit (also on an
        error) its hooks are removed and every flag it changed is put back."""
        if not isinstance(model, nn.Module):
            raise DivtraceTypeError(f"applied() takes the torch.nn.Module to remedy; got "
                                    f"{type(model).__name__}")
        flags = _Flags()
        try:
            with restored(), ExitStack() as stack:
                self.enter(model, stack)
                yield
        finally:
            flags.restore()

    def __repr__(self) -> str:
        return f"<divtrace remedy: {self.name}>"


def targets(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The modules of ``model`` that ``names`` name (``(model)``: the model itself)."""
    found = dict(model.named_modules())
    unknown = [n for n in names if n != ROOT and n not in found]
    if unknown:
        known = [n for n in found if n][:12]
        raise DivtraceValueError(
            f"the model has no module {unknown[0]!r} to remedy; give qualified names as "
            f"model.named_modules() lists them (e.g. {', '.join(known) or '(model)'})")
    return [model if n == ROOT else found[n] for n in names]


class Scoped(Remedy):
    """A remedy that acts inside some modules' forward passes, or everywhere.

    Args:
        modules: Qualified module names (as ``model.named_modules()`` lists them,
            ``"(model)"`` for the model itself); None: everywhere.
    """

    #: How the name reads: ``"{what} in ..."``.
    what: ClassVar[str] = "remedy"

    def __init__(self, modules: Sequence[str] | None = None) -> None:
        if isinstance(modules, str):
            modules = [modules]
        if modules is not None:
            bad = [m for m in modules if not isinstance(m, str)]
            if bad or not modules:
                raise DivtraceValueError(
                    f"{type(self).__name__}(modules=...) takes qualified module names, or "
                    f"None for everywhere; got {list(modules)!r}")
            modules = tuple(dict.fromkeys(modules))
        self._modules = modules

    @property
    def modules(self) -> tuple[str, ...] | None:
        return self._modules

    @property
    def name(self) -> str:
        if self._modules is None:
            return f"{self.what} everywhere"
        if self._modules == (ROOT,):
            return f"{self.what} in the whole model"
        shown = ", ".join(self._modules[:3])
        more = len(self._modules) - 3
        return f"{self.what} in {shown}" + (f" (+{more} more)" if more > 0 else "")

    def widened(self, modules: Sequence[str]) -> Remedy | None:
        if self._modules is None:
            return None
        every = list(dict.fromkeys([*self._modules, *modules]))
        if ROOT in every:
            return type(self)([ROOT])
        return type(self)([m for m in every  # those inside another are covered by it
                           if not any(m.startswith(o + ".") for o in every)])

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "modules": None if self._modules is None
                else list(self._modules)}


class Custom(Remedy):
    """A user's own remedy: a factory that takes the model and returns a context manager.

    Args:
        factory: ``factory(model)`` returns the context manager that puts the remedy in
            force (e.g. ``lambda m: torch.autocast("cuda", enabled=False)``).
        name: How tables name it (default: the factory's name).

    Example:
        >>> import contextlib, torch, divtrace
        >>> mine = divtrace.remedies.Custom(lambda model: contextlib.nullcontext(), "nothing")
        >>> mine.name
        'nothing'
    """

    kind = "custom"

    def __init__(self, factory: Callable[[nn.Module], AbstractContextManager[Any]],
                 name: str | None = None) -> None:
        if not callable(factory):
            raise DivtraceTypeError(f"Custom(factory) takes a callable model -> context "
                                    f"manager; got {type(factory).__name__}")
        self.factory = factory
        self._name: str = name or str(getattr(factory, "__name__", "custom remedy"))

    @property
    def name(self) -> str:
        return self._name

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        made = self.factory(model)
        if not hasattr(made, "__enter__") or not hasattr(made, "__exit__"):
            raise DivtraceTypeError(
                f"the remedy {self._name!r} returned {type(made).__name__}, not a context "
                f"manager; its factory must return one (e.g. made with "
                f"contextlib.contextmanager)")
        stack.enter_context(made)
