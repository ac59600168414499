"""Words and HTML for a :class:`~divtrace.Comparison`: the summary and the reports."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from divtrace.metrics import tolerances

if TYPE_CHECKING:
    from divtrace.comparison import Comparison

__all__ = ["escape", "html_fragment", "html_page", "summary"]

escape = html.escape


def _fmt(value: float, spec: str = ".3g") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else (
        format(value, spec))


def _output_sentences(result: Comparison) -> list[str]:
    out = result.output
    if out is None or out["status"] != "ok":
        return []
    meta = result.meta
    lines = []
    first = result.first_divergence
    if first is not None and out["mismatch"] > 0:
        factor = out["rel_l2"] / first["rel_l2"] if first["rel_l2"] > 0 else math.nan
        grown = "" if first["site"] == out["site"] or math.isnan(factor) else (
            f" ({factor:.3g}× that of the first divergent site)")
        lines.append(
            f"By the model's output '{out['site']}', rel_l2 is {out['rel_l2']:.3g}{grown}; "
            f"{out['mismatch']:.1%} of its elements are not bit-identical, max "
            f"{out['max_abs']:.3g} absolute, {_fmt(out['max_ulp'], '.0f')} ULP.")
    dtype = getattr(torch, out["dtype"], None)
    if isinstance(dtype, torch.dtype):
        rtol, atol = tolerances(dtype, meta["rtol"], meta["atol"])
        which = "the given" if meta["rtol"] is not None or meta["atol"] is not None else (
            f"torch.testing.assert_close's default {out['dtype']}")
        verdict = "passes" if out["exceed"] == 0 else "fails"
        beyond = "" if out["exceed"] == 0 else (
            f": {out['exceed']:.2%} of its elements are beyond them")
        lines.append(f"The output {verdict} the closeness test at {which} tolerances "
                     f"(rtol={rtol:.3g}, atol={atol:.3g}){beyond}.")
    flips = meta.get("flips", {}).get(out["site"])
    if flips is not None:
        classes = out["shape"].strip("()").split(",")[-1].strip()
        lines.append(
            f"Read as class logits ({classes} columns), the output's argmax differs "
            f"between the runs for {sum(flips)} of {len(flips)} samples.")
    return lines


def _listed(rows: pd.DataFrame, limit: int = 6) -> str:
    names = [f"'{r.site}' ({r.module_type})" for r in rows.head(limit).itertuples()]
    more = "" if len(rows) <= limit else f" and {len(rows) - limit} more"
    return ", ".join(names) + more


def _role_sentences(result: Comparison) -> list[str]:
    table = result.table
    sources = result.sources
    if sources.empty:
        return []
    carriers = table[table["role"] == "carrier"]
    after = ("No divergent leaf site follows." if carriers.empty else
             f"{len(carriers)} divergent leaf site(s) after them are carriers: they pass "
             f"on, and may amplify, the error they received.")
    lines = [f"Source(s) of divergence (input bit-identical in both runs, output not): "
             f"{_listed(sources)}. {after}"]
    unknown = table[table["role"] == "unknown"]
    if not unknown.empty:
        lines.append(f"For {_listed(unknown, 3)} the input could not be traced (made outside "
                     f"any module and then changed in place), so the role is unknown.")
    return lines


def _explain_sentences(result: Comparison) -> list[str]:
    from divtrace.profiling import kernel_family

    meta, table, lines = result.meta, result.table, []
    ok = table[table["status"] == "ok"]
    if meta.get("local") and "local_rel_l2" in table:
        sources = result.sources
        carriers = ok[ok["role"] == "carrier"]
        if not sources.empty:
            own = ", ".join(f"'{r.site}' {r.local_rel_l2:.3g}"
                            for r in sources.head(4).itertuples())
            lines.append(f"Replayed on identical inputs with the batched run's kernels, the "
                         f"sources add on their own (local rel_l2): {own}.")
        if not carriers.empty and carriers["local_rel_l2"].notna().any():
            worst = carriers.loc[carriers["local_rel_l2"].idxmax()]
            lines.append(f"The carriers add at most local rel_l2 {worst['local_rel_l2']:.3g} "
                         f"(at '{worst['site']}').")
        amp = ok["amplification"].replace(math.inf, math.nan).dropna()
        if not amp.empty:
            top = ok.loc[amp.idxmax()]
            lines.append(f"The largest amplification of the incoming error is "
                         f"{top['amplification']:.3g}× at '{top['site']}' ({top['module_type']}).")
    out = result.output
    if meta.get("truth") and out is not None and not math.isnan(out.get("batched_err_fp64",
                                                                            math.nan)):
        b, s_ = out["batched_err_fp64"], out["split_err_fp64"]
        low, high = min(b, s_), max(b, s_)
        if high == 0 or (low > 0 and high / low < 10):
            verdict = ("neither run is closer to the exact answer: both sit within the "
                       "rounding that this dtype incurs anyway")
        else:
            worse, better = ("batched", "split") if b > s_ else ("split", "batched")
            factor = "infinitely" if low == 0 else f"{high / low:.3g}×"
            verdict = f"the {worse} run is {factor} further from it than the {better} run"
        lines.append(f"Against a float64 run of the same samples, the output of the batched "
                     f"run is off by rel_l2 {b:.3g} and that of the split run by {s_:.3g}: "
                     f"{verdict}.")
    if meta.get("repeat") and "noise_mismatch" in table:
        noisy = ok[ok["noise_mismatch"] > 0]
        times = f"{meta['repeat']} more time(s)"
        if noisy.empty:
            lines.append(f"Repeating the batched run {times} gave bit-identical results: the "
                         f"divergence comes from the batch size, not from run-to-run "
                         f"nondeterminism.")
        else:
            lines.append(f"The batched run is not deterministic: repeated {times}, it "
                         f"differed from itself at {len(noisy)} site(s), first at "
                         f"'{noisy.iloc[0]['site']}' (rel_l2 up to "
                         f"{noisy['noise_rel_l2'].max():.3g}); part of the divergence is "
                         f"run-to-run noise.")
    if meta.get("kernels") and "kernels_batched" in table:
        for r in result.sources.head(4).itertuples():
            batched = [kernel_family(k) for k in str(r.kernels_batched).split("; ") if k]
            split = [kernel_family(k) for k in str(r.kernels_split).split("; ") if k]
            if not batched and not split:
                continue
            only_b = [k for k in dict.fromkeys(batched) if k not in split]
            only_s = [k for k in dict.fromkeys(split) if k not in batched]
            if not only_b and not only_s:
                lines.append(f"'{r.site}' launched the same kinds of kernel in both runs "
                             f"({', '.join(dict.fromkeys(batched))}): the difference comes "
                             f"from how they split the work.")
            else:
                lines.append(f"'{r.site}' ({r.module_type}): the batched run launched "
                             f"{', '.join(only_b) or 'nothing else'}, where the split run "
                             f"launched {', '.join(only_s) or 'nothing else'}.")
    return lines


def summary(result: Comparison) -> str:
    """Plain sentences on where the runs part, how far it grows, and what it means."""
    meta = result.meta
    table = result.table
    ok = table[table["status"] == "ok"]
    samples = meta["samples"]
    shown = samples if len(samples) <= 8 else [*samples[:8], "..."]
    chunking = "per sample" if meta["chunk"] == 1 else f"in chunks of {meta['chunk']}"
    if meta.get("runs"):
        first, second = meta["runs"]
        head = f"Run b ({second}) vs run a ({first}), B={meta['batch_size']}"
    else:
        head = f"Batched run (B={meta['batch_size']}) vs split run ({chunking})"
    lines = [f"{head}, {len(samples)} compared sample(s) {shown}, {len(ok)} compared sites."]
    if meta["train_mode"]:
        lines.append(
            "The model ran in train mode (allow_train=True): BatchNorm or Dropout make "
            "the runs differ for reasons that are not numerical.")
    identical = int((ok["mismatch"] == 0).sum())
    first = result.first_divergence
    if first is None:
        every = "The 1 compared site is" if len(ok) == 1 else f"All {len(ok)} compared sites are"
        lines.append(f"{every} bit-identical: the batched and split runs agree exactly.")
    else:
        position = int((ok.index < first.name).sum())
        lines.append(
            f"Divergence first appears at '{first['site']}' ({first['module_type']}), "
            f"after {position} bit-identical site(s): {first['mismatch']:.1%} of its "
            f"elements differ, rel_l2 {first['rel_l2']:.3g}, max "
            f"{_fmt(first['max_ulp'], '.0f')} ULP.")
        lines.append(f"{identical} of {len(ok)} compared sites are bit-identical.")
    lines.extend(_role_sentences(result))
    lines.extend(_output_sentences(result))
    lines.extend(_explain_sentences(result))
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
        lines.append(f"{len(skipped)} site(s) could not be compared: {listed}{more}.")
    return "\n".join(lines)


_CSS = """
<style>
.divtrace table{border-collapse:collapse;font:12px/1.4 monospace}
.divtrace th,.divtrace td{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}
.divtrace td.name,.divtrace th.name{text-align:left}
.divtrace tr.identical td{color:#777}
.divtrace tr.first td{background:#ffe08a;font-weight:bold}
.divtrace tr.skipped td{color:#a33;font-style:italic}
.divtrace p.summary{font:13px/1.5 sans-serif;white-space:pre-line}
</style>
"""
_SHOWN = ("site", "module_type", "status", "role", "shape", "dtype", "mismatch", "rel_l2",
          "max_abs", "max_ulp", "cosine", "growth")
#: Columns of the explain options, shown when the comparison has them.
_SHOWN_IF_THERE = ("local_rel_l2", "amplification", "batched_err_fp64", "split_err_fp64",
                   "noise_mismatch", "kernels_differ")


def _cell(column: str, value: object) -> str:
    if column in ("mismatch", "noise_mismatch") and isinstance(value, float) and (
            not math.isnan(value)):
        return f"{value:.1%}"
    if column == "max_ulp" and isinstance(value, float):
        return _fmt(value, ".0f")
    if column == "cosine" and isinstance(value, float):
        return _fmt(value, ".9f")
    if isinstance(value, float):
        return _fmt(value)
    return escape(str(value))


def table_html(result: Comparison) -> str:
    """The table as HTML: bit-identical rows marked, the first divergence highlighted."""
    table = result.table
    first = result.first_divergence
    shown = [*_SHOWN, *(c for c in _SHOWN_IF_THERE if c in table)]
    head = "".join(
        f'<th class="{"name" if c in ("site", "module_type") else ""}">{c}</th>'
        for c in shown)
    body = []
    for index, row in table.iterrows():
        if row["status"] != "ok":
            cls, mark = "skipped", ""
        elif first is not None and index == first.name:
            cls, mark = "first", " ◀ first divergence"
        elif row["mismatch"] == 0:
            cls, mark = "identical", " ≡"
        else:
            cls, mark = "diverged", ""
        cells = "".join(
            f'<td class="{"name" if c in ("site", "module_type") else ""}">'
            f'{_cell(c, row[c])}{mark if c == "site" else ""}</td>' for c in shown)
        body.append(f'<tr class="{cls}">{cells}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def html_fragment(result: Comparison) -> str:
    """The HTML that Jupyter shows for a comparison."""
    return (f'{_CSS}<div class="divtrace"><p class="summary">{escape(result.summary())}'
            f"</p>{table_html(result)}</div>")


def _png(figure: object) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def html_page(result: Comparison, title: str) -> str:
    """A self-contained HTML page: summary, snowball plot, sample heatmap, table."""
    from matplotlib.figure import Figure  # no pyplot: the user's backend stays as it is

    images = []
    n_leaf = int(result.table["leaf"].sum())
    width = min(24.0, max(8.0, 0.35 * n_leaf))
    drawings: list[tuple[Callable[..., Any], float]] = [
        (result.plot, 4.5),
                (result.plot_samples, 1.2 + 0.25 * len(result.meta["samples"]))]
    if not result.sources.empty:
        drawings.append((result.plot_sources, 1.5 + 0.8 * min(len(result.sources), 12)))
    for draw, height in drawings:
        fig = Figure(figsize=(width, min(height, 12.0)))
        draw(ax=fig.subplots())
        images.append(f'<img alt="plot" src="data:image/png;base64,{_png(fig)}">')
    meta = pd.Series(result.meta).drop(labels=["flips"], errors="ignore")
    settings = "".join(f"<tr><td class='name'>{escape(str(k))}</td>"
                       f"<td class='name'>{escape(str(v))}</td></tr>" for k, v in meta.items())
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"{_CSS}</head><body><div class='divtrace'><h1>{escape(title)}</h1>"
        f"<p class='summary'>{escape(result.summary())}</p>{''.join(images)}"
        f"<h2>Sites</h2>{table_html(result)}<h2>Settings</h2><table>{settings}</table>"
        f"</div></body></html>")
