"""``compare()``: the face of the pipeline — arguments to a plan, the plan carried out."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from divtrace.errors import DivtraceTypeError
from divtrace.explain.registry import Explain
from divtrace.kinds.kind import Kind
from divtrace.pipeline import execute
from divtrace.plan.checks import unexpected
from divtrace.plan.make import make_plan
from divtrace.plan.runs import Resources, Run, split_run
from divtrace.plan.selection import ModuleSpec
from divtrace.remedies.search import Again
from divtrace.report.comparison import Comparison

__all__ = ["KEYWORDS", "compare"]

#: ``compare()``'s keyword arguments.
KEYWORDS = ("samples", "chunk", "batch_dim", "modules", "ops", "explain", "rtol", "atol",
            "allow_train", "a", "b", "resources", "progress", "kind")


def compare(
    model: nn.Module,
    x: Any,
    *,
    samples: Iterable[int] | None = None,
    chunk: int | None = None,
    batch_dim: int = 0,
    modules: ModuleSpec = None,
    ops: bool | str = False,
    explain: Explain = None,
    rtol: float | None = None,
    atol: float | None = None,
    allow_train: bool = False,
    a: Run | None = None,
    b: Run | None = None,
    resources: Resources | None = None,
    progress: bool = True,
    kind: Kind | None = None,
    **misspelt: Any,
) -> Comparison:
    """Traces where two runs of ``model`` on ``x`` part, layer by layer: by default the
    split run (a: ``x`` one sample at a time) and the batched run (b: ``x`` whole).

    Run a goes first, keeping only the compared samples' outputs at every site. Then run
    b, each site compared with run a's rows the moment it is produced. Both run under
    ``torch.no_grad()``; the model and ``x`` come back untouched.

    Every leaf site also gets ``input_mismatch`` and a ``role``: ``source`` (its input
    was bit-identical in both runs, its output is not), ``carrier`` (its input already
    differed) or ``clean`` (its output is bit-identical). The independence test runs
    too (``depends_on_others``): does a compared sample's output move when the other
    samples change? The verdict rests on it.

    Args:
        model: The model, usually in eval mode.
        x: A tensor, a tuple of positional arguments, or a dict of keyword arguments.
            Every tensor whose size at ``batch_dim`` equals B (that of the first tensor)
            is cut; everything else passes through whole.
        samples: The rows to compare (default: all). Only the chunks that hold them run.
        chunk: Run a's batch size (default 1: per sample), as in every face; the same as
            ``a=Run(chunk=...)``, which also takes run a's other settings.
        batch_dim: The batch dimension of the inputs and of the observed outputs.
        modules: Glob patterns on qualified module names and/or module types to observe
            (default: every module). The model's own output is always observed.
        ops: Also make every tensor-producing ATen op a site (``True``), named by the
            module call that ran it: ``layers.0.self_attn:aten.bmm#1``. Sees inside
            modules (functional matmuls, residual adds, fused kernels); roles work at op
            level too. ``"only"``: op sites and the model's output, with no hook inside
            the model (fast paths that hooks turn off stay on). ``modules=`` picks the
            scopes whose ops are recorded.
        explain: Probes that explain the divergence, by name or as objects:
            ``"local"`` (:class:`Local`: every leaf module replayed on run a's inputs —
            the error a layer adds on its own, and ``amplification``), ``"fp64"``
            (:class:`Fp64`: both runs against a float64 run), ``"repeat"``
            (:class:`Repeat`: run b again, its run-to-run noise), ``"kernels"``
            (:class:`Kernels`: the kernels each site launched), ``"observer"``
            (:class:`Observer`: the output without hooks), or a :class:`Probe` of one's
            own. ``"independence"`` and ``"observer"`` run by default (the observer only
            for models whose code path changes with hooks); ``"-independence"`` or
            ``"-observer"`` turns one off.
        rtol: Relative tolerance for the ``exceed`` column (default: the dtype's
            ``torch.testing.assert_close`` value).
        atol: Absolute tolerance, likewise.
        allow_train: Compare even when train-mode BatchNorm or Dropout make the runs
            differ for reasons that are not numerical (buffers are restored afterwards).
        a: Run a, the reference (:class:`Run`; default ``Run(chunk=1)``: per sample).
            ``a=Run(chunk=4)`` (or ``chunk=4``): in chunks of 4.
        b: Run b, measured against a (default ``Run()``: the whole batch in one pass);
            the figures are b against a.
        resources: Memory and time (:class:`Resources`: ``keep`` run b's rows for
            :meth:`Comparison.pair`, ``offload`` run a's rows to CPU memory, ``graphs``:
            replay run a from a CUDA graph). None of it changes a figure.
        progress: Show a progress bar on stderr.
        kind: The kind of comparison (a :class:`Kind`; default: the one the input and the
            runs are of — the batched run against the split run, or prompts of different
            lengths). A kind of one's own says how its runs are carried out (a context
            around each pass of either run), its row stores and meters, and what it
            cannot do.
        **misspelt: Nothing: a keyword compare() does not take is refused with the way to
            give it (``dtype=`` is ``a=/b=divtrace.Run(dtype=...)``) or the closest name.

    Returns:
        A :class:`Comparison`, one row per site.

    Raises:
        BatchMixingError: The model is in train mode with BatchNorm or Dropout.
        DivtraceValueError: Unusable ``x``, ``samples``, runs or probes.
        DivtraceTypeError: A keyword that compare() does not take, or an argument of the
            wrong type.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
        >>> result = divtrace.compare(net, torch.randn(8, 4), explain=["local"],
        ...                           progress=False)
        >>> list(result.table.site)
        ['0', '1', '(model)']
    """
    if misspelt:
        raise unexpected("compare", misspelt, KEYWORDS)
    plan = make_plan(
        model, x, samples=samples, batch_dim=batch_dim, modules=modules, ops=ops,
        explain=explain, rtol=rtol, atol=atol, allow_train=allow_train,
        a=split_run(a, chunk), b=b,
        resources=resources, progress=progress, kind=_kind(kind))
    return execute(plan, model, origin=Again(plan, model))


def _kind(kind: Any) -> Kind | None:
    if kind is None or isinstance(kind, Kind):
        return kind
    if isinstance(kind, type) and issubclass(kind, Kind):
        return kind()
    raise DivtraceTypeError(f"kind must be a divtrace.Kind (an object or a class); got "
                            f"{type(kind).__name__}")
