"""Reading the independence test's findings off the table: the first site whose compared
rows moved, the shared tensors it read, and what a test that moved no row says."""

from __future__ import annotations

from typing import Any

import pandas as pd

from divtrace.align.status import Status
from divtrace.explain.probe import Settings
from divtrace.explain.rounding import two_models
from divtrace.explain.view import TableView
from divtrace.record.lineage import Origin
from divtrace.words import the

__all__ = ["first_dependent", "first_flagged", "parted", "through_shared", "unmoved"]


def parted(meta: Settings) -> str:
    """What parts the two runs when no sample depends on the others: the batch's shape
    (runs that differ in their batch size alone), how each model or run computes (runs
    of the same shape), or both."""
    if not meta.runs:
        return "the batch's shape"
    if two_models(meta):
        return "how each model computes"
    if meta.a_chunk == meta.batch_size:
        return "how each run computes"
    return "the batch's shape and how each run computes"


def unmoved(table: pd.DataFrame, meta: Settings) -> str:
    """The end of the sentence for a test that moved no compared row: what it covered and
    what that says, only as far as there is a difference to explain."""
    ok = table[table["status"] == "ok"]
    tested = ok[ok["depends_on_others"].notna()]
    if tested.empty:
        return ": no compared site could be tested, so it says nothing about the samples."
    every = "every compared site" if len(tested) == len(ok) else (
        f"each of the {len(tested)} tested sites (of {len(ok)} compared)")
    said = (f": the compared rows stayed bit-identical at {every}. No sample's result "
            f"showed a dependence on the other samples")
    if not (ok["mismatch"] > 0).any():
        return said + "."
    names = meta.names
    return (said + f", so what parts {the(names[1])} and {the(names[0])} is "
            f"{parted(meta)}, not the other samples' values.")


def first_flagged(table: pd.DataFrame, column: str) -> pd.Series | None:
    """The first row whose yes/no ``column`` says yes (missing counts as no), or None."""
    flagged = table[table[column].astype("boolean").fillna(False).astype(bool)]
    return None if flagged.empty else flagged.iloc[0]


def first_dependent(table: pd.DataFrame) -> pd.Series | None:
    """The first site whose compared rows moved with the other samples, or None."""
    return first_flagged(table, "depends_on_others") if "depends_on_others" in table else None


def through_shared(first: dict[str, Any], rows: list[dict[str, Any]],
                           view: TableView) -> list[str]:
    """Where the first moved site's call reads sites that hold no rows per sample (e.g. an
    ``aten.mean`` over the batch, at op level): followed back through such sites to the
    first of them, the likely mixing."""
    by_key = {row["site"]: row for row in rows}
    found: list[str] = []
    todo, seen = [first], set()
    while todo:
        call = view.call(todo.pop())
        for origin, key, _ in call.inputs if call is not None else ():
            row = by_key.get(key) if origin == Origin.SITE and key is not None else None
            if row is None or key is None or key in seen or row["status"] == Status.OK.value:
                continue
            seen.add(key)
            inner = view.call(row)
            deeper = [k for o, k, _ in (inner.inputs if inner is not None else ())
                      if o == Origin.SITE and k in by_key
                      and by_key[k]["status"] != Status.OK.value]
            if not deeper:
                found.append(key)
            todo.append(row)
    return found
