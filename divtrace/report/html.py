"""HTML for a :class:`~divtrace.Comparison`: Jupyter's view and a self-contained page."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from divtrace.words import fmt

if TYPE_CHECKING:
    from divtrace.explain.probe import Probe
    from divtrace.report.comparison import Comparison

__all__ = ["escape", "fragment", "page", "table_html"]

escape = html.escape

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


def _cell(column: str, value: object) -> str:
    if column in ("mismatch", "noise_mismatch") and isinstance(value, float) and (
            not math.isnan(value)):
        return f"{value:.1%}"
    if column == "max_ulp" and isinstance(value, float):
        return fmt(value, ".0f")
    if column == "cosine" and isinstance(value, float):
        return fmt(value, ".9f")
    if isinstance(value, float):
        return fmt(value)
    return escape(str(value))


def table_html(result: Comparison, probes: Sequence[type[Probe]] = ()) -> str:
    """The table as HTML: bit-identical rows marked, the first divergence highlighted; the
    columns the ``probes`` show, after the main ones."""
    table = result.table
    first = result.first_divergence
    shown = [*_SHOWN, *(c for probe in probes for c in probe.shown if c in table)]
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


def fragment(result: Comparison, probes: Sequence[type[Probe]] = ()) -> str:
    """The HTML that Jupyter shows for a comparison."""
    return (f'{_CSS}<div class="divtrace"><p class="summary">{escape(result.summary())}'
            f"</p>{table_html(result, probes)}</div>")


def _png(figure: object) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")  # type: ignore[attr-defined]
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def page(result: Comparison, title: str, probes: Sequence[type[Probe]] = ()) -> str:
    """A self-contained HTML page: summary, snowball plot, sample heatmap, table."""
    from matplotlib.figure import Figure  # no pyplot: the user's backend stays as it is

    images = []
    n_leaf = int(result.table["leaf"].sum())
    width = min(24.0, max(8.0, 0.35 * n_leaf))
    drawings: list[tuple[Callable[..., Any], float]] = [
        (result.plot, 4.5),
        (result.plot_samples, 1.2 + 0.25 * len(result.info.samples))]
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
        f"<h2>Sites</h2>{table_html(result, probes)}<h2>Settings</h2><table>{settings}</table>"
        f"</div></body></html>")
