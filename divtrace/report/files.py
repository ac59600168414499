"""Output formats: each a ``write_<format>(result, path)`` that reads the public
:class:`~divtrace.Comparison` and returns the path it wrote (JSON is
:meth:`~divtrace.Comparison.save`'s format: :mod:`divtrace.report.saved`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from divtrace.report.comparison import Comparison

__all__ = ["write_csv"]


def write_csv(result: Comparison, path: str | Path) -> Path:
    """The table as CSV."""
    path = Path(path)
    result.table.to_csv(path, index=False)
    return path
