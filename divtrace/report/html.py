"""HTML for a :class:`~divtrace.Comparison`: Jupyter's view and a self-contained page.

Tables are rendered by pandas' ``Styler``; runs of bit-identical sites are folded into one
row, the first divergence is highlighted, and the full table sits folded below.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from divtrace.words import shown

if TYPE_CHECKING:
    from divtrace.explain.probe import Probe
    from divtrace.report.comparison import Comparison

__all__ = ["COMPACT", "compact", "escape", "fragment", "page", "png", "styled"]

escape = html.escape

CSS = """
.divtrace{font:13px/1.45 system-ui,sans-serif;max-width:1100px;margin:0 auto;color:#222}
.divtrace .verdict{font-size:15px;padding:8px 12px;border-left:5px solid #888;background:#f6f6f6}
.divtrace .verdict.rounding{border-color:#2a7}
.divtrace .verdict.identical{border-color:#27a}
.divtrace .verdict.not-rounding{border-color:#c33;background:#fff3f3}
.divtrace .summary{white-space:pre-line}
.divtrace .scroll{overflow-x:auto}
.divtrace table{border-collapse:collapse;font:12px/1.4 ui-monospace,monospace}
.divtrace th,.divtrace td{padding:2px 8px;border-bottom:1px solid #e4e4e4;text-align:right}
.divtrace th{background:#f3f3f3;position:sticky;top:0}
.divtrace td.col0,.divtrace td.col1{text-align:left}
.divtrace td.identical{color:#888}
.divtrace td.collapsed{color:#888;font-style:italic;text-align:left}
.divtrace td.first{background:#ffe08a;font-weight:bold}
.divtrace td.diverged{background:#fff6f0}
.divtrace td.skipped{color:#a33;font-style:italic}
.divtrace img{max-width:100%;height:auto;display:block;margin:12px 0}
.divtrace details{margin:12px 0}
.divtrace summary{cursor:pointer;color:#27a}
"""
#: The columns of the compact table (the explain options add the ones they show).
COMPACT = ("site", "module_type", "status", "role", "mismatch", "rel_l2", "max_abs",
            "growth")
_FOLD = 3  # runs of at least this many bit-identical sites become one row


def _text(value: Any, column: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        said = shown(column, value)
        return f"{value:.3g}" if said is value else str(said)
    return str(value)


def _kind(row: pd.Series, first: int | None) -> str:
    if row["status"] != "ok":
        return "skipped"
    if first is not None and row.name == first:
        return "first"
    return "identical" if row["mismatch"] == 0 else "diverged"


def compact(table: pd.DataFrame, first: int | None, columns: Sequence[str]
            ) -> tuple[pd.DataFrame, list[str]]:
    """The table's rows with runs of bit-identical sites folded, and each row's kind."""
    kinds = [_kind(row, first) for _, row in table.iterrows()]
    rows: list[dict[str, Any]] = []
    out_kinds: list[str] = []
    i = 0
    while i < len(table):
        j = i
        while j < len(table) and kinds[j] == "identical":
            j += 1
        if j - i >= _FOLD:
            names = table["site"]
            rows.append(dict.fromkeys(columns, "") | {
                "site": f"⋯ {j - i} bit-identical sites: {names.iloc[i]} … "
                        f"{names.iloc[j - 1]}"})
            out_kinds.append("collapsed")
            i = j
            continue
        end = max(j, i + 1)
        for k in range(i, end):
            rows.append(table.iloc[k][list(columns)].to_dict())
            out_kinds.append(kinds[k])
        i = end
    return pd.DataFrame(rows, columns=list(columns)), out_kinds


def styled(frame: pd.DataFrame, kinds: list[str]) -> str:
    """``frame`` as an HTML table through pandas' Styler, each row's cells classed by kind."""
    text = frame.astype(object).apply(lambda column: column.map(
        lambda value: _text(value, str(column.name))))
    classes = pd.DataFrame([[kind] * len(frame.columns) for kind in kinds],
                           index=frame.index, columns=frame.columns)
    style = (text.style.hide(axis="index").set_td_classes(classes)
             .set_table_attributes('class="sites"'))
    return f'<div class="scroll">{style.to_html()}</div>'


def _tables(result: Comparison, probes: Sequence[type[Probe]]) -> str:
    table = result.table
    first = result.first_divergence
    at = None if first is None else int(first.name)
    shown = [*COMPACT, *(c for probe in probes for c in probe.spec.shown if c in table)]
    folded, kinds = compact(table, at, shown)
    every = [_kind(row, at) for _, row in table.iterrows()]
    return (f"{styled(folded, kinds)}<details><summary>All {len(table)} sites, every "
            f"column</summary>{styled(table, every)}</details>")


def said(summary: str, verdict: str | None = None) -> str:
    """A summary as HTML: its verdict line (the one that opens with "Verdict:", else the
    first) coloured by ``verdict`` (``"identical"``, ``"rounding"``, ``"not rounding"``;
    plain when None), before the other lines in order."""
    lines = summary.splitlines() or [""]
    at = next((i for i, line in enumerate(lines) if line.startswith("Verdict:")), 0)
    kind = "" if verdict is None else " " + verdict.replace(" ", "-")
    rest = lines[:at] + lines[at + 1:]
    return (f'<p class="verdict{kind}">{escape(lines[at])}</p>'
            f'<p class="summary">{escape(chr(10).join(rest))}</p>')


def _words(result: Comparison) -> str:
    return said(result.summary(), result.verdict)


def fragment(result: Comparison, probes: Sequence[type[Probe]] = ()) -> str:
    """The HTML that Jupyter shows for a comparison."""
    return (f'<style>{CSS}</style><div class="divtrace">{_words(result)}'
            f"{_tables(result, probes)}</div>")


def shown_result(title: str, summary: str, frame: pd.DataFrame,
                 verdict: str | None = None) -> str:
    """The HTML that Jupyter shows for a result other than a comparison (a generation, a
    backward comparison, a sweep): its title (none: ""), its summary and one table, in
    the comparison's style."""
    head = f"<h4>{escape(title)}</h4>" if title else ""
    return (f'<style>{CSS}</style><div class="divtrace">{head}'
            f"{said(summary, verdict)}{_plain(frame)}</div>")


def drawn(draw: Callable[[Any], object], size: tuple[float, float]) -> str:
    """``draw(ax)`` on a new figure of ``size`` inches, as an <img> of base64 PNG."""
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=size)
    try:
        draw(ax)
        image = png(figure)
    finally:
        plt.close(figure)
    return f"<img style='max-width:100%' src='data:image/png;base64,{image}'>"


def result_page(title: str, shown: str, parts: Sequence[str] = ()) -> str:
    """A self-contained HTML page of a result other than a comparison: its title, what
    Jupyter shows of it, then ``parts`` (pictures, sections) in order."""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{escape(title)}</title></head><body><main class='divtrace'>"
            f"<h1>{escape(title)}</h1>{shown}{''.join(parts)}</main></body></html>")


def section(title: str, frame: pd.DataFrame) -> str:
    """A titled table of a result page."""
    return f"<h3>{escape(title)}</h3>{_plain(frame)}"


def _plain(frame: pd.DataFrame) -> str:
    """A table as HTML, missing values (NaN, ``pd.NA``) left blank and numbers to six
    significant digits (a non-zero one never reads 0)."""
    def cell(value: Any) -> str:
        if value is None or (not isinstance(value, str) and pd.isna(value)):
            return ""
        if isinstance(value, float):
            return f"{value:.6g}"
        return str(value)

    return pd.DataFrame({c: [cell(v) for v in frame[c].tolist()] for c in frame.columns},
                        columns=frame.columns).to_html(index=False)


def png(figure: object) -> str:
    """A matplotlib figure as base64 PNG, for an <img> of a self-contained page."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _figures(result: Comparison) -> str:
    from matplotlib.figure import Figure  # no pyplot: the user's backend stays as it is

    n_leaf = int(result.table["leaf"].sum())
    width = min(16.0, max(8.0, 0.3 * n_leaf))
    drawings: list[tuple[Callable[..., Any], float, str]] = [
        (result.plot, 4.5, "rel_l2 by depth: where the runs part and how it grows"),
        (result.plot_samples, 1.4 + 0.22 * min(len(result.meta.samples), 40),
         "rel_l2 per sample and site")]
    table = result.table
    if not result.sources.empty:
        adds = int((table["adds_error"] == True).sum()) if "adds_error" in table else 0  # noqa: E712
        count = len(result.sources) + adds
        drawings.append((result.plot_sources, 1.2 + 0.5 * min(count, 16),
                         "where error enters"))
    images = []
    for draw, height, caption in drawings:
        figure = Figure(figsize=(width, min(height, 10.0)))
        draw(ax=figure.subplots())
        images.append(f'<figure><img alt="{escape(caption)}" '
                      f'src="data:image/png;base64,{png(figure)}">'
                      f"<figcaption>{escape(caption)}</figcaption></figure>")
    return "".join(images)


def _said(value: Any) -> str:
    """A setting as a person reads it: lists joined, mappings as ``key=value``."""
    if value is None or value == {} or value == []:
        return "–"
    if isinstance(value, dict):
        return "; ".join(k if v in (None, {}, []) else f"{k}={_said(v)}"
                         for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(_said(v) for v in value)
    return str(value)


def _pairs(title: str, values: dict[str, Any]) -> str:
    frame = pd.DataFrame({"setting": list(values), "value": [_said(v) for v in values.values()]})
    return f"<h2>{escape(title)}</h2>{styled(frame, ['plain'] * len(frame))}"


#: Flags that matter on a CUDA device only.
_CUDA_ONLY = ("cudnn", "deterministic", "benchmark", "tf32_matmul", "tf32_cudnn")


def _runs(meta: dict[str, Any]) -> dict[str, str]:
    """Each run: which it is (batched, split), its settings, the flags that apply where it
    ran, and how its passes ran."""
    rows = {}
    for which, name in zip(("a", "b"), meta["names"], strict=True):
        run = meta["settings"].get(which, {})
        on_cpu = str(run.get("device", "")).startswith("cpu")
        flags = [f"{k}={v}" for k, v in run.items()
                 if k != "label" and not (on_cpu and k in _CUDA_ONLY)]
        if which in meta["graphed"]:
            flags.append(_graph_words(meta["graphed"][which]))
        rows[f"{which}: {name} ({run.get('label')})"] = ", ".join(flags)
    return rows


def _environment(env: dict[str, Any]) -> dict[str, Any]:
    """The environment, saying which versions are those torch was built with (no GPU)."""
    if env.get("gpus"):
        return env
    shown = {k: v for k, v in env.items() if k not in ("driver", "gpus")}
    for key in ("cuda", "cudnn"):
        if shown.get(key) is not None:
            shown[key] = f"{shown[key]} (what torch was built with; no GPU on this machine)"
    return shown


def _graph_words(outcome: dict[str, Any]) -> str:
    """How a chunked run's passes ran, in words (``meta.graphed``)."""
    if outcome.get("replayed"):
        lanes = outcome.get("lanes") or 1
        words = (f"{outcome['replayed']} of {outcome['passes']} passes replayed from a CUDA "
                 f"graph{f', {lanes} side by side' if lanes > 1 else ''} (pool "
                 f"{outcome['pool_bytes'] / 2**20:.0f} MiB), "
                 f"{'each ' if lanes > 1 else ''}checked bit for bit against the eager "
                 f"first pass")
        return words if outcome.get("reason") is None else f"{words}; {outcome['reason']}"
    return f"passes eager ({outcome.get('reason')})"


def page(result: Comparison, title: str, probes: Sequence[type[Probe]] = ()) -> str:
    """A self-contained HTML page: verdict and summary, the plots, the sites (bit-identical
    runs folded, every column below), the settings of each run and the environment."""
    meta = result.meta.to_dict()
    settings = {k: v for k, v in meta.items()
                if k not in ("flips", "environment", "settings", "notes", "graphed", "names",
                             "runs")}
    for key in ("rtol", "atol"):
        if settings.get(key) is None:
            settings[key] = "the dtype's default (torch.testing.assert_close's)"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
        f"<main class='divtrace'><h1>{escape(title)}</h1>{_words(result)}"
        f"{_figures(result)}<h2>Sites</h2>{_tables(result, probes)}"
        f"{_pairs('Runs', _runs(meta))}{_pairs('Environment', _environment(meta['environment']))}"
        f"{_pairs('Settings', settings)}</main></body></html>")
