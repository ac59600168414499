"""Output formats: each a ``write_<format>(result, path)`` that reads the public
:class:`~divtrace.Comparison` and returns the path it wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from divtrace.report.comparison import Comparison

__all__ = ["write_csv", "write_json"]


def write_csv(result: Comparison, path: str | Path) -> Path:
    """The table as CSV."""
    path = Path(path)
    result.table.to_csv(path, index=False)
    return path


def write_json(result: Comparison, path: str | Path) -> Path:
    """The settings, summary, table and per-sample figures as JSON."""
    path = Path(path)
    doc = {
        "meta": result.meta,
        "summary": result.summary(),
        "table": json.loads(result.table.to_json(orient="records")),
        "samples": json.loads(result.samples.to_json(orient="records")),
    }
    path.write_text(json.dumps(doc, indent=1))
    return path
