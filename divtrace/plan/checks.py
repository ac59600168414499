"""Small validators for ``compare()``'s scalar and pattern arguments."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any, TypeVar

from divtrace.errors import DivtraceTypeError, DivtraceValueError

__all__ = ["GraphMode", "check_graphs", "fields_checked", "patterns", "tolerance", "unexpected",
           "whole_number"]


def whole_number(value: Any, name: str, minimum: int | None = None) -> int:
    """``value`` as an int (NumPy and other integer types welcome; bools and floats not)."""
    if isinstance(value, bool):
        raise DivtraceTypeError(f"{name} must be a whole number; got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise DivtraceTypeError(
            f"{name} must be a whole number; got {value!r} ({type(value).__name__})") from None
    if minimum is not None and number < minimum:
        raise DivtraceValueError(f"{name} must be at least {minimum}; got {number}")
    return number


def tolerance(value: Any, name: str) -> float | None:
    """A tolerance: None (the dtype's default) or a finite number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__float__"):  # str has no __float__
        raise DivtraceTypeError(f"{name} must be a number or None; got {value!r} "
                                f"({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise DivtraceValueError(f"{name} must be a finite number >= 0; got {value!r}")
    return number


def patterns(value: Any, name: str) -> tuple[str, ...]:
    """Glob patterns: one string, or an iterable of strings."""
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        raise DivtraceTypeError(f"{name} must be a glob pattern or a list of them; got "
                                f"{value!r} ({type(value).__name__})")
    found = tuple(value)
    bad = [v for v in found if not isinstance(v, str)]
    if bad:
        raise DivtraceTypeError(f"{name} must hold glob patterns (str); got {bad[0]!r}")
    return found


#: ``compare(graphs=...)``: ``"auto"`` (graphs where they can be used and pay), True
#: (graphs, or an error saying why not), False (the eager split run).
GraphMode = bool | str


def check_graphs(graphs: Any) -> GraphMode:
    """The validated ``graphs=`` option."""
    if graphs not in (False, True, "auto") or not isinstance(graphs, bool | str):
        raise DivtraceValueError(
            f"graphs must be 'auto' (replay the split run from a CUDA graph where it can be "
            f"used), True (always, or an error) or False (the eager split run); got "
            f"{graphs!r}")
    return graphs


#: Keywords people reach for that ``compare()`` takes another way, and that way.
_ELSEWHERE = {
    "chunks": "chunk=...", "chunk_size": "chunk=...", "batch_size": "chunk=...",
    "reference": "a=divtrace.Run(...)", "device": "a=/b=divtrace.Run(device=...)",
    "dtype": "a=/b=divtrace.Run(dtype=...)", "local": 'explain=["local"]',
    "truth": 'explain=["fp64"]', "fp64": 'explain=["fp64"]',
    "repeat": "explain=[divtrace.Repeat(n)]", "kernels": 'explain=["kernels"]',
    "observer": 'explain=["observer"]', "independence": 'explain=["-independence"] (off)',
    "replay_skip": "explain=[divtrace.Local(skip=[...])]",
    "keep": "resources=divtrace.Resources(keep=True)",
    "offload": "resources=divtrace.Resources(offload=True)",
    "graphs": "resources=divtrace.Resources(graphs=...)",
}


def unexpected(function: str, given: Iterable[str], known: Iterable[str],
               elsewhere: bool = True) -> DivtraceTypeError:
    """The error for keywords ``function`` does not take: each with the way it is given
    there (``elsewhere``: the keywords of ``compare()`` that moved), or the closest known
    name."""
    import difflib

    names = list(known)
    said = []
    for name in given:
        if elsewhere and name in _ELSEWHERE:
            said.append(f"{name}= is given as {_ELSEWHERE[name]}")
            continue
        close = difflib.get_close_matches(name, names, n=1)
        said.append(f"{name}= is not one" + (f" (did you mean {close[0]}=?)" if close else ""))
    return DivtraceTypeError(
        f"{function}() got unexpected keyword argument(s): {'; '.join(said)}. It takes "
        f"{', '.join(names)}")


C = TypeVar("C", bound=type)


def fields_checked(cls: C) -> C:
    """``cls`` (a dataclass), whose constructor answers a keyword that is not a field with
    the closest field and the list of them, instead of a bare ``TypeError``."""
    import dataclasses
    import functools

    made = vars(cls)["__init__"]
    known = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(made)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        wrong = [name for name in kwargs if name not in known]
        if wrong:
            raise unexpected(cls.__name__, wrong, known, elsewhere=False)
        made(self, *args, **kwargs)

    setattr(cls, "__init__", init)  # noqa: B010 - a dataclass's generated __init__, wrapped
    return cls
