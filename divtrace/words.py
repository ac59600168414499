"""Small formatting helpers shared by the summary sentences, the HTML and the plots."""

from __future__ import annotations

import math

import pandas as pd

__all__ = ["fmt", "listed"]


def fmt(value: float | None, spec: str = ".3g") -> str:
    """``value`` formatted, or an en dash for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def listed(rows: pd.DataFrame, limit: int = 6) -> str:
    """``'site' (ModuleType)`` for the first ``limit`` rows, and how many more."""
    names = [f"'{r.site}' ({r.module_type})" for r in rows.head(limit).itertuples()]
    more = "" if len(rows) <= limit else f" and {len(rows) - limit} more"
    return ", ".join(names) + more
