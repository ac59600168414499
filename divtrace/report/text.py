"""The summary: plain sentences on where the runs part, how far it grows, what it means."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd
import torch

from divtrace.explain.probe import Judged
from divtrace.explain.rounding import reduced
from divtrace.measure.elements import ALLCLOSE, NEAR_ZERO
from divtrace.measure.stats import tolerances
from divtrace.report.verdict import judge
from divtrace.words import percent, sci, the

if TYPE_CHECKING:
    from divtrace.explain.probe import Probe
    from divtrace.report.comparison import Comparison
    from divtrace.report.meta import Meta

__all__ = ["summary"]


def _output_sentences(result: Comparison) -> list[str]:
    out = result.output
    if out is None or out["status"] != "ok":
        return []
    meta = result.meta
    lines = []
    first = result.first_divergence
    if first is not None and out["mismatch"] > 0:
        factor = out["rel_l2"] / first["rel_l2"] if 0 < first["rel_l2"] < math.inf else (
            math.nan)
        grown = "" if first["site"] == out["site"] or not 0 < factor < math.inf or (
            2 / 3 < factor < 1.5) else f" ({factor:.3g}× that of the first divergent site)"
        lines.append(
            f"At the output, rel_l2 is {sci(out['rel_l2'])}{grown}; "
            f"{percent(out['mismatch'])} of its elements are not bit-identical (largest "
            f"difference {sci(out['max_abs'])}).")
    dtype = getattr(torch, out["dtype"], None)
    if isinstance(dtype, torch.dtype):
        rtol, atol = tolerances(dtype, meta.rtol, meta.atol)
        which = "the given" if meta.rtol is not None or meta.atol is not None else (
            f"torch.testing.assert_close's default {out['dtype']}")
        verdict = "passes" if out["exceed"] == 0 else "fails"
        beyond = "" if out["exceed"] == 0 else (
            f": {percent(out['exceed'])} of its elements are beyond them")
        lines.append(f"The output {verdict} the closeness test at {which} tolerances "
                     f"(rtol={rtol:.3g}, atol={atol:.3g}){beyond}.")
        view = meta.notes.get("output_elements", {}).get(out["site"])
        if view is not None and out["mismatch"] > 0:
            lines.append(_elementwise(view, out, rtol, atol, meta.names))
            own = (ALLCLOSE[0] if meta.rtol is None else meta.rtol,
                   ALLCLOSE[1] if meta.atol is None else meta.atol)
            if own != (rtol, atol) and "beyond_allclose" in view:
                lines.append(_beyond(view, own))
    flips = meta.flips.get(out["site"])
    if flips is not None:
        classes = out["shape"].strip("()").split(",")[-1].strip()
        lines.append(
            f"Read as class logits ({classes} columns), the output's argmax differs "
            f"between the runs for {sum(flips)} of {len(flips)} samples.")
    return lines


def _beyond(view: dict[str, float], own: tuple[float, float]) -> str:
    """What ``torch.allclose`` with its own defaults for what was not given says."""
    beyond, near = int(view["beyond_allclose"]), int(view["beyond_allclose_near_zero"])
    where = "" if not beyond else (
        ", all of them near zero" if near == beyond else ", all of them away from zero"
        if not near else f", {near} of them near zero")
    return (f"With torch.allclose's own defaults for what was not given (rtol={own[0]:.3g}, "
            f"atol={own[1]:.3g}), {beyond} of {int(view['finite'])} elements are beyond it"
            f"{where}.")


def _elementwise(view: dict[str, float], out: pd.Series, rtol: float, atol: float,
                 names: tuple[str, str]) -> str:
    """The output element by element, as ``torch.allclose`` judges it, against what the
    norm-based figure says."""
    beyond, finite = int(view["beyond"]), int(view["finite"])
    near, largest = int(view["beyond_near_zero"]), view["largest"]
    pair = "batched, split" if names == ("split run", "batched run") else "b, a"
    head = (f"Element by element (as torch.allclose({pair}, rtol={rtol:.3g}, "
            f"atol={atol:.3g}) judges), {beyond} of {finite} elements are beyond the "
            f"tolerance")
    if beyond and near == beyond:
        head += (f", all of them near zero (|value| at most {NEAR_ZERO:g} of the output's "
                 f"largest, {sci(largest)}), where relative error has no meaning")
    elif near:
        head += (f"; {near} of them lie near zero (|value| at most {NEAR_ZERO:g} of the "
                 f"output's largest, {sci(largest)}), where relative error has no meaning")
    elif beyond:
        head += (f", all of them away from zero (|value| above {NEAR_ZERO:g} of the output's "
                 f"largest, {sci(largest)})")
    rel = view["max_rel"]
    worst = (f"The largest element-wise relative difference is {rel:.3g} ({percent(rel)}), "
             f"where {the(names[0])} has {view['a_value']:.8g} and "
             f"{the(names[1])} {view['b_value']:.8g}"
             + (" (near zero)" if abs(view["a_value"]) <= NEAR_ZERO * largest else "")
             if rel > 0 else
             "No element differs relative to a non-zero value")
    return (f"{head}. {worst}; measured over the whole output instead, the difference is "
            f"rel_l2 {sci(out['rel_l2'])}.")


def _caveats(result: Comparison, ok: pd.DataFrame) -> list[str]:
    """What makes the runs differ by design, and what could not be compared at all."""
    meta, lines = result.meta, []
    if meta.train_mode:
        lines.append(
            f"The model ran in train mode (allow_train=True): {meta.mixers()} make "
            f"the runs differ for reasons that are not numerical.")
    if meta.random_draws:
        lines.append(
            "The model drew random numbers during its passes (allowed by allow_train=True): "
            "the runs differ for reasons that are not numerical.")
    precision = reduced(meta)
    if precision:
        lines.append(
            f"Reduced precision is in force: {'; '.join(name for _, name in precision)} "
            f"(about {min(-math.log2(2 * u) for u, _ in precision):.0f} bits of mantissa "
            f"instead of float32's 23), so differences near "
            f"{sci(max(u for u, _ in precision), 1)} relative are ordinary rounding there.")
    if meta.output_type is not None:
        lines.append(f"The model's output (a {meta.output_type}) holds no tensor, so it "
                     f"could not be compared.")
    if ok.empty:
        why = ("see why below" if not result.table.empty
               else "no observed module returned a tensor")
        lines.append(f"No site could be compared: {why}.")
    return lines


def summary(result: Comparison, probes: Sequence[type[Probe]] = ()) -> str:
    """Plain sentences on where the runs part, how far it grows, and what it means; the
    ``probes`` that explain the comparison add theirs."""
    meta = result.meta
    table = result.table
    ok = table[table["status"] == "ok"]
    samples = list(meta.samples)
    shown = (", ".join(map(str, samples)) if len(samples) <= 8 else
             f"{', '.join(map(str, samples[:4]))}, ..., {samples[-1]}")
    chunking = "per sample" if meta.a_chunk == 1 else f"in chunks of {meta.a_chunk}"
    if meta.runs:
        run_a, run_b = meta.runs
        head = f"Run b ({run_b}) vs run a ({run_a}), B={meta.batch_size}"
    else:
        head = f"Batched run (B={meta.batch_size}) vs split run ({chunking})"
    judged = Judged(table, meta)
    explained = [probe.explain(judged) for probe in probes]  # once each, for both uses
    lines = [judge(table, meta, probes, explained).sentence,
             f"{head}, {len(samples)} compared sample(s) [{shown}], {len(ok)} compared sites."]
    lines.extend(_caveats(result, ok))
    identical = int((ok["mismatch"] == 0).sum())
    first = result.first_divergence
    if first is None and not ok.empty:
        every = "The 1 compared site is" if len(ok) == 1 else f"All {len(ok)} compared sites are"
        agree = ("the batched and split runs agree" if meta.names == ("split run", "batched run")
                 else "the two runs agree")
        lines.append(f"{every} bit-identical: {agree} exactly.")
    elif first is not None:
        position = int((ok.index < first.name).sum())
        before = ("at the first compared site" if position == 0 else
                  f"after {position} bit-identical site{'s' * (position > 1)}")
        lines.append(
            f"Divergence first appears at '{first['site']}' ({first['module_type']}), "
            f"{before}: {percent(first['mismatch'])} of its elements differ, rel_l2 "
            f"{sci(first['rel_l2'])}.")
        lines.append(f"{identical} of {len(ok)} compared sites are bit-identical.")
    said = [(probe.spec.leads, e.sentences) for probe, e in zip(probes, explained, strict=True)]
    lines.extend(line for leads, sentences in said if leads for line in sentences)
    lines.extend(_output_sentences(result))
    lines.extend(line for leads, sentences in said if not leads for line in sentences)
    nonfinite = ok[ok["nonfinite"] > 0]
    if not nonfinite.empty:
        lines.append(
            f"Non-finite values (NaN or inf, in either run) at {len(nonfinite)} site(s), "
            f"first at '{nonfinite.iloc[0]['site']}'; the error figures leave them out.")
    skipped = table[table["status"] != "ok"]
    if not skipped.empty:
        listed = ", ".join(f"'{s}' ({st})" for s, st in
                           zip(skipped["site"][:6], skipped["status"][:6], strict=True))
        more = "" if len(skipped) <= 6 else f" and {len(skipped) - 6} more"
        lines.append(f"{len(skipped)} site(s) could not be compared: {listed}{more}. "
                     + _statuses(skipped, meta, ok.empty))
    return "\n".join(lines)


def _statuses(skipped: pd.DataFrame, meta: Meta, none_ok: bool) -> str:
    """What each status among ``skipped`` means, in words; for a batch dimension that no
    compared site had, the question whether ``batch_dim`` is right."""
    b, a = meta.names[1], meta.names[0]
    meaning = {
        "missing_in_split": f"only the {b} reached the site",
        "missing_in_batched": f"only the {a} reached the site",
        "partial_in_split": f"the {a} reached it for some compared samples only",
        "unbatched": (f"the tensor has no dimension of size B={meta.batch_size} at "
                      f"batch_dim={meta.batch_dim}"),
        "shape_mismatch": "its rows have other shapes in the two runs",
        "dtype_mismatch": "its dtypes differ between the runs",
        "nested": "a nested tensor, each sample of its own shape",
        "not_per_sample": "a field of a PackedSequence, not rows per sample",
        "not_per_token": "a token layout's tensor without an axis of the pass's tokens",
    }
    said = [f"{status}: {meaning[status]}" for status in dict.fromkeys(skipped["status"])
            if status in meaning]
    text = "Status " + "; status ".join(said) if said else ""
    if none_ok and (skipped["status"] == "unbatched").all():
        return text + "; no site had one: is batch_dim right?"
    return text + "." if text else ""
