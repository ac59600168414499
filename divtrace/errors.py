"""The exceptions and warnings divtrace raises.

Every error derives from :class:`DivtraceError` and also from the matching built-in
exception, so ``except ValueError`` and ``except divtrace.DivtraceError`` both work.
"""

from __future__ import annotations


class DivtraceError(Exception):
    """Base class of every error divtrace raises itself."""


class DivtraceValueError(DivtraceError, ValueError):
    """An argument has the right type but an unusable value."""


class DivtraceTypeError(DivtraceError, TypeError):
    """An argument has the wrong type."""


class BatchMixingError(DivtraceValueError):
    """The model has layers that mix samples (or draw random numbers) in train mode."""


class DivtraceWarning(UserWarning):
    """Something divtrace can work around but the user should know about."""
