"""``compare()``: the split run, then the batched run measured against it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from divtrace.batch import check_chunk, chunks_for, prepare_input, prepare_samples
from divtrace.comparison import Comparison, build
from divtrace.errors import BatchMixingError, DivtraceTypeError
from divtrace.measure import Meter
from divtrace.record import SiteInfo, Tracker, observe
from divtrace.sites import select_modules
from divtrace.split import SplitRecording

__all__ = ["compare"]

_MIXING = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)


def _mixing_modules(model: nn.Module) -> list[str]:
    """Modules that, in train mode, mix samples (BatchNorm) or draw random numbers (Dropout)."""
    found = []
    for name, module in model.named_modules():
        if not module.training or not isinstance(module, _MIXING):
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p == 0:
            continue
        found.append(f"{name or 'the model'} ({type(module).__name__})")
    return found


@contextmanager
def _untouched(model: nn.Module, restore_buffers: bool) -> Iterator[None]:
    """No grad inside; the modules' training flags (and, if asked, buffers) restored after."""
    modes = [(module, module.training) for module in model.modules()]
    saved = [buf.detach().clone() for buf in model.buffers()] if restore_buffers else []
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode
        with torch.no_grad():
            for buf, old in zip(model.buffers(), saved, strict=False):
                buf.copy_(old)


def _forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             tracker: Tracker, run: str) -> Any:
    tracker.reset()
    try:
        return model(*args, **kwargs)
    except Exception as exc:
        where = tracker.last_site or "none (no module had returned yet)"
        exc.add_note(f"divtrace: raised in the {run}; last site reached: {where}")
        raise


def compare(
    model: nn.Module,
    x: Any,
    *,
    chunk: int = 1,
    samples: Iterable[int] | int | None = None,
    batch_dim: int = 0,
    modules: str | type | Iterable[str | type] | None = None,
    progress: bool = True,
    keep: bool = False,
    offload: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    allow_train: bool = False,
) -> Comparison:
    """Traces where a batched run and a split run of ``model`` on ``x`` part, layer by layer.

    The split run goes first: ``x`` in chunks of ``chunk`` samples, keeping only the
    compared samples' outputs at every site. Then the batched run: ``x`` as one batch,
    each site compared with the split run's rows the moment it is produced. Both run
    under ``torch.no_grad()``; the model and ``x`` come back untouched.

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

    Returns:
        A :class:`Comparison`, one row per site.

    Raises:
        BatchMixingError: The model is in train mode with BatchNorm or Dropout.
        DivtraceValueError: Unusable ``x``, ``chunk`` or ``samples``.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
        >>> result = divtrace.compare(net, torch.randn(8, 4), progress=False)
        >>> list(result.table.site)
        ['0', '1', '(model)']
    """
    if not isinstance(model, nn.Module):
        raise DivtraceTypeError(
            f"model must be a torch.nn.Module; got {type(model).__name__}"
        )
    batch = prepare_input(x, batch_dim)
    rows = prepare_samples(samples, batch.batch_size)
    chunk = check_chunk(chunk, batch.batch_size)
    selected = select_modules(model, modules)
    mixing = _mixing_modules(model)
    if mixing and not allow_train:
        raise BatchMixingError(
            f"the model is in train mode and these modules mix samples or draw random "
            f"numbers there: {', '.join(mixing)}; batched and split runs would differ for "
            f"reasons that are not numerical. Call model.eval() first, or pass "
            f"allow_train=True to compare anyway"
        )
    chunks = chunks_for(rows, chunk, batch.batch_size)
    split = SplitRecording(rows, batch_dim, offload, chunk)
    bar = tqdm(total=len(chunks) + 1, desc="divtrace: split run", unit="pass",
               disable=not progress, leave=False)
    with bar, _untouched(model, restore_buffers=bool(mixing)):
        with observe(selected, split) as tracker:
            for start, stop in chunks:
                args, kwargs = batch.rows(start, stop)
                compared = [s for s in rows if start <= s < stop]
                done = False
                while not done:  # runs again only when an in-place op was found late
                    split.begin_chunk(start, stop)
                    _forward(model, args, kwargs, tracker,
                             f"split run, chunk of rows {start}:{stop} (samples {compared})")
                    done = split.end_chunk()
                bar.update()
        stored_bytes = split.stored_bytes
        meter = Meter(split, rtol, atol, keep)

        def measure(site: SiteInfo, tensor: torch.Tensor) -> None:
            meter.measure(site, tensor, batch.batch_size)

        bar.set_description("divtrace: batched run")
        with observe(selected, measure) as tracker:
            args, kwargs = batch.whole()
            _forward(model, args, kwargs, tracker, f"batched run (B={batch.batch_size})")
        bar.update()
    meta = {
        "batch_size": batch.batch_size,
        "chunk": chunk,
        "samples": rows,
        "batch_dim": batch_dim,
        "split_passes": len(chunks),
        "stored_bytes": stored_bytes,
        "rtol": rtol,
        "atol": atol,
        "train_mode": bool(mixing),
        "torch": torch.__version__,
    }
    return build(meter.sites, split, meta)
