"""How two results of the same sort differ, row by row (a comparison's: site by site):
before and after an upgrade, on two GPUs, with two settings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from divtrace.align.order import merge
from divtrace.errors import DivtraceTypeError
from divtrace.words import sci

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.report.result import Result

__all__ = ["DIFF_COLUMNS", "Diff", "diff"]

#: The columns of :attr:`Diff.table`.
DIFF_COLUMNS = ("site", "module_type", "status_a", "status_b", "role_a", "role_b",
                "mismatch_a", "mismatch_b", "rel_l2_a", "rel_l2_b", "rel_l2_ratio", "change")
#: rel_l2 may move by this factor either way before it counts as a change.
FACTOR = 2.0


def _change(a: pd.Series | None, b: pd.Series | None, factor: float) -> str:
    """What changed at one site from ``a`` to ``b`` ("" for nothing worth saying)."""
    if a is None:
        return "only in b"
    if b is None:
        return "only in a"
    if a["status"] != b["status"]:
        return f"status {a['status']} → {b['status']}"
    if a["status"] != "ok":
        return ""
    if a["mismatch"] == 0 and b["mismatch"] > 0:
        return "now diverges"
    if a["mismatch"] > 0 and b["mismatch"] == 0:
        return "now bit-identical"
    if a["mismatch"] == 0:
        return ""
    if str(a.get("role", "")) != str(b.get("role", "")):
        return f"role {a.get('role') or '-'} → {b.get('role') or '-'}"
    ra, rb = a["rel_l2"], b["rel_l2"]
    if ra > 0 and rb > 0 and not (1 / factor <= rb / ra <= factor):
        return f"rel_l2 ×{rb / ra:.3g}"
    return ""


def _get(row: pd.Series | None, column: str) -> Any:
    return None if row is None else row.get(column)


def _ratio(a: float | None, b: float | None) -> float:
    """rel_l2 of b over that of a: NaN when either was not measured (or both are 0), inf
    when only a is 0."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return math.nan
    if a > 0:
        return b / a
    return math.inf if b > 0 else math.nan


@dataclass(frozen=True)
class Diff:
    """Two results of one sort side by side: ``a`` (before) and ``b`` (after).

    Attributes:
        table: One row per site (a row of :meth:`Result.rows`) in either (see
            :data:`DIFF_COLUMNS`); ``change`` says what changed ("" for nothing: same
            status and role, rel_l2 within a factor of 2).
        a, b: The two results.
    """

    table: pd.DataFrame
    a: Result
    b: Result

    @property
    def changed(self) -> pd.DataFrame:
        """The rows whose ``change`` is not empty."""
        return self.table[self.table["change"] != ""].reset_index(drop=True)

    def summary(self) -> str:
        """Plain sentences: the settings of both, how many sites changed, the first one."""
        def where(result: Result) -> str:
            meta = getattr(result, "meta", None)
            said = [] if meta is None else [_where(meta)]
            verdict = result._shade()
            return ", ".join(said + ([] if verdict is None else [f"verdict {verdict}"]))

        both = self.table[~self.table["change"].isin(["only in a", "only in b"])]
        named = "; ".join(f"{n}: {w}" for n, w in (("a", where(self.a)), ("b", where(self.b)))
                          if w)
        lines = [f"{named + '. ' if named else ''}{len(both)} sites in both, "
                 f"{int((self.table['change'] == 'only in a').sum())} only in a, "
                 f"{int((self.table['change'] == 'only in b').sum())} only in b."]
        for said in (self._settings_apart(), self._other_models()):
            if said:
                lines.append(said)
        changed = self.changed
        if changed.empty:
            lines.append("No site changed its behaviour: the same statuses, the same "
                         "bit-identical sites and roles, rel_l2 within a factor of 2.")
        else:
            top = changed.iloc[0]
            order = " in execution order" if self.a.document == "comparison" else ""
            kind = "" if pd.isna(top["module_type"]) or not top["module_type"] else (
                f" ({top['module_type']})")
            lines.append(f"{len(changed)} site(s) changed; the first{order} is "
                         f"'{top['site']}'{kind}: {top['change']}.")
        out_a, out_b = getattr(self.a, "output", None), getattr(self.b, "output", None)
        if out_a is not None and out_b is not None:
            lines.append(f"At the output, rel_l2 {sci(out_a['rel_l2'])} (a) and "
                         f"{sci(out_b['rel_l2'])} (b).")
        return "\n".join(lines)

    def _settings_apart(self) -> str:
        """The settings in which the two comparisons differ, as ``name: a vs b`` ("" when
        none does)."""
        ma, mb = getattr(self.a, "meta", None), getattr(self.b, "meta", None)
        if ma is None or mb is None:
            return ""
        pairs = [("B", ma.batch_size, mb.batch_size), ("batch_dim", ma.batch_dim, mb.batch_dim),
                 ("run a's passes of", ma.a_chunk, mb.a_chunk),
                 ("compared samples", len(ma.samples), len(mb.samples))]
        for run in ("a", "b"):
            sa, sb = ma.settings.get(run, {}), mb.settings.get(run, {})
            pairs += [(f"run {run}'s {key}", sa[key], sb[key]) for key in sa
                      if key != "label" and key in sb]
        apart = [f"{name} {x} vs {y}" for name, x, y in pairs if x != y]
        if not apart:
            return ""
        return (f"The two comparisons were made with other settings ({', '.join(apart)}): "
                f"some changes below may come from them.")

    def _other_models(self) -> str:
        """A warning when the two comparisons are not of one model ("" when they are):
        sites of the same name hold other module types, or few sites are shared."""
        a, b = self.a.rows(), self.b.rows()
        types = a.drop_duplicates("site").set_index("site")["module_type"]
        theirs = b.drop_duplicates("site").set_index("site")["module_type"]
        shared = types.index.intersection(theirs.index)
        retyped = [s for s in shared if types[s] != theirs[s]]
        alone = len(types.index.union(theirs.index)) - len(shared)
        if not retyped and alone <= len(shared):
            return ""
        said = f"{len(retyped)} shared site(s) hold another module type (first: "\
            f"'{retyped[0]}', {types[retyped[0]]} in a, {theirs[retyped[0]]} in b)" \
            if retyped else f"only {len(shared)} of {len(shared) + alone} sites are shared"
        return (f"These look like comparisons of two different models: {said}. A diff "
                f"compares one model before and after a change; the sites are matched by "
                f"name only.")

    def plot(self, ax: Axes | None = None) -> Axes:
        """rel_l2 of both by depth (a comparison's leaf sites; another result's rows in
        order), bit-identical ones on a lane."""
        from divtrace.report.plot import overlay

        return overlay([self.a, self.b], ["a", "b"], ax=ax)

    def __repr__(self) -> str:
        return f"<divtrace.Diff: {len(self.table)} sites, {len(self.changed)} changed>"


def _where(meta: Any) -> str:
    """``torch 2.11, NVIDIA H200``: where a comparison ran."""
    env = meta.environment
    gpus = env.get("gpus") or env.get("devices") or ""
    device = f", {gpus[0] if isinstance(gpus, list) and gpus else gpus}" if gpus else ""
    return f"torch {meta.torch}{device}"


def diff(a: Result, b: Result, factor: float = FACTOR) -> Diff:
    """How result ``b`` differs from result ``a`` of the same sort (two comparisons, two
    backward comparisons, two generations, two sweeps, ...), row by row: a comparison's
    sites, a backward comparison's gradients and parameters, a generation's (prompt,
    step) logits, a sweep's settings. Rows in one of them only are rows too.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).eval()
        >>> x = torch.randn(6, 4)
        >>> first = divtrace.compare(net, x, progress=False)
        >>> divtrace.diff(first, first).changed.empty
        True
    """
    if not all(callable(getattr(r, "rows", None)) and hasattr(r, "document")  # a Result
               for r in (a, b)) or type(a) is not type(b):
        raise DivtraceTypeError(
            f"diff takes two divtrace results of one sort (two Comparison, two Backward, "
            f"two Generation, ..., or divtrace.load of saved ones); got "
            f"{type(a).__name__} and {type(b).__name__}")
    ta, tb = a.rows().set_index("site"), b.rows().set_index("site")
    rows = []
    for site in merge(list(ta.index), list(tb.index)):
        ra = ta.loc[site] if site in ta.index else None
        rb = tb.loc[site] if site in tb.index else None
        some = rb if ra is None else ra
        assert some is not None  # the site is in one of them
        rel_a, rel_b = _get(ra, "rel_l2"), _get(rb, "rel_l2")
        rows.append({"site": site, "module_type": some["module_type"],
                     "status_a": _get(ra, "status"), "status_b": _get(rb, "status"),
                     "role_a": _get(ra, "role"), "role_b": _get(rb, "role"),
                     "mismatch_a": _get(ra, "mismatch"), "mismatch_b": _get(rb, "mismatch"),
                     "rel_l2_a": rel_a, "rel_l2_b": rel_b, "rel_l2_ratio": _ratio(rel_a, rel_b),
                     "change": _change(ra, rb, factor)})
    table = pd.DataFrame(rows, columns=list(DIFF_COLUMNS))
    for column in ("mismatch_a", "mismatch_b", "rel_l2_a", "rel_l2_b", "rel_l2_ratio"):
        table[column] = pd.to_numeric(table[column], errors="coerce").astype(np.float64)
    return Diff(table, a, b)
