"""Assertions for test suites (pytest, unittest or a plain script): batch invariance,
gradient accumulation that matches one backward over the batch, and a comparison that
still matches a saved one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from divtrace.accumulation import compare_backward
from divtrace.backward.result import Backward
from divtrace.compare import compare
from divtrace.io import load
from divtrace.report.comparison import Comparison
from divtrace.report.diff import diff

__all__ = ["assert_accumulation_matches", "assert_batch_invariant", "assert_matches_saved"]


def _offending(result: Comparison) -> str:
    first = result.first_divergence
    if first is None:
        return ""
    return (f"\nFirst offending site: '{first['site']}' ({first['module_type']}): "
            f"mismatch {first['mismatch']:.3g}, rel_l2 {first['rel_l2']:.3g}.")


def assert_batch_invariant(model: nn.Module, x: Any, *, exact: bool = False,
                           rtol: float | None = None, atol: float | None = None,
                           **compare_options: Any) -> Comparison:
    """Compares ``model`` batched and split on ``x`` (:func:`divtrace.compare`) and passes
    when the runs are bit-identical, or — without ``exact`` — when the verdict is
    *rounding*. Otherwise raises ``AssertionError`` whose message is the summary and the
    first offending site. Returns the comparison.

    Example:
        >>> import torch, divtrace.testing
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
        >>> divtrace.testing.assert_batch_invariant(net, torch.randn(8, 4)).verdict in (
        ...     "identical", "rounding")
        True
    """
    compare_options.setdefault("progress", False)
    result = compare(model, x, rtol=rtol, atol=atol, **compare_options)
    verdict = result.verdict
    if verdict == "identical" or (verdict == "rounding" and not exact):
        return result
    wanted = "bit-identical runs" if exact else "bit-identical runs or rounding"
    raise AssertionError(f"divtrace: expected {wanted}, got {verdict}.\n"
                         f"{result.summary()}{_offending(result)}")


def assert_accumulation_matches(model: nn.Module, batch: Any, loss: Any, *, chunk: int,
                                exact: bool = False, **options: Any) -> Backward:
    """Compares one backward over ``batch`` with gradient accumulation over chunks of
    ``chunk`` rows (:func:`divtrace.compare_backward`, which takes ``options``) and passes
    when the loss and gradients are bit-identical, or — without ``exact`` — when the
    verdict is *rounding*. Otherwise (a wrong weighting of the chunks' losses, batch
    mixing) raises ``AssertionError`` whose message is the summary. Returns the result.

    Example:
        >>> import torch, divtrace.testing
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 2))
        >>> mse = lambda m, b: (m(b) ** 2).mean()
        >>> divtrace.testing.assert_accumulation_matches(net, torch.randn(8, 4), mse,
        ...                                              chunk=4).verdict.kind in (
        ...     "identical", "rounding")
        True
    """
    options.setdefault("progress", False)
    result = compare_backward(model, batch, loss, chunk=chunk, **options)
    kind = result.verdict.kind
    if kind == "identical" or (kind == "rounding" and not exact):
        return result
    wanted = "bit-identical gradients" if exact else "bit-identical gradients or rounding"
    raise AssertionError(f"divtrace: expected {wanted}, got {kind}.\n{result.summary()}")


def assert_matches_saved(result: Comparison, saved: Comparison | str | Path, *,
                         factor: float = 10.0, new_divergence: bool = False) -> None:
    """Passes when ``result`` behaves as the ``saved`` comparison (a regression check
    across torch, driver or GPU versions): the same sites with the same statuses, no
    site that was bit-identical now diverging (unless ``new_divergence``), and rel_l2
    nowhere more than ``factor`` times the saved one. Raises ``AssertionError`` naming
    every site that moved."""
    before = saved if isinstance(saved, Comparison) else load(saved)
    if not isinstance(before, Comparison):
        raise AssertionError(f"{saved} holds a {type(before).__name__}, not a Comparison")
    table = diff(before, result, factor=factor).table
    bad = table[table["change"].str.startswith(("status", "only in"))
                | ((table["change"] == "now diverges") & (not new_divergence))
                | (table["rel_l2_ratio"] > factor)]
    if bad.empty:
        return
    lines = [f"  '{r.site}': {r.change or f'rel_l2 ×{r.rel_l2_ratio:.3g}'}"
             for r in bad.head(12).itertuples()]
    more = "" if len(bad) <= 12 else f"\n  ... and {len(bad) - 12} more"
    raise AssertionError(f"divtrace: {len(bad)} site(s) no longer match the saved "
                         f"comparison:\n" + "\n".join(lines) + more)
