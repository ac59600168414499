"""Formatting helpers shared by the summary sentences."""

from __future__ import annotations

import pandas as pd

__all__ = ["listed"]


def listed(rows: pd.DataFrame, limit: int = 6) -> str:
    """``'site' (ModuleType)`` for the first ``limit`` rows, and how many more."""
    names = [f"'{r.site}' ({r.module_type})" for r in rows.head(limit).itertuples()]
    more = "" if len(rows) <= limit else f" and {len(rows) - limit} more"
    return ", ".join(names) + more
