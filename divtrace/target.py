"""What the command line runs: the ``(model, x)`` a target function returns, moved and cast
as ``--device`` and ``--dtype`` ask, and the errors that give its exit codes."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from divtrace.compat import pytree

__all__ = ["DTYPES", "Raised", "UsageError", "called", "checked_device", "load", "named_kind",
           "placed", "training"]


class UsageError(Exception):
    """Something the user gave cannot be used: exit code 2, with the message."""


class Raised(Exception):
    """The target's function or the model raised: exit code 3, after its traceback."""


def called(spec: str) -> Any:
    """What ``path/to/file.py:function`` or ``package.module:function`` returns."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError(f"TARGET must be path/to/file.py:function or package.module:function;"
                         f" got {spec!r}")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.is_file():
                raise UsageError(f"no such file: {path}")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or loader.loader is None:
                raise UsageError(f"cannot load {path} as Python")
            module = importlib.util.module_from_spec(loader)
            sys.path.insert(0, str(path.resolve().parent))
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise UsageError(f"cannot import {where}: {exc}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"{where} has no function {name!r}")
    try:
        return function()
    except Exception as exc:
        raise Raised(f"{spec} raised {type(exc).__name__}: {exc}") from exc


def load(spec: str) -> tuple[torch.nn.Module, Any]:
    """Calls ``path/to/file.py:function`` or ``package.module:function`` for ``(model, x)``."""
    made = called(spec)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise UsageError(f"{spec} must return (model, x); got {type(made).__name__}")
    return made[0], made[1]


def named_kind(spec: str | None) -> Any:
    """The kind ``--kind`` names: what ``path/to/file.py:Name`` gives when called (a
    :class:`divtrace.Kind` class, or a function that returns one; None: none named)."""
    if spec is None:
        return None
    from divtrace.kinds.kind import Kind

    made = called(spec)
    if not isinstance(made, Kind):
        raise UsageError(f"--kind {spec} must give a divtrace.Kind; got {type(made).__name__}")
    return made


def training(spec: str) -> tuple[torch.nn.Module, Any, Any, Any]:
    """``(model, batch, loss, weight)`` from a function that returns ``(model, batch,
    loss)`` or ``(model, batch, loss, weight)``."""
    made = called(spec)
    if not (isinstance(made, tuple) and len(made) in (3, 4)
            and isinstance(made[0], torch.nn.Module) and callable(made[2])):
        raise UsageError(f"{spec} must return (model, batch, loss) or (model, batch, loss, "
                         f"weight), loss(model, part) a callable; got "
                         f"{type(made).__name__}")
    return made[0], made[1], made[2], made[3] if len(made) == 4 else None


#: How ``--dtype`` may name the floating dtypes (torch's names, and the usual short ones).
DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float64": torch.float64, "double": torch.float64, "fp64": torch.float64}


def checked_device(name: str) -> torch.device:
    """``--device``, checked: a malformed name, or a device this machine does not have,
    is a usage error."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, "
                         f"mps, ...): {exc}") from exc
    if device.type == "cuda" and (not torch.cuda.is_available() or (
            device.index is not None and device.index >= torch.cuda.device_count())):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise UsageError(f"--device {name}: this machine has {found} CUDA device"
                         f"{'' if found == 1 else 's'} (torch.cuda.is_available() is "
                         f"{torch.cuda.is_available()}); leave --device out to run where "
                         f"the target put the model")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available on this machine")
    return device


def placed(model: torch.nn.Module, x: Any, device: str | None, dtype: str | None
            ) -> tuple[torch.nn.Module, Any]:
    """The model and input moved to ``device`` and floating tensors cast to ``dtype``."""
    if device is None and dtype is None:
        return model, x
    cast = None
    if dtype is not None:
        cast = DTYPES.get(dtype.removeprefix("torch."))
        if cast is None:
            raise UsageError(f"--dtype must name a floating dtype ({', '.join(DTYPES)}); "
                             f"got {dtype!r}")
    where = checked_device(device) if device is not None else None

    def move(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to(where) if where is not None else value
        return value.to(cast) if cast is not None and value.is_floating_point() else value

    model = model.to(where) if where is not None else model
    model = model.to(cast) if cast is not None else model
    return model, pytree.tree_map(move, x)
