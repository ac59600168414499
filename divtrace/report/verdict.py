"""The verdict: is the divergence the size floating-point reordering produces, or not?

The rule, from the rounding scale of the precision in force and how error enters a
network (documented in the README):

* **identical** — every compared site is bit-identical in both runs.
* **not rounding**, with the reason, when the runs differ by design (train-mode
  BatchNorm or Dropout, random draws), when they ran different modules, when nothing
  could be compared, or when error *enters* beyond the rounding budget: at a source (its
  inputs identical in both runs), at the first divergent site, at a layer whose own error
  on identical inputs (``local=True``) exceeds it, or at a jump of more than
  :data:`JUMP` over the error the layer received. With ``truth="fp64"`` also when one run
  is far from float64 and the other is not.
* **rounding** otherwise: error enters within the budget and is then carried (and may grow).

The budget of a site is ``8 u_op + 1024 u_acc``: a few roundings of the operands (``u_op``
is the unit roundoff of the coarsest of the site's dtype, the runs' dtypes, and the
reduced-precision math in force on CUDA: TF32, or bfloat16 matmuls) plus a reordered sum of
up to a million terms, whose rounding errors add up like a random walk (``sqrt(2**20)
u_acc``, ``u_acc`` that of the float32 accumulator, or float64's). Float32: 6.2e-5;
TF32: 4.0e-3; bfloat16: 3.1e-2; float64: 1.1e-13.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from divtrace.align.sites import ROOT
from divtrace.explain.independence import first_dependent
from divtrace.words import sci

if TYPE_CHECKING:
    from divtrace.report.meta import Meta

__all__ = ["JUMP", "Verdict", "budget", "judge", "reduced"]

#: A carrier whose error grows by more than this over what it received adds error of its
#: own beyond rounding (amplification by a layer is rarely more than a few times).
JUMP = 2.0**10
_OPERAND_ROUNDINGS = 8
_SUM_STEPS = 2.0**10  # sqrt(2**20): a reordered sum of up to a million terms
_TF32, _BF16 = 2.0**-11, 2.0**-8
_CHECK = ("Check for a layer that mixes samples in eval mode (a statistic over the batch), "
          "a wrong batch_dim, random numbers, or padding that is not masked.")


@dataclass(frozen=True)
class Verdict:
    """One of ``identical``, ``rounding``, ``not rounding``, and the sentence that says why."""

    kind: str
    sentence: str


def _unit(name: str | None) -> float | None:
    dtype = getattr(torch, name or "", None)
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        return None
    return float(torch.finfo(dtype).eps) / 2


def reduced(meta: Meta) -> list[tuple[float, str]]:
    """The reduced-precision maths in force for float32 in either run: ``(u_op, what it
    is, in plain words)``."""
    found: dict[str, float] = {}
    for s in meta.settings.values():
        if s.get("dtype") != "float32":
            continue
        device = str(s.get("device", ""))
        if device.startswith("cuda"):
            if s.get("tf32_matmul"):
                found["TF32 for float32 matmuls on the GPU"] = _TF32
            if s.get("tf32_cudnn"):
                found["TF32 for float32 convolutions in cuDNN"] = _TF32
            if s.get("matmul_precision") == "medium":
                found["bfloat16 for float32 matmuls (matmul precision 'medium')"] = _BF16
        elif device.startswith("cpu") and s.get("bf16_matmul_cpu"):
            found["bfloat16 for float32 matmuls in oneDNN on the CPU"] = _BF16
    return [(u, name) for name, u in found.items()]


def budget(site_dtype: str, meta: Meta) -> tuple[float, float, str]:
    """``(budget, u_op, what u_op is)`` for a site of ``site_dtype`` under ``meta``."""
    candidates: list[tuple[float | None, str]] = [(_unit(site_dtype), site_dtype)]
    candidates += [(_unit(s.get("dtype")), str(s.get("dtype")))
                   for s in meta.settings.values()]
    candidates += [(u, "TF32" if u == _TF32 else "bfloat16 matmul") for u, _ in reduced(meta)]
    found = [(u, name) for u, name in candidates if u is not None]
    if not found:
        return math.inf, math.nan, site_dtype
    u_op, name = max(found, key=lambda item: item[0])
    u_acc = _unit("float64") if u_op <= 2.0**-52 else _unit("float32")
    assert u_acc is not None
    return _OPERAND_ROUNDINGS * u_op + _SUM_STEPS * u_acc, u_op, str(name)


def _entries(table: pd.DataFrame, first: pd.Series) -> list[tuple[pd.Series, float, str]]:
    """Where error enters: ``(row, its error, how it was seen)``; in order of preference
    when two tie."""
    found = [(row, row["rel_l2"], "source") for _, row in table[table["role"] == "source"]
             .iterrows()]
    if "local_rel_l2" in table:
        found += [(row, row["local_rel_l2"], "own") for _, row in
                  table[table["local_rel_l2"] > 0].iterrows()]
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


def _outputs(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the model's output tensors (every one, when it returns several)."""
    return table[(table["module"] == ROOT) & (table["call"] == 0) & (table["op"] == "")]


def _dependent(table: pd.DataFrame) -> str | None:
    """Where the independence test saw the compared rows move with the other samples."""
    row = first_dependent(table)
    if row is None:
        return None
    return f"'{row['site']}' ({row['module_type']})"


def _by_design(table: pd.DataFrame, meta: Meta) -> str | None:
    where = _dependent(table)
    there = "" if where is None else (
        f" The compared rows first depend on the other samples at {where}.")
    if meta.train_mode:
        return ("the model ran in train mode (allow_train=True): BatchNorm or Dropout make "
                "the runs differ by design." + (there if not meta.random_draws else ""))
    if meta.random_draws:
        return ("the model drew random numbers during its passes (allow_train=True): the "
                "runs differ by design.")
    apart = table[table["status"].isin(["missing_in_split", "missing_in_batched"])
                  & (table["op"] == "")]  # an op in one run only is another kernel path
    if not apart.empty:
        row = apart.iloc[0]
        return (f"the runs did not run the same modules: '{row['site']}' ran in one of "
                f"them only ({row['status']}); the model's control flow depends on the "
                f"batch.")
    return None


def _mixing(table: pd.DataFrame, meta: Meta) -> str | None:
    """Batch mixing found by the independence test, whatever its size."""
    row = first_dependent(table)
    if row is None:
        return None
    through = (meta.notes.get("independence") or {}).get("through") or []
    via = f", through {', '.join(repr(t) for t in through)}," if through else ""
    return (f"batch mixing: at '{row['site']}' ({row['module_type']}){via} the compared "
            f"samples' rows change when only the other samples change, the shapes kept "
            f"(rel_l2 {sci(row['others_rel_l2'])}), so each sample's result depends on the "
            f"other samples' values — a bug whatever its size. Check for a statistic over "
            f"the batch in eval mode, a wrong batch_dim, padding that is not masked, "
            f"activations quantized with a scale over the batch (dynamic quantization), or "
            f"routing or shapes that depend on the whole batch (capacity-limited experts).")


def _tested(meta: Meta) -> str:
    """How far the independence test backs a verdict of rounding: ``"independent"``,
    ``"inconclusive"`` or ``"untested"``."""
    found = meta.notes.get("independence")
    if not found or not found.get("ran"):
        return "untested"
    return "inconclusive" if found.get("noisy") else "independent"


def _truth(outputs: pd.DataFrame, meta: Meta) -> str | None:
    for _, out in outputs.iterrows():
        if "b_err_fp64" not in out or math.isnan(out["b_err_fp64"]):
            continue
        b, s = out["b_err_fp64"], out["a_err_fp64"]
        high, low = max(b, s), min(b, s)
        limit, _, _ = budget(out["dtype"], meta)
        if high > limit and (low == 0 or high / low > 100):
            a_name, b_name = meta.names
            worse, better = (b_name, a_name) if b > s else (a_name, b_name)
            return (f"against a float64 run of the same samples the {worse} is off by "
                    f"rel_l2 {sci(high)} and the {better} by {sci(low)}: floating "
                    f"point does not explain that. {_CHECK}")
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


def _units(error: float, u_op: float, name: str) -> str:
    """``, 7.5 units of float32 rounding`` (nothing for an infinite error)."""
    return "" if math.isinf(error) else f", {error / u_op:.3g} units of {name} rounding"


def _unmeasurable(tested: str) -> Verdict:
    why = ("its norms could not be computed (float64 values beyond about 1e±154, whose "
           "squares overflow or underflow)")
    if tested == "independent":
        return Verdict("rounding", (
            f"Verdict: rounding — no compared row moved when only the other samples "
            f"changed (independence test), so the runs differ because the batch's shape "
            f"differs; the size of the error is not known: {why}."))
    return Verdict("not rounding", (
        f"Verdict: not rounding — floating point cannot be shown to explain it: {why}, and "
        f"the independence test did not decide."))


def judge(table: pd.DataFrame, meta: Meta) -> Verdict:
    """The verdict on a comparison's table (see the module's documentation)."""
    reason = _by_design(table, meta)
    if reason is not None:
        return Verdict("not rounding", f"Verdict: not rounding — {reason}")
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return Verdict("not rounding", "Verdict: not rounding — nothing could be compared, "
                                       "so floating point cannot be shown to explain it.")
    reason = _mixing(table, meta)
    if reason is not None:
        return Verdict("not rounding", f"Verdict: not rounding — {reason}")
    diverged = ok[ok["mismatch"] > 0]
    if diverged.empty:
        noun = "site is" if len(ok) == 1 else f"{len(ok)} compared sites are"
        return Verdict("identical", f"Verdict: identical — {'the one' if len(ok) == 1 else 'all'}"
                                    f" {noun} bit-identical in both runs.")
    tested = _tested(meta)
    sized = _sized(ok, diverged, tested)
    worst: tuple[float, Any] | None = None
    entries = _entries(sized, sized[sized["mismatch"] > 0].iloc[0])
    for row, error, seen in entries:
        limit, u_op, name = budget(row["dtype"], meta)
        share = error / limit if limit > 0 else math.inf
        if not math.isnan(share) and (worst is None or share > worst[0]):
            worst = (share, (row, error, seen, limit, u_op, name))
    if worst is None:  # no size could be measured
        return _unmeasurable(tested)
    share, (row, error, seen, limit, u_op, name) = worst
    if share > 1:
        hint = _CHECK if tested != "independent" else (
            "No compared row moved when only the other samples changed (independence "
            "test), so look for a kernel that is wrong at one of the two batch sizes, or "
            "for lower precision than the runs' settings say.")
        return Verdict("not rounding", (
            f"Verdict: not rounding — {_subject(row, error, seen)}"
            f"{_units(error, u_op, name)}, far beyond the "
            f"{sci(limit)} a reordered sum can give. {hint}"))
    outputs = _outputs(table)
    reason = _truth(outputs, meta)
    if reason is not None:
        return Verdict("not rounding", f"Verdict: not rounding — {reason}")
    row, error, seen = entries[0]  # where the error enters first: a source, or the first
    limit, u_op, name = budget(row["dtype"], meta)  # divergent site
    cause = ("the batch size changes the order of operations" if not meta.runs
             else "the two configurations round differently")
    ending = {
        "independent": f"No compared row moved when only the other samples changed "
                       f"(independence test): not a bug; {cause}.",
        "inconclusive": "The independence test was inconclusive (the batched run is not "
                        "deterministic), so this rests on the size of the error alone.",
        "untested": "The independence test did not run, so this rests on the size of the "
                    "error alone."}[tested]
    return Verdict("rounding", (
        f"Verdict: rounding — {_subject(row, error, seen)}{_units(error, u_op, name)}, "
        f"within the {sci(limit)} "
        f"a reordered sum can give{_at_output(outputs, row)}. {ending}"))
