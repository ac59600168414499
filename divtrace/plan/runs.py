"""Run configurations: what one of the two compared runs does differently.

A :class:`Run` names a batch size (``chunk``), a device, a dtype, backend flags, a memory
format and ``torch.compile``. Flags are set only while that run's passes execute and are
always restored; the user's model is never changed (a run that needs another device,
dtype or memory format works on a copy).
"""

from __future__ import annotations

import collections
import copy
import itertools
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.checks import fields_checked
from divtrace.plan.precision import (
    effective,
    matmul_precision,
    precision_state,
    restored,
    set_tf32,
)

__all__ = ["Resources", "Run", "backend_flags", "eager_experts", "made_as", "split_run"]

_PRECISIONS = ("highest", "high", "medium")


def eager_experts(model: nn.Module) -> list[Callable[[], object]]:
    """Runs ``model``'s mixture-of-experts layers eagerly where they run on
    ``grouped_mm``, which takes no float64 (``transformers``' experts implementations;
    in float64 the implementation changes nothing but the order of exact-enough sums).
    Returns what puts each one back."""
    back: list[Callable[[], object]] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        switch: Any = getattr(module, "set_experts_implementation", None)
        if getattr(config, "_experts_implementation", None) == "grouped_mm" and callable(
                switch):
            switch("eager")
            back.append(partial(switch, "grouped_mm"))
    return back


def backend_flags() -> dict[str, Any]:
    """The numerics-relevant backend flags in force now, read through whichever API set
    them (:mod:`divtrace.plan.precision`)."""
    cudnn = torch.backends.cudnn
    state = precision_state()
    return {"cudnn": cudnn.enabled, "deterministic": cudnn.deterministic,
            "benchmark": cudnn.benchmark,
            "tf32_matmul": effective("cuda.matmul", state) == "tf32",
            "tf32_cudnn": effective("cudnn.conv", state) == "tf32",
            "matmul_precision": matmul_precision(),
            "bf16_matmul_cpu": effective("mkldnn.matmul", state) == "bf16"}


@fields_checked
@dataclass(frozen=True)
class Run:
    """One configuration of a forward pass; ``None`` leaves a setting as it is.

    Args:
        chunk: Batch size of the passes (``None``: the whole batch in one pass).
        device: Device to run on (a copy of the model is moved there).
        dtype: Floating dtype of the model's parameters and of floating inputs.
        cudnn: ``torch.backends.cudnn.enabled``.
        deterministic: ``torch.backends.cudnn.deterministic``.
        benchmark: ``torch.backends.cudnn.benchmark``.
        tf32_matmul: ``torch.backends.cuda.matmul.allow_tf32``.
        tf32_cudnn: ``torch.backends.cudnn.allow_tf32``.
        matmul_precision: ``torch.set_float32_matmul_precision`` (highest, high, medium).
        channels_last: Model and 4-D inputs in ``torch.channels_last``.
        compile: ``torch.compile`` the (copied) model: ``True`` for the default backend or
            a backend name. Only the model's output is compared then.
        name: A label for tables and plots (default: made from the settings).

    Example:
        >>> from divtrace import Run
        >>> Run(tf32_matmul=True).label()
        'tf32_matmul=True'
    """

    chunk: int | None = None
    device: str | torch.device | None = None
    dtype: torch.dtype | None = None
    cudnn: bool | None = None
    deterministic: bool | None = None
    benchmark: bool | None = None
    tf32_matmul: bool | None = None
    tf32_cudnn: bool | None = None
    matmul_precision: str | None = None
    channels_last: bool = False
    compile: bool | str = False
    name: str | None = None

    def __post_init__(self) -> None:
        if self.chunk is not None:
            try:  # NumPy and integer tensors too
                chunk = None if isinstance(self.chunk, bool) else operator.index(self.chunk)
            except TypeError:
                chunk = None
            if chunk is None:
                raise DivtraceTypeError(f"Run(chunk=...) must be None or a whole number >= 1;"
                                        f" got {self.chunk!r}")
            if chunk < 1:
                raise DivtraceValueError(f"Run(chunk=...) must be None or a whole number >= 1;"
                                         f" got {self.chunk!r}")
            object.__setattr__(self, "chunk", chunk)
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype)
                                       or not self.dtype.is_floating_point):
            raise DivtraceTypeError(f"Run(dtype=...) must be a floating torch.dtype; "
                                    f"got {self.dtype!r}")
        if self.matmul_precision not in (None, *_PRECISIONS):
            raise DivtraceValueError(f"Run(matmul_precision=...) must be one of "
                                     f"{', '.join(_PRECISIONS)}; got {self.matmul_precision!r}")
        if self.device is not None:
            torch.device(self.device)  # raises on a malformed name

    def label(self) -> str:
        """The run's name, or its non-default settings."""
        if self.name:
            return self.name
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "name" or value == f.default:
                continue
            shown = str(value).removeprefix("torch.") if f.name == "dtype" else value
            parts.append(f"{f.name}={shown}")
        return ", ".join(parts) or "as is"

    @property
    def changes_model(self) -> bool:
        """Whether this run needs its own copy of the model."""
        return (self.device is not None or self.dtype is not None or self.channels_last
                or bool(self.compile))

    def same_copy(self, other: Run) -> bool:
        """Whether ``other`` runs the same copy of the model as this run: the same device,
        dtype, memory format and compilation (its name, chunks and flags may differ);
        a run of another kind (a :class:`~divtrace.plan.compiled.Compiled` run) says."""
        if type(other).same_copy is not Run.same_copy:
            return other.same_copy(self)
        return ((self.device, self.dtype, self.channels_last, self.compile)
                == (other.device, other.dtype, other.channels_last, other.compile))

    @property
    def changes_inputs(self) -> bool:
        """Whether this run feeds the inputs moved, cast or reformatted."""
        return self.device is not None or self.dtype is not None or self.channels_last

    def model(self, model: nn.Module) -> nn.Module:
        """The model this run uses: the user's own, or a changed copy."""
        if not self.changes_model:
            return model
        mine = copy.deepcopy(model, made_as(model, self.device, self.dtype))
        if self.device is not None:
            mine = mine.to(torch.device(self.device))
        if self.dtype is not None:
            mine = mine.to(self.dtype)
            if self.dtype == torch.float64:
                eager_experts(mine)  # a copy: nothing to put back
        if self.channels_last:
            mine = mine.to(memory_format=torch.channels_last)
        if self.compile:
            backend = self.compile if isinstance(self.compile, str) else "inductor"
            mine = torch.compile(mine, backend=backend)  # type: ignore[assignment]
        return mine

    def renamed(self, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """The observed modules under the names their sites take (their own)."""
        return modules

    @property
    def other_model(self) -> nn.Module | None:
        """The model this run runs instead of the compared one (``compare_models``)."""
        return None

    def tensor(self, value: Any) -> Any:
        """One input leaf as this run feeds it (moved, cast, reformatted)."""
        if not isinstance(value, torch.Tensor):
            return value
        if self.device is not None:
            value = value.to(torch.device(self.device))
        if self.dtype is not None and value.is_floating_point():
            value = value.to(self.dtype)
        if self.channels_last and value.dim() == 4:
            value = value.contiguous(memory_format=torch.channels_last)
        return value

    @contextmanager
    def flags(self) -> Iterator[None]:
        """Sets this run's backend flags; restores every one of them on exit."""
        cudnn = torch.backends.cudnn
        saved = (cudnn.enabled, cudnn.deterministic, cudnn.benchmark)
        try:
            with restored():
                if self.cudnn is not None:
                    cudnn.enabled = self.cudnn
                if self.deterministic is not None:
                    cudnn.deterministic = self.deterministic
                if self.benchmark is not None:
                    cudnn.benchmark = self.benchmark
                if self.matmul_precision is not None:
                    torch.set_float32_matmul_precision(self.matmul_precision)
                if self.tf32_matmul is not None:
                    set_tf32("cuda.matmul", self.tf32_matmul)
                if self.tf32_cudnn is not None:
                    for op in ("cudnn.conv", "cudnn.rnn"):
                        set_tf32(op, self.tf32_cudnn)
                yield
        finally:
            cudnn.enabled, cudnn.deterministic, cudnn.benchmark = saved


@fields_checked
@dataclass(frozen=True)
class Resources:
    """How a comparison spends memory and time; none of it changes a figure.

    Args:
        keep: Also keep run b's compared rows, for :meth:`Comparison.pair`.
        offload: Keep run a's rows in pinned CPU memory instead of on the device.
        graphs: On CUDA, capture up to 4 of run a's passes side by side as one CUDA graph
            (each on a stream of its own, the recording copies inside; one pass when
            more do not fit in memory), check every one bit for bit against the eager
            first pass, and replay the graph for the other chunks, 4 at a time.
            ``"auto"``: where it can be used and there are at least 8 passes to replay
            (else eager; a failed capture or check is a warning); ``True``: always, or
            an error; ``False``: eager. ``Comparison.meta.graphed`` says how each chunked
            run went.

    Example:
        >>> from divtrace import Resources
        >>> Resources(keep=True)
        Resources(keep=True, offload=False, graphs='auto')
    """

    keep: bool = False
    offload: bool = False
    graphs: bool | str = "auto"

    def __post_init__(self) -> None:
        for name in ("keep", "offload"):
            if not isinstance(getattr(self, name), bool):
                raise DivtraceTypeError(
                    f"Resources({name}=...) must be True or False; got {getattr(self, name)!r}")


def split_run(a: Run | None, chunk: Any) -> Run | None:
    """Run a with ``chunk=``, the one spelling of its batch size in every face (``compare``,
    ``sweep``, ``compare_backward``, ``compare_generate``, the command line's ``--chunk``):
    ``chunk`` None leaves ``a`` as given; else run a takes passes of ``chunk`` rows, with
    ``a``'s other settings. A chunk given twice, and differently, is refused."""
    if chunk is None:
        return a
    if a is None:
        return Run(chunk=chunk)
    if not isinstance(a, Run):
        return a  # make_plan says what a must be
    if a.chunk is not None and a.chunk != chunk:
        raise DivtraceValueError(
            f"chunk={chunk!r} and a=Run(chunk={a.chunk!r}) give run a two batch sizes; give "
            f"one (chunk= alone, or a=Run(chunk=...) alone)")
    return replace(a, chunk=chunk)


def made_as(model: nn.Module, device: torch.device | str | None, dtype: torch.dtype | None
            ) -> dict[int, Any]:
    """A memo for ``copy.deepcopy(model, memo)``: each floating parameter and buffer of
    ``model`` (plain tensors and ``nn.Parameter`` only) made straight away on ``device`` in
    ``dtype``, as ``Module.to`` would make it, so that the copy never holds the weights as
    they first were (one copy of them instead of two, and none of the first's memory);
    and each module's empty containers made afresh (:func:`_fresh_containers`). Whatever
    it leaves out is copied as ``deepcopy`` copies it, and cast by ``to``."""
    memo: dict[int, Any] = {}
    if device is None and dtype is None:
        return _fresh_containers(model, memo)
    target = None if device is None else torch.device(device)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        parameter = type(tensor) is nn.Parameter
        if id(tensor) in memo or not tensor.is_floating_point() or not (
                parameter or (type(tensor) is torch.Tensor and not tensor.requires_grad
                              and not tensor.__dict__)):
            continue
        with torch.no_grad():  # (as a detached tensor would give it, in one op)
            made = tensor.to(device=target, dtype=dtype)
        if made.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            continue  # already so: deepcopy copies it
        memo[id(tensor)] = nn.Parameter(made, tensor.requires_grad) if parameter else made
    return _fresh_containers(model, memo)


#: Containers whose empty instances ``deepcopy`` makes as a new empty one of the type.
_CONTAINERS = frozenset({dict, list, set, collections.OrderedDict})


def _fresh_containers(model: nn.Module, memo: dict[int, Any]) -> dict[int, Any]:
    """``memo`` with a new empty container for each empty ``dict``, ``OrderedDict``,
    ``list`` and ``set`` among the attributes of ``model``'s modules (a dozen hook
    dictionaries each): what ``deepcopy`` makes of them, without its dispatch and
    reconstruction per container (about 40% of copying mobilenet_v3_small's 209 modules).
    One container held twice stays one; the copy shares none of them with ``model``."""
    for module in model.modules():
        for value in module.__dict__.values():
            if type(value) in _CONTAINERS and not value and id(value) not in memo and (
                    not getattr(value, "__dict__", None)):
                memo[id(value)] = type(value)()
    return memo
