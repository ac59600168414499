"""Formatting helpers shared by the summary sentences."""

from __future__ import annotations

import pandas as pd

__all__ = ["listed", "percent", "sci"]


def listed(rows: pd.DataFrame, limit: int = 6) -> str:
    """``'site' (ModuleType)`` for the first ``limit`` rows, and how many more."""
    names = [f"'{r.site}' ({r.module_type})" for r in rows.head(limit).itertuples()]
    more = "" if len(rows) <= limit else f" and {len(rows) - limit} more"
    return ", ".join(names) + more


def sci(value: float, digits: int = 2) -> str:
    """An error figure in scientific notation (``1.75e-06``); exactly zero as ``0``."""
    if value == 0:
        return "0"
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return f"{value:.{digits}e}"


def percent(fraction: float) -> str:
    """A fraction as a percentage with enough digits that a non-zero one never reads 0
    and one short of all never reads 100 (``0.0012%``, ``99.97%``)."""
    if fraction == 0 or fraction == 1:
        return f"{fraction:.0%}"
    if fraction < 1e-3:
        return f"{fraction * 100:.2g}%"
    for digits in range(1, 12):
        text = f"{fraction * 100:.{digits}f}"
        if float(text) not in (0.0, 100.0):
            return f"{text.rstrip('0').rstrip('.') if digits > 1 else text}%"
    return f"{fraction * 100:.3g}%"
