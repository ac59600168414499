"""The verdict: is the divergence the size floating-point reordering produces, or not?

The rule, from the rounding scale of the precision in force and how error enters a
network (documented in the README):

* **identical** — every compared site is bit-identical in both runs.
* **not rounding**, with the reason, when the runs differ by design (train-mode
  BatchNorm or Dropout, random draws), when they ran different modules, when nothing
  could be compared, or when error *enters* beyond the rounding budget: at a source (its
  inputs identical in both runs), at the first divergent site, at a layer whose own error
  on identical inputs (the ``"local"`` probe) exceeds it, or at a jump of more than
  :data:`JUMP` over the error the layer received. With the ``"fp64"`` probe also when one run
  is far from float64 and the other is not.
* **not rounding** also when the difference keeps its size in float64 (the precision test:
  a computation that depends on the batch's shape by design).
* **rounding** otherwise: in float64 the difference shrinks as rounding does (its size
  then does not matter), or, where the precision test did not decide, error enters within
  the budget and is then carried (and may grow).

The budget of a site is ``8 u_op + 1024 u_acc``: a few roundings of the operands (``u_op``
is the unit roundoff of the coarsest of the site's dtype, the runs' dtypes, and the
reduced-precision math in force on CUDA: TF32, or bfloat16 matmuls) plus a reordered sum of
up to a million terms, whose rounding errors add up like a random walk (``sqrt(2**20)
u_acc``, ``u_acc`` that of the float32 accumulator, or float64's). Float32: 6.2e-5;
TF32: 4.0e-3; bfloat16: 3.1e-2; float64: 1.1e-13.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd

from divtrace.explain.mixed import parted
from divtrace.explain.probe import Explained, Findings, Judged, output_rows
from divtrace.explain.rounding import CHECK, MODELS, budget, two_models
from divtrace.explain.routing import routed_calls
from divtrace.words import sci

if TYPE_CHECKING:
    from collections.abc import Sequence

    from divtrace.explain.probe import Probe
    from divtrace.report.meta import Meta

    Probes = Sequence[type[Probe]]

__all__ = ["JUMP", "Verdict", "blocked", "judge"]

T = TypeVar("T")

#: A carrier whose error grows by more than this over what it received adds error of its
#: own beyond rounding (amplification by a layer is rarely more than a few times).
JUMP = 2.0**10


@dataclass(frozen=True)
class Verdict:
    """One of ``identical``, ``rounding``, ``not rounding``, and the sentence that says why."""

    kind: str
    sentence: str


def _entries(table: pd.DataFrame, first: pd.Series, findings: Findings
             ) -> list[tuple[pd.Series, float, str]]:
    """Where error enters among ``table``'s rows: ``(row, its error, how it was seen)``;
    in order of preference when two tie."""
    found = [(row, row["rel_l2"], "source") for _, row in table[table["role"] == "source"]
             .iterrows()]
    found += [entry for entry in findings.entries if entry[0].name in table.index]
    found.append((first, first["rel_l2"], "first"))
    jumps = table[table["leaf"] & (table["op"] == "") & (table["growth"] > JUMP)]
    found += [(row, row["rel_l2"], "jump") for _, row in jumps.iterrows()]
    return found


def _subject(row: pd.Series, error: float, seen: str) -> str:
    where = f"'{row['site']}' ({row['module_type']})"
    size = ("by an infinite rel_l2 (the split run is all zeros there)" if math.isinf(error)
            else f"by rel_l2 {sci(error)}")
    if seen == "source":
        return f"the error enters at {where}, on identical inputs, {size}"
    if seen == "own":
        return f"{where} adds error of its own on identical inputs, {size}"
    if seen == "jump":
        grows = ("without bound" if math.isinf(row["growth"]) else
                 f"{row['growth']:.3g}×")
        return f"the error grows {grows} at {where}, to {size.removeprefix('by ')}"
    return f"the runs first part at {where} {size}"


def _by_design(table: pd.DataFrame, meta: Meta, mixing: tuple[str, str] | None
               ) -> str | None:
    there = "" if mixing is None else (
        f" The compared rows first depend on the other samples at {mixing[0]}.")
    if meta.train_mode:
        return (f"the model ran in train mode (allow_train=True): {meta.mixers()} make "
                f"the runs differ by design." + (there if not meta.random_draws else ""))
    if meta.random_draws:
        return ("the model drew random numbers during its passes (allow_train=True): the "
                "runs differ by design.")
    apart = table[table["status"].isin(["missing_in_split", "missing_in_batched"])
                  & (table["op"] == "")]  # an op in one run only is another kernel path
    # a call inside a mixture of experts follows the routing (compared there)
    apart = apart.drop(routed_calls(table, meta.notes).index)
    if not apart.empty:
        row = apart.iloc[0]
        return (f"the runs did not run the same modules: '{row['site']}' ran in one of "
                f"them only ({row['status']}); the model's control flow depends on the "
                f"batch.")
    return None


def _at_output(outputs: pd.DataFrame, row: pd.Series) -> str:
    """``; at the output it is ...``: the largest rel_l2 over the model's output tensors
    (each named when there are several)."""
    ok = outputs[outputs["status"] == "ok"]
    if ok.empty or (len(ok) == 1 and ok.iloc[0]["site"] == row["site"]):
        return ""
    if len(ok) == 1:
        return f"; at the output it is {sci(ok.iloc[0]['rel_l2'])}"
    worst = ok.loc[ok["rel_l2"].fillna(-1).idxmax()]
    return (f"; at the output ({len(ok)} tensors) it is at most {sci(worst['rel_l2'])}, at "
            f"'{worst['site']}'")


def _sized(ok: pd.DataFrame, diverged: pd.DataFrame, tested: str) -> pd.DataFrame:
    """The sites whose size is checked against the budget. Once the independence test
    has shown every sample independent, op sites are left out when module sites diverge
    too: two runs that take other kernel paths pair up ops by their index in a scope,
    and such pairs (partial sums of reductions in another order) are no measure of the
    rounding of a layer."""
    if tested == "independent" and (diverged["op"] == "").any() and (diverged["op"] != "").any():
        return ok[ok["op"] == ""]
    return ok


def _first(found: Iterable[T | None]) -> T | None:
    """The first thing a probe found (None: none found anything)."""
    return next((item for item in found if item is not None), None)


def _found(table: pd.DataFrame, meta: Meta, probes: Probes,
           explained: Sequence[Explained] | None = None) -> Findings:
    """What the probes found, together: of each finding the first probe's that has one,
    and every probe's entries (``explained``: what the probes said already, in order)."""
    if explained is None:
        judged = Judged(table, meta)
        explained = [probe.explain(judged) for probe in probes]
    each = [said.findings for said in explained]
    firsts = {f.name: _first(getattr(one, f.name) for one in each)
              for f in fields(Findings) if f.name != "entries"}
    return Findings(**firsts, entries=tuple(entry for one in each for entry in one.entries))


def _units(error: float, u_op: float, name: str) -> str:
    """``, 7.5 units of float32 rounding`` (nothing for an infinite error)."""
    return "" if math.isinf(error) else f", {error / u_op:.3g} units of {name} rounding"


def _unmeasurable(tested: str, meta: Meta) -> Verdict:
    why = ("its norms could not be computed (float64 values beyond about 1e±154, whose "
           "squares overflow or underflow)")
    if tested == "independent":
        return Verdict("rounding", (
            f"Verdict: rounding — no compared row moved when only the other samples "
            f"changed (independence test), so what parts the runs is {parted(meta)}; the "
            f"size of the error is not known: {why}."))
    return Verdict("not rounding", (
        f"Verdict: not rounding — floating point cannot be shown to explain it: {why}, and "
        f"the independence test did not decide."))


def _apart(table: pd.DataFrame, meta: Meta, found: Findings
           ) -> tuple[tuple[str, str] | None, str | None]:
    """What the probes found of batch mixing, and why the runs differ by design."""
    return found.mixing, _by_design(table, meta, found.mixing)


def blocked(table: pd.DataFrame, meta: Meta, probes: Probes = ()) -> str | None:
    """Why the runs differ for reasons that are not numerical, so that no kernel or
    precision setting can make them agree: by design (train mode, random draws, other
    modules run) or because the samples mix (None: neither was found)."""
    mixing, reason = _apart(table, meta, _found(table, meta, probes))
    if reason is not None:
        return reason
    return None if mixing is None else mixing[1]


def judge(table: pd.DataFrame, meta: Meta, probes: Probes = (),
          explained: Sequence[Explained] | None = None) -> Verdict:
    """The verdict on a comparison's table (see the module's documentation); ``probes``
    (those that explain the comparison) add what they found: batch mixing, how far the
    samples were shown independent, where error enters, what floating point does not
    explain. ``explained``: what they said of it, when the caller has it already."""
    found = _found(table, meta, probes, explained)  # asked of the probes once
    mixing, reason = _apart(table, meta, found)
    if reason is not None:
        return Verdict("not rounding", f"Verdict: not rounding — {reason}")
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return Verdict("not rounding", "Verdict: not rounding — nothing could be compared, "
                                       "so floating point cannot be shown to explain it.")
    if mixing is not None:
        return Verdict("not rounding", f"Verdict: not rounding — {mixing[1]}")
    diverged = ok[ok["mismatch"] > 0]
    if diverged.empty:
        noun = "site is" if len(ok) == 1 else f"{len(ok)} compared sites are"
        return Verdict("identical", f"Verdict: identical — {'the one' if len(ok) == 1 else 'all'}"
                                    f" {noun} bit-identical in both runs.")
    designed = found.designed
    if designed is not None:
        return Verdict("not rounding", f"Verdict: not rounding — {designed[1]}")
    tested = found.independent or "untested"
    precise = found.precise or "untested"
    sized = _sized(ok, diverged, tested)
    worst: tuple[float, Any] | None = None
    entries = _entries(sized, sized[sized["mismatch"] > 0].iloc[0], found)
    for row, error, seen in entries:
        limit, u_op, name = budget(row["dtype"], meta)
        share = error / limit if limit > 0 else math.inf
        if not math.isnan(share) and (worst is None or share > worst[0]):
            worst = (share, (row, error, seen, limit, u_op, name))
    if worst is None:  # no size could be measured
        return _unmeasurable(tested, meta)
    share, (row, error, seen, limit, u_op, name) = worst
    if share > 1 and precise != "shrinks":  # shown to be rounding: its size does not matter
        hint = MODELS if two_models(meta) else CHECK if tested != "independent" else (
            "No compared row moved when only the other samples changed (independence "
            "test), so look for a kernel that is wrong at one of the two batch sizes, or "
            "for lower precision than the runs' settings say.")
        return Verdict("not rounding", (
            f"Verdict: not rounding — {_subject(row, error, seen)}"
            f"{_units(error, u_op, name)}, far beyond the "
            f"{sci(limit)} a reordered sum can give. {hint}"))
    reason = found.beyond
    if reason is not None:
        return Verdict("not rounding", f"Verdict: not rounding — {reason}")
    return _rounding(table, entries, meta, tested, precise)


def _cause(meta: Meta) -> str:
    return ("the batch size changes the order of operations" if not meta.runs
            else "the two models round differently" if two_models(meta)
            else "the two configurations round differently")


#: The independence test's state, when it did not show the samples independent.
_UNTESTED = {"inconclusive": "the independence test was inconclusive (the batched run is "
                             "not deterministic)",
             "routed": "the independence test was inconclusive from a mixture-of-experts "
                       "block on (its experts are called on as many tokens as the other "
                       "samples send them)",
             "untested": "the independence test did not run"}

_SHRUNK = ("in float64 the runs' difference shrinks as rounding does at every site where "
           "they differ (precision test)")


def _untested(tested: str, meta: Meta) -> str:
    """Why the independence test did not show the samples independent, in words."""
    routed = tested == "inconclusive" and (meta.notes.get("independence") or {}).get("routed")
    return _UNTESTED["routed" if routed else tested]


def _capital(sentence: str) -> str:
    return sentence[0].upper() + sentence[1:]


def _designed_not(meta: Meta) -> str:
    """What the precision test would have shown: the difference is rounding, not there by
    design."""
    parts = parted(meta)
    if parts == "the batch's shape":
        return ("the difference comes from the batch's shape and not from a computation "
                "that depends on it by design")
    return f"the difference is rounding in {parts}, not one by design,"


def _ending(tested: str, precise: str, meta: Meta) -> str:
    """What a rounding verdict rests on: both tests, or what did not run."""
    if precise == "shrinks":
        if tested == "independent":
            return (f"No compared row moved when only the other samples changed "
                    f"(independence test) and {_SHRUNK}: not a bug; {_cause(meta)}.")
        return (f"{_capital(_SHRUNK)}, but {_untested(tested, meta)}: a dependence on the other "
                f"samples' values is not ruled out.")
    shape = ("the precision test (the runs again in float64) was inconclusive"
             if precise == "inconclusive" else
             "the precision test (the runs again in float64) did not run")
    if tested == "independent":
        return (f"No compared row moved when only the other samples changed (independence "
                f"test), but {shape}, so that {_designed_not(meta)} rests on the size of "
                f"the error alone.")
    return (f"{_capital(_untested(tested, meta))} and {shape}, so this rests on the size of the "
            f"error alone.")


def _rounding(table: pd.DataFrame, entries: list[tuple[pd.Series, float, str]], meta: Meta,
              tested: str, precise: str) -> Verdict:
    """The rounding verdict: where the error enters first (a source, or the first
    divergent site), its size against the budget, and what the verdict rests on. With the
    precision test passed, an error beyond the budget is rounding all the same."""
    row, error, seen = entries[0]
    limit, u_op, name = budget(row["dtype"], meta)
    size = "within" if error <= limit else "beyond"
    return Verdict("rounding", (
        f"Verdict: rounding — {_subject(row, error, seen)}{_units(error, u_op, name)}, "
        f"{size} the {sci(limit)} a reordered sum can give"
        f"{_at_output(output_rows(table), row)}. {_ending(tested, precise, meta)}"))
