"""Roles: where the divergence enters (sources) and where it is only carried."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, ClassVar

from divtrace.explain.probe import Explained, Judged, Probe, Spec
from divtrace.explain.view import TableView
from divtrace.words import listed

__all__ = ["Role", "Roles"]


class Role(StrEnum):
    """The role of a leaf site; the table holds the values (plain strings)."""

    SOURCE = "source"  # input bit-identical in both runs, output not
    CARRIER = "carrier"  # input already differed
    CLEAN = "clean"  # output bit-identical
    UNKNOWN = "unknown"  # the input was made outside any module, then changed in place


class Roles(Probe):
    """``input_mismatch`` and ``role`` of every leaf site, from the measured run's lineage.
    Always on."""

    spec: ClassVar[Spec] = Spec(columns=("input_mismatch", "role"), leads=True,
                                blank={"role": ""})

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)))

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        for row in rows:
            row["input_mismatch"], row["role"] = math.nan, ""
            call = view.call(row)
            if call is None:
                continue
            inputs = view.inputs(view.call_key(row))
            row["input_mismatch"] = inputs.mismatch if inputs else math.nan
            if row["status"] != "ok":
                continue
            if row["mismatch"] == 0:
                row["role"] = Role.CLEAN.value
            elif inputs is None:
                row["role"] = Role.UNKNOWN.value
            else:
                row["role"] = (Role.SOURCE if inputs.mismatch == 0 else Role.CARRIER).value

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        table = result.table
        sources = result.sources
        if sources.empty:
            return []
        carriers = table[table["role"] == Role.CARRIER]
        many = len(carriers) > 1
        are = "are carriers" if many else "is a carrier"
        after = ("No divergent leaf site follows." if carriers.empty else
                 f"{len(carriers)} divergent leaf site{'s' * many} after "
                 f"{'them' if len(sources) > 1 else 'it'} {are}: "
                 f"{'their' if many else 'its'} input already differed"
                 + ("." if "local_rel_l2" in table else
                    " (explain=['local'] tells which of them add error of their own)."))
        noun = "Sources" if len(sources) > 1 else "Source"
        lines = [f"{noun} of divergence (input bit-identical in both runs, output not): "
                 f"{listed(sources)}. {after}"]
        ops = sources[sources["op"] != ""]
        if not ops.empty:
            where = ", ".join(f"{r.op.rsplit('.', 1)[0]} in '{r.scope}' ({r.module_type})"
                              for r in ops.head(4).itertuples())
            more = "" if len(ops) <= 4 else f" and {len(ops) - 4} more"
            lines.append(f"At op level the divergence enters at {where}{more}.")
        unknown = table[table["role"] == Role.UNKNOWN]
        if not unknown.empty:
            lines.append(f"For {listed(unknown, 3)} an input could not be traced or compared "
                         f"(made outside any module and changed in place, or not comparable "
                         f"at its own site), so the role is unknown.")
        return lines
