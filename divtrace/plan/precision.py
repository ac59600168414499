"""The float32 precision in force, read and restored through whichever API the user set.

PyTorch has two ways to allow reduced precision for float32 maths: the legacy flags
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``,
``torch.set_float32_matmul_precision``) and, since 2.9, ``fp32_precision`` per backend
and op (``torch.backends.cuda.matmul.fp32_precision = "tf32"``). The legacy getters
raise ``RuntimeError`` once the two are mixed, so divtrace never reads them where the
new API exists: the new API's settings are the state (the legacy setters write it too),
read and restored exactly, parents first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["PRECISION_PATHS", "effective", "matmul_precision", "precision_state",
           "restored", "set_tf32"]

#: The places that hold an ``fp32_precision``, parents before their children.
PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn",
                   "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
#: Where each op's setting falls back to when it is ``"none"``.
_PARENT = {"cuda.matmul": "", "cudnn": "", "cudnn.conv": "cudnn", "cudnn.rnn": "cudnn",
           "mkldnn": "", "mkldnn.matmul": "mkldnn", "mkldnn.conv": "mkldnn",
           "mkldnn.rnn": "mkldnn"}
_LEGACY_PRECISION = {"ieee": "highest", "tf32": "high", "bf16": "medium"}


def _holder(path: str) -> Any:
    holder: Any = torch.backends
    for part in filter(None, path.split(".")):
        holder = getattr(holder, part, None)
        if holder is None:
            return None
    return holder


def precision_state() -> dict[str, str] | None:
    """Every ``fp32_precision`` setting as it is (None: this torch has no such API)."""
    state = {}
    for path in PRECISION_PATHS:
        holder = _holder(path)
        try:
            value = getattr(holder, "fp32_precision", None)
        except (AttributeError, RuntimeError):
            value = None
        if value is None:
            if path == "":
                return None
            continue
        state[path] = str(value)
    return state


def effective(path: str, state: dict[str, str] | None = None) -> str:
    """The precision an op (``cuda.matmul``, ``cudnn.conv``, ...) runs float32 at:
    ``"ieee"``, ``"tf32"`` or ``"bf16"``, its own setting or its parents'."""
    state = precision_state() if state is None else state
    if state is None:
        return _legacy(path)
    node: str | None = path
    while node is not None:
        value = state.get(node, "none")
        if value != "none":
            return value
        node = _PARENT.get(node) if node else None
    return "ieee"


def _legacy(path: str) -> str:
    """A torch without ``fp32_precision``: the legacy flags."""
    if path.startswith("cuda"):
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    if path.startswith("cudnn"):
        return "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"
    return "bf16" if torch.get_float32_matmul_precision() == "medium" else "ieee"


def matmul_precision() -> str:
    """``torch.get_float32_matmul_precision()``, or, where that getter would raise (the
    two APIs mixed), the name the new settings of matmuls amount to."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        state = precision_state()
        widest = max((effective(p, state) for p in ("cuda.matmul", "mkldnn.matmul")),
                     key=("ieee", "tf32", "bf16").index)
        return _LEGACY_PRECISION[widest]


def set_tf32(path: str, on: bool) -> None:
    """TF32 on or off for one op (``cuda.matmul``, ``cudnn.conv``, ``cudnn.rnn``), through
    the API in use: the legacy flag while its getter reads, else ``fp32_precision`` (so
    that code reading either API inside the run finds no mix of the two)."""
    legacy = (lambda: torch.backends.cuda.matmul.allow_tf32) if path == "cuda.matmul" else (
        lambda: torch.backends.cudnn.allow_tf32)
    holder = _holder(path)
    if precision_state() is None or holder is None or _read(legacy) is not None:
        if path == "cuda.matmul":
            torch.backends.cuda.matmul.allow_tf32 = on
        else:
            torch.backends.cudnn.allow_tf32 = on
    else:
        holder.fp32_precision = "tf32" if on else "ieee"


def _read(getter: Any) -> Any:
    try:
        return getter()
    except RuntimeError:  # the two APIs mixed: not readable this way
        return None


def _legacy_state() -> tuple[Any, Any, Any]:
    """The legacy flags, each None where its getter refuses (the two APIs mixed)."""
    return (_read(lambda: torch.backends.cuda.matmul.allow_tf32),
            _read(lambda: torch.backends.cudnn.allow_tf32),
            _read(torch.get_float32_matmul_precision))


def _apply(legacy: tuple[Any, Any, Any], state: dict[str, str] | None) -> None:
    matmul, cudnn, precision = legacy
    if matmul is not None:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    if cudnn is not None:
        torch.backends.cudnn.allow_tf32 = cudnn
    if precision is not None:  # after allow_tf32, which sets it to "high"
        torch.set_float32_matmul_precision(precision)
    for path, value in (state or {}).items():  # parents first: setting one resets
        _holder(path).fp32_precision = value  # its children


def _guesses(legacy: tuple[Any, Any, Any]) -> Iterator[tuple[Any, Any, Any]]:
    """The legacy flags as read, each unreadable one (its hidden value disagreeing with
    the new settings) tried at every value it can hold."""
    options = [(value,) if value is not None else choices for value, choices in
               zip(legacy, ((False, True), (False, True), ("highest", "high", "medium")),
                   strict=True)]
    for matmul in options[0]:
        for cudnn in options[1]:
            for precision in options[2]:
                yield matmul, cudnn, precision


@contextmanager
def restored() -> Iterator[None]:
    """Every precision setting comes back exactly as it was on exit: each
    ``fp32_precision`` and each legacy flag, also one whose getter refuses because the
    two APIs were mixed (the legacy flags hold values of their own: restored first, then
    the new settings, which the legacy setters write too)."""
    state, legacy = precision_state(), _legacy_state()
    try:
        yield
    finally:
        for guess in _guesses(legacy):
            _apply(guess, state)
            if _legacy_state() == legacy and precision_state() == state:
                break
