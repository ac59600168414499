"""Saved results: a comparison, a sweep or a generation as one versioned JSON file, and
back — every table column with its dtype, the per-sample figures, the meta and the
environment. Plain text, never pickle.

The file is one JSON object: ``{"format": "divtrace", "version": 1, "kind": ...}`` and
the kind's fields. A table is ``{"columns": [...], "dtypes": [...], "data": [[column
values], ...]}``; a float that JSON cannot hold is a string (``"NaN"``, ``"Infinity"``,
``"-Infinity"``), a missing value ``null``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from divtrace.errors import DivtraceValueError

if TYPE_CHECKING:
    from divtrace.report.comparison import Comparison

__all__ = ["FORMAT", "VERSION", "comparison_fields", "frame_from_json", "frame_to_json",
           "number", "plain", "read", "write"]

FORMAT = "divtrace"
#: Raised when the layout changes; files of older versions are read as long as possible.
#: Version 2: the meta of ``explain=`` and ``Resources``, columns named after runs a and b.
VERSION = 2
_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def plain(value: Any) -> Any:
    """A JSON-ready value: numbers, strings, booleans, None; NaN and infinities as strings."""
    if value is None or value is pd.NA:
        return None
    if isinstance(value, bool):
        return value
    if hasattr(value, "item"):  # NumPy scalars
        value = value.item()
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
    return value


def number(value: Any) -> float:
    """A float that :func:`plain` wrote, back (``"NaN"`` and the infinities too)."""
    return math.nan if value is None else float(_SPECIAL.get(value, value))


def _cells(column: pd.Series) -> list[Any]:
    if str(column.dtype).startswith("float"):
        return [plain(v) for v in column.tolist()]
    # elsewhere a NaN or NA is a missing value, not a number
    return [None if _missing(v) else plain(v) for v in column.tolist()]


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def frame_to_json(frame: pd.DataFrame) -> dict[str, Any]:
    """A DataFrame as columns, dtypes and column-wise values."""
    return {"columns": [str(c) for c in frame.columns],
            "dtypes": [str(frame[c].dtype) for c in frame.columns],
            "data": [_cells(frame[c]) for c in frame.columns]}


def _column(values: list[Any], dtype: str) -> Any:
    if dtype.startswith("float"):
        return pd.array([math.nan if v is None else _SPECIAL.get(v, v) if isinstance(v, str)
                         else v for v in values], dtype=dtype)
    if dtype == "Int64":
        return pd.array(values, dtype="Int64")
    if dtype in ("str", "string") or dtype.startswith("string"):
        return pd.array(values, dtype="str")
    if dtype == "object":
        return pd.array([_SPECIAL.get(v, v) if isinstance(v, str) and v in _SPECIAL else v
                         for v in values], dtype=object)
    return pd.array(values, dtype=dtype)


def frame_from_json(data: dict[str, Any]) -> pd.DataFrame:
    """The DataFrame :func:`frame_to_json` wrote, with its dtypes."""
    columns = {name: _column(values, dtype) for name, dtype, values in
               zip(data["columns"], data["dtypes"], data["data"], strict=True)}
    return pd.DataFrame(columns, columns=data["columns"])


def write(path: str | Path, kind: str, fields: dict[str, Any]) -> Path:
    """Writes one saved result (strict JSON: no NaN literals)."""
    path = Path(path)
    doc = {"format": FORMAT, "version": VERSION, "kind": kind} | fields
    path.write_text(json.dumps(doc, indent=1, allow_nan=False))
    return path


def read(path: str | Path) -> dict[str, Any]:
    """Reads a saved result, checking that it is one."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DivtraceValueError(f"cannot read {path} as a divtrace file: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DivtraceValueError(
            f"{path} is not a file divtrace saved (no \"format\": \"{FORMAT}\"); files "
            f"come from Comparison.save, Sweep.save, BatchSweep.save or Generation.save")
    if doc.get("version", 0) < VERSION:
        raise DivtraceValueError(
            f"{path} was written in format version {doc.get('version')}, before the "
            f"comparison's settings became explain= and Resources and the columns were "
            f"named after runs a and b; this divtrace reads version {VERSION}: run the "
            f"comparison again and save it")
    if doc.get("version", 0) > VERSION:
        raise DivtraceValueError(
            f"{path} was written by a newer divtrace (format version {doc['version']}; this "
            f"one reads up to {VERSION}); upgrade divtrace")
    return doc


def comparison_fields(result: Comparison) -> dict[str, Any]:
    """What a saved comparison holds."""
    return {"meta": result.meta.to_dict(), "summary": result.summary(),
            "table": frame_to_json(result.table), "samples": frame_to_json(result.per_sample),
            "probes": [probe.__name__ for probe in result.probes]}
