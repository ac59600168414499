"""``compare()``: the face of the pipeline — arguments to a plan, the plan carried out."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from divtrace.pipeline import execute
from divtrace.plan.make import make_plan
from divtrace.plan.runs import Run
from divtrace.plan.selection import ModuleSpec
from divtrace.report.comparison import Comparison

__all__ = ["compare"]


def compare(
    model: nn.Module,
    x: Any,
    *,
    chunk: int = 1,
    samples: Iterable[int] | int | None = None,
    batch_dim: int = 0,
    modules: ModuleSpec = None,
    progress: bool = True,
    keep: bool = False,
    offload: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    allow_train: bool = False,
    independence: bool = True,
    local: bool = False,
    replay_skip: Iterable[str] = (),
    truth: str | None = None,
    repeat: int = 0,
    kernels: bool = False,
    observer: bool | None = None,
    ops: bool | str = False,
    graphs: bool | str = "auto",
    a: Run | None = None,
    b: Run | None = None,
) -> Comparison:
    """Traces where a batched run and a split run of ``model`` on ``x`` part, layer by layer.

    The split run goes first: ``x`` in chunks of ``chunk`` samples, keeping only the
    compared samples' outputs at every site. Then the batched run: ``x`` as one batch,
    each site compared with the split run's rows the moment it is produced. Both run
    under ``torch.no_grad()``; the model and ``x`` come back untouched.

    Every leaf site also gets ``input_mismatch`` and a ``role``: ``source`` (its input
    was bit-identical in both runs, its output is not), ``carrier`` (its input already
    differed) or ``clean`` (its output is bit-identical).

    Args:
        model: The model, usually in eval mode.
        x: A tensor, a tuple of positional arguments, or a dict of keyword arguments.
            Every tensor whose size at ``batch_dim`` equals B (that of the first tensor)
            is cut; everything else passes through whole.
        chunk: The split run's batch size (1 = per sample).
        samples: The rows to compare (default: all). Only the chunks that hold them run.
        batch_dim: The batch dimension of the inputs and of the observed outputs.
        modules: Glob patterns on qualified module names and/or module types to observe
            (default: every module). The model's own output is always observed.
        progress: Show a progress bar on stderr.
        keep: Also keep the batched rows, for :meth:`Comparison.pair`.
        offload: Keep the split run's rows in pinned CPU memory instead of on the device.
        rtol: Relative tolerance for the ``exceed`` column (default: the dtype's
            ``torch.testing.assert_close`` value).
        atol: Absolute tolerance, likewise.
        allow_train: Compare even when train-mode BatchNorm or Dropout make the runs
            differ for reasons that are not numerical (buffers are restored afterwards).
        independence: Test whether each compared sample's rows depend on the other
            samples: the batched pass once more with the same shapes, the compared rows
            kept and the others given other values (two passes when every sample is
            compared, one half held at a time). Rows that move are batch mixing, a bug
            whatever its size; the verdict rests on it (``depends_on_others``,
            ``others_rel_l2``).
        local: Replay every leaf module in the batched run on the split run's inputs for
            the compared rows: the error a layer adds on its own (``local_rel_l2``), and
            ``amplification`` (‖error out‖ / ‖error in‖). Keeps split rows until replayed.
        replay_skip: Glob patterns of module names not to replay (stateful modules, or
            ones with side effects).
        truth: ``"fp64"``: also run a float64 copy of the model on the compared samples
            and measure how far each run is from it (``batched_err_fp64``,
            ``split_err_fp64``).
        repeat: Run the batched pass this many more times and measure how much it
            differs from itself (``noise_mismatch``, ``noise_rel_l2``).
        kernels: Profile one split pass and one batched pass and list, per site, the GPU
            kernels (on the CPU: the innermost ops) each launched.
        observer: Run the measured pass once more without any hook and check that its
            output is bit-identical (default None: only for models with modules whose
            code path changes with hooks, such as ``nn.TransformerEncoderLayer``).
        ops: Also make every tensor-producing ATen op a site (``True``), named by the
            module call that ran it: ``layers.0.self_attn:aten.bmm#1``. Sees inside
            modules (functional matmuls, residual adds, fused kernels); roles work at op
            level too. ``"only"``: op sites and the model's output, with no hook inside
            the model (fast paths that hooks turn off stay on). ``modules=`` picks the
            scopes whose ops are recorded.
        graphs: On CUDA, capture up to 4 split passes side by side as one CUDA graph
            (each on a stream of its own, the recording copies inside; one pass when
            more do not fit in memory), check every one bit for bit against the eager
            first pass, and replay the graph for the other chunks, 4 at a time.
            ``"auto"``: where it can be used and there are at least 8 passes to replay
            (else eager; a failed capture or check is a warning); ``True``: always, or
            an error; ``False``: eager. ``meta["graphed"]`` says how each chunked run
            went.
        a: Instead of batched vs split: the reference run's configuration
            (:class:`Run`; default ``Run()``: as is, the whole batch in one pass).
        b: The configuration compared with ``a``; the figures are ``b`` against ``a``.
            With ``a`` or ``b`` given, ``chunk`` is not used: give ``Run(chunk=...)``.

    Returns:
        A :class:`Comparison`, one row per site.

    Raises:
        BatchMixingError: The model is in train mode with BatchNorm or Dropout.
        DivtraceValueError: Unusable ``x``, ``chunk``, ``samples`` or options.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
        >>> result = divtrace.compare(net, torch.randn(8, 4), progress=False)
        >>> list(result.table.site)
        ['0', '1', '(model)']
    """
    plan = make_plan(
        model, x, chunk=chunk, samples=samples, batch_dim=batch_dim, modules=modules,
        progress=progress, keep=keep, offload=offload, rtol=rtol, atol=atol,
        allow_train=allow_train, a=a, b=b, independence=independence,
        local=local, replay_skip=replay_skip, truth=truth, repeat=repeat, kernels=kernels,
        observer=observer, ops=ops, graphs=graphs)
    return execute(plan, model)
