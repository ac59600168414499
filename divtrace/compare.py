"""``compare()``: the split run, then the batched run measured against it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from tqdm import tqdm

from divtrace.assemble import build
from divtrace.batch import (
    BatchedInput,
    check_chunk,
    chunks_for,
    prepare_input,
    prepare_samples,
)
from divtrace.comparison import Comparison
from divtrace.config import Run
from divtrace.errors import BatchMixingError, DivtraceTypeError, DivtraceValueError
from divtrace.measure import Call, Measured, Meter
from divtrace.profiling import kernels_by_site
from divtrace.record import SiteInfo, Tracker, observe
from divtrace.sites import INPUT, ROOT, select_modules
from divtrace.split import Reference, SplitRecording

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
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            tracker.produced(INPUT, leaf)
    try:
        return model(*args, **kwargs)
    except Exception as exc:
        where = tracker.last_site or "none (no module had returned yet)"
        exc.add_note(f"divtrace: raised in the {run}; last site reached: {where}")
        raise


def _runs(a: Run | None, b: Run | None, chunk: int, size: int) -> tuple[Run, Run]:
    """The reference run and the compared run: split vs batched unless a or b is given."""
    if a is None and b is None:
        return Run(chunk=check_chunk(chunk, size)), Run()
    for name, run in (("a", a), ("b", b)):
        if run is not None and not isinstance(run, Run):
            raise DivtraceTypeError(f"{name} must be a divtrace.Run; got {type(run).__name__}")
    if chunk != 1:
        raise DivtraceValueError(
            "chunk= is for the default batched vs split comparison; with a= or b=, give "
            "the batch size of each run as Run(chunk=...)")
    ref, test = a or Run(), b or Run()
    whole = [r if r.chunk is None or r.chunk < size else replace(r, chunk=None)
             for r in (ref, test)]
    return whole[0], whole[1]


def _name(run: Run, fallback: str) -> str:
    if run == Run(chunk=run.chunk) and run.name is None:
        return "batched run" if run.chunk is None else "split run"
    return f"run {fallback} ({run.label()})"


def _fed(run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
         ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs as ``run`` feeds them (moved, cast, reformatted); as they are if no change."""
    if run.device is None and run.dtype is None and not run.channels_last:
        return args, kwargs
    mapped = pytree.tree_map(run.tensor, (args, kwargs))
    return mapped[0], mapped[1]


def _record(model: nn.Module, selected: dict[str, nn.Module], recording: SplitRecording,
            batch: BatchedInput, chunks: list[tuple[int, int]], run: Run, bar: Any,
            name: str) -> None:
    """Runs ``chunks`` of the batch through the model, recording the compared rows."""
    bar.set_description(f"divtrace: {name}")
    with run.flags(), observe(selected, recording, recording.on_call) as tracker:
        for start, stop in chunks:
            args, kwargs = _fed(run, *batch.rows(start, stop))
            compared = [s for s in recording.samples if start <= s < stop]
            _record_chunk(model, args, kwargs, recording, tracker, start, stop,
                          f"{name}, chunk of rows {start}:{stop} (samples {compared})")
            bar.update()


def _record_chunk(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  recording: SplitRecording, tracker: Tracker, start: int, stop: int,
                  run: str) -> None:
    """One chunk of a recorded run, run again when an in-place op was found late."""
    done = False
    while not done:
        tracker.lineage = not recording.calls  # learnt from the first chunk
        recording.begin_chunk(start, stop)
        _forward(model, args, kwargs, tracker, run)
        done = recording.end_chunk()


def _compare_recordings(meter: Meter, second: SplitRecording, size: int) -> None:
    """Measures a second recording's rows against the meter's (both runs chunked)."""
    count = len(second.samples)
    first = meter.split
    proxy = SplitRecording(list(range(count)), 0, False, count, refs=first.refs,
                           calls=first.calls)
    rows_meter = Meter(proxy, meter.rtol, meter.atol, keep=False)
    for key, ref in second.refs.items():
        if "<in" in key:
            continue
        if ref.rows is None or not second.complete(ref):
            status = ref.status if ref.rows is None else "partial_in_split"
            meter.sites.append(Measured(ref.site, status, ref.shape, ref.dtype))
            continue
        site = rows_meter.measure_site(ref.site, ref.rows, count)
        site.shape = (size, *ref.row_shape)
        meter.sites.append(site)
    for key, parts in second.calls.items():
        inputs: list[tuple[str, str | None, Measured | None]] = []
        for kind, part_key in parts:
            measured = None
            own = second.refs.get(part_key) if part_key is not None else None
            if kind == "input" and own is not None and own.rows is not None:
                measured = rows_meter.measure_site(own.site, own.rows, count)
                measured.shape = (size, *own.row_shape)
            inputs.append((kind, part_key, measured))
        meter.calls[key] = Call(inputs)


def _truth_run(model: nn.Module, modules: str | type | Iterable[str | type] | None,
               batch: BatchedInput, rows: list[int]) -> SplitRecording:
    """Runs a float64 copy of the model on the compared samples; records every site."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    exact_run = Run(device="cpu" if device.type == "mps" else device,  # mps: no float64
                    dtype=torch.float64)
    exact = exact_run.model(model)
    index = torch.tensor(rows)
    leaves = [leaf.index_select(batch.batch_dim, index.to(leaf.device)) if cut else leaf
              for leaf, cut in zip(batch.leaves, batch.sliced, strict=True)]
    args, kwargs = _fed(exact_run, *pytree.tree_unflatten(leaves, batch.spec))
    truth = SplitRecording(list(range(len(rows))), batch.batch_dim, False, len(rows))
    with observe(select_modules(exact, modules), truth) as tracker:
        _record_chunk(exact, args, kwargs, truth, tracker, 0, len(rows), "float64 truth run")
    return truth


def _repeat(meter: Meter, selected: dict[str, nn.Module], model: nn.Module, run: Run,
            batch: BatchedInput, split: SplitRecording) -> list[Measured]:
    """One more batched run, compared with the first batched run's rows."""
    first = SplitRecording(split.samples, split.batch_dim, False, split.chunk)
    for site in meter.sites:
        if site.kept is not None:
            first.refs[site.site.key] = Reference(
                site.site, site.shape, site.kept, tuple(site.kept.shape[1:]), site.dtype,
                filled=len(split.samples))
    again = Meter(first, meter.rtol, meter.atol, keep=False)
    with observe(selected, lambda s, t: again.measure(s, t, batch.batch_size)) as tracker:
        args, kwargs = _fed(run, *batch.whole())
        _forward(model, args, kwargs, tracker, "repeated batched run")
    return again.sites


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
    local: bool = False,
    replay_skip: Iterable[str] = (),
    truth: str | None = None,
    repeat: int = 0,
    kernels: bool = False,
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
    if not isinstance(model, nn.Module):
        raise DivtraceTypeError(
            f"model must be a torch.nn.Module; got {type(model).__name__}"
        )
    if truth not in (None, "fp64"):
        raise DivtraceValueError(f"truth must be None or 'fp64'; got {truth!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 0:
        raise DivtraceValueError(f"repeat must be a whole number >= 0; got {repeat!r}")
    skip = (replay_skip,) if isinstance(replay_skip, str) else tuple(replay_skip)
    batch = prepare_input(x, batch_dim)
    rows = prepare_samples(samples, batch.batch_size)
    size = batch.batch_size
    ref, test = _runs(a, b, chunk, size)
    if test.chunk is not None and (local or repeat or kernels):
        raise DivtraceValueError(
            f"local, repeat and kernels need run b to take the whole batch in one pass; "
            f"got b=Run(chunk={test.chunk}). Swap a and b, or leave those options out")
    mixing = _mixing_modules(model)
    if mixing and not allow_train:
        raise BatchMixingError(
            f"the model is in train mode and these modules mix samples or draw random "
            f"numbers there: {', '.join(mixing)}; batched and split runs would differ for "
            f"reasons that are not numerical. Call model.eval() first, or pass "
            f"allow_train=True to compare anyway"
        )
    compiled = bool(ref.compile or test.compile)
    ref_model, test_model = ref.model(model), test.model(model)
    ref_sites = {ROOT: ref_model} if compiled else select_modules(ref_model, modules)
    test_sites = {ROOT: test_model} if compiled else select_modules(test_model, modules)
    ref_chunks = chunks_for(rows, ref.chunk or size, size)
    test_chunks = chunks_for(rows, test.chunk, size) if test.chunk else []
    split = SplitRecording(rows, batch_dim, offload, ref.chunk or size)
    steps = (len(ref_chunks) + max(1, len(test_chunks)) + repeat + (truth is not None)
             + 2 * kernels)
    bar = tqdm(total=steps, desc="divtrace", unit="pass", disable=not progress, leave=False)
    with bar, _untouched(model, restore_buffers=bool(mixing)):
        exact = None
        if truth is not None:
            bar.set_description("divtrace: float64 truth run")
            exact = _truth_run(model, modules, batch, rows)
            bar.update()
        _record(ref_model, ref_sites, split, batch, ref_chunks, ref, bar, _name(ref, "a"))
        stored_bytes = split.stored_bytes
        meter = Meter(split, rtol, atol, keep or repeat > 0, local, skip, exact)
        if test_chunks:  # both runs chunked: record the second too, then compare rows
            second = SplitRecording(rows, batch_dim, offload, test.chunk or size)
            _record(test_model, test_sites, second, batch, test_chunks, test, bar,
                    _name(test, "b"))
            _compare_recordings(meter, second, size)
        else:
            bar.set_description(f"divtrace: {_name(test, 'b')}")

            def on_call(site: SiteInfo, module: nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
                meter.on_call(site, module, args, kwargs, output, tracker, size)

            with test.flags(), observe(test_sites, lambda s, t: meter.measure(s, t, size),
                                       on_call) as tracker:
                args, kwargs = _fed(test, *batch.whole())
                _forward(test_model, args, kwargs, tracker, f"{_name(test, 'b')} (B={size})")
            bar.update()
        noise = []
        for _ in range(repeat):
            bar.set_description("divtrace: repeated batched run")
            with test.flags():
                noise.append(_repeat(meter, test_sites, test_model, test, batch, split))
            bar.update()
        if not keep:
            for site in meter.sites:
                site.kept = None
        found = None
        if kernels:
            bar.set_description("divtrace: profiling")
            start, stop = ref_chunks[0]
            with ref.flags():
                split_kernels = kernels_by_site(ref_model, ref_sites,
                                                *_fed(ref, *batch.rows(start, stop)))
            bar.update()
            with test.flags():
                found = (kernels_by_site(test_model, test_sites, *_fed(test, *batch.whole())),
                         split_kernels)
            bar.update()
    meta = {
        "batch_size": batch.batch_size,
        "chunk": ref.chunk or size,
        "samples": rows,
        "batch_dim": batch_dim,
        "split_passes": len(ref_chunks),
        "stored_bytes": stored_bytes,
        "rtol": rtol,
        "atol": atol,
        "train_mode": bool(mixing),
        "torch": torch.__version__,
        "local": local,
        "truth": truth,
        "repeat": repeat,
        "kernels": kernels,
        "runs": None if a is None and b is None else [ref.label(), test.label()],
    }
    return build(meter.sites, split, meta, meter.calls, noise, found)
