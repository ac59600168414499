"""Formatting helpers shared by the summary sentences."""

from __future__ import annotations

import pandas as pd

__all__ = ["ERRORS", "FRACTIONS", "RATIOS", "listed", "percent", "readable", "sci", "shown",
           "versus"]


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


#: Columns that hold fractions of elements (shown as percentages) and error figures
#: (shown in scientific notation), wherever a table or a row is printed.
FRACTIONS = frozenset({"mismatch", "exceed", "input_mismatch", "noise_mismatch",
                       "mismatch_a", "mismatch_b", "output_mismatch"})
ERRORS = frozenset({"max_abs", "mean_abs", "rel_l2", "others_rel_l2", "local_rel_l2",
                    "local_max_abs", "b_err_fp64", "a_err_fp64", "fp64_rel_l2", "noise_rel_l2",
                    "rel_l2_a", "rel_l2_b", "logits_rel_l2", "logits_max_abs",
                    "output_rel_l2", "output_max_abs", "output_change",
                    "logits_max_abs_at_split"})
#: Columns that hold how many times one figure is another (shown as ``2.07×``).
RATIOS = frozenset({"growth", "amplification"})


def shown(name: str, value: object) -> object:
    """A cell as a person should read it: fractions as percentages, error figures in
    scientific notation (never a non-zero one as 0); anything else as it is."""
    if not isinstance(value, float | int) or isinstance(value, bool) or value != value:
        return value
    if name in FRACTIONS:
        return percent(float(value))
    if name in ERRORS:
        return sci(float(value))
    if name in RATIOS:  # inf: the error came from nothing
        return f"{float(value):.3g}×" if abs(value) != float("inf") else str(float(value))
    if name == "cosine":  # all its digits: 1 - cos is about rel_l2² / 2
        return f"{float(value):.16g}"
    return value


def readable(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its fractions and error figures as text (see :func:`shown`)."""
    out = frame.copy()
    for column in out.columns:
        if column in FRACTIONS or column in ERRORS or column in RATIOS:
            out[column] = [shown(column, v) for v in out[column].tolist()]
    return out


def the(name: str) -> str:
    """A run's name in a sentence: "the split run", but "run a (each alone)"."""
    return name if name.startswith("run ") else f"the {name}"


def whose(name: str, thing: str) -> str:
    """A run's ``thing`` in a sentence: "the split run's passes", but "the passes of run a
    (each alone)"."""
    return f"the {thing} of {name}" if name.startswith("run ") else f"the {name}'s {thing}"


def versus(names: tuple[str, str]) -> str:
    """``"batched vs split"``: runs b and a, as an axis names them."""
    return f"{names[1].removesuffix(' run')} vs {names[0].removesuffix(' run')}"
