"""``compare_models()``: two models on one input, site by site — a re-implementation, a
converted checkpoint or a quantized copy against the original."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from divtrace.compare import compare
from divtrace.errors import DivtraceTypeError
from divtrace.explain.registry import Explain
from divtrace.plan.other import OtherModel, names_checked
from divtrace.plan.runs import Resources, Run
from divtrace.plan.selection import ModuleSpec, refuse_mixing
from divtrace.report.comparison import Comparison

__all__ = ["compare_models"]


def compare_models(
    a: nn.Module,
    b: nn.Module,
    x: Any,
    *,
    names: Mapping[str, str] | None = None,
    samples: Iterable[int] | None = None,
    batch_dim: int = 0,
    modules: ModuleSpec = None,
    ops: bool | str = False,
    explain: Explain = None,
    rtol: float | None = None,
    atol: float | None = None,
    allow_train: bool = False,
    resources: Resources | None = None,
    progress: bool = True,
) -> Comparison:
    """Traces where model ``b`` parts from model ``a`` on the same input ``x``, layer by
    layer: run a is ``a`` on the whole batch, run b is ``b`` on it, and the sites align by
    module name (call index and output path as in :func:`divtrace.compare`).

    Both models run as they are (no copy), under ``torch.no_grad()``; both come back
    untouched. The independence test is off by default (both runs take the same batch
    shape, so kernels cannot part them by batch size); ``explain=["independence"]`` asks
    whether ``b``'s samples are computed alone. ``explain=["local"]`` replays each leaf of
    ``b`` on ``a``'s very inputs: the error that layer of ``b`` adds.

    Args:
        a: The reference model (its rows are stored).
        b: The model compared with it.
        x: The input both take (a tensor, a tuple or a dict, as for ``compare()``).
        names: ``{prefix in b: prefix in a}``: ``b``'s modules named as ``a``'s (a
            renamed or re-wrapped model), e.g. ``{"decoder": "model.decoder"}``; ``""``
            is every name.
        samples, batch_dim, modules, ops, rtol, atol, allow_train, resources, progress:
            As for :func:`divtrace.compare` (``modules=`` by ``a``'s names).
        explain: Probes, as for ``compare()``; the independence test only when named.

    Returns:
        A :class:`~divtrace.Comparison` (run a: ``a``, run b: ``b``).

    Example:
        >>> import copy, torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).eval()
        >>> twin = copy.deepcopy(net)
        >>> divtrace.compare_models(net, twin, torch.randn(6, 4), progress=False).verdict
        'identical'
    """
    for name, model in (("a", a), ("b", b)):
        if not isinstance(model, nn.Module):
            raise DivtraceTypeError(f"{name} must be a torch.nn.Module; got "
                                    f"{type(model).__name__}")
    refuse_mixing(b.named_modules(), allow_train, who="model b",
                  apart="its runs would differ", fix="Call b.eval() first")
    if explain is None:
        explain = ["-independence"]
    other = OtherModel(other=b, names=names_checked(names), name="model b")
    return compare(a, x, samples=samples, batch_dim=batch_dim, modules=modules, ops=ops,
                   explain=explain, rtol=rtol, atol=atol, allow_train=allow_train,
                   a=Run(name="model a"), b=other, resources=resources, progress=progress)
