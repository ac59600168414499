"""The exceptions and warnings divtrace raises.

Every error derives from :class:`DivtraceError` and also from the matching built-in
exception, so ``except ValueError`` and ``except divtrace.DivtraceError`` both work.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

#: Where divtrace's own files lie (frames there are not the user's).
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class DivtraceError(Exception):
    """Base class of every error divtrace raises itself."""


class DivtraceValueError(DivtraceError, ValueError):
    """An argument has the right type but an unusable value."""


class DivtraceTypeError(DivtraceError, TypeError):
    """An argument has the wrong type."""


class DivtraceAttributeError(DivtraceError, AttributeError):
    """An attribute that a result had once, read under its old name."""


def moved(owner: object, name: str, where: dict[str, str]) -> AttributeError:
    """The error for reading ``name`` of ``owner``: its new spelling where it moved
    (``where``), else Python's own message."""
    kind = type(owner).__name__
    if name in where:
        return DivtraceAttributeError(f"{kind}.{name} is gone: use {where[name]}")
    return AttributeError(f"'{kind}' object has no attribute '{name}'")


class BatchMixingError(DivtraceValueError):
    """The model has layers that mix samples (or draw random numbers) in train mode."""


class DivtraceWarning(UserWarning):
    """Something divtrace can work around but the user should know about."""


def user_level() -> int:
    """The ``stacklevel`` that points a warning raised by the caller at the first frame
    outside divtrace and ``contextlib`` (the user's call, whatever the face and however
    many frames lie between)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename.endswith("contextlib.py")):
        frame, level = frame.f_back, level + 1
    return level
