"""The plan: ``compare()``'s arguments, validated once, as one frozen record."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from divtrace.errors import (
    DivtraceTypeError,
    DivtraceValueError,
    DivtraceWarning,
)
from divtrace.plan.checks import GraphMode, check_graphs, tolerance
from divtrace.plan.inputs import BatchDim, BatchedInput, prepare_input
from divtrace.plan.prompts import prompts_input
from divtrace.plan.runs import Resources, Run
from divtrace.plan.samples import chunks_for, prepare_samples
from divtrace.plan.selection import ModuleSpec, check_modules, refuse_mixing, unobservable
from divtrace.plan.walk import Walk

__all__ = ["Plan", "make_plan"]

Chunks = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Plan:
    """Everything a comparison will do, decided before anything runs.

    Attributes:
        batch: The input, with the tensors that carry the batch marked.
        samples: The compared rows, sorted.
        a: Run a, whose compared rows are stored (default: the split run, per sample).
        b: Run b, measured against them (default: the batched run, the whole batch).
        a_chunks: Run a's passes, as ``(start, stop)`` rows.
        b_chunks: Run b's passes when it is chunked too (then both are
            recorded and compared row by row); empty when it takes the whole batch.
        modules: The validated ``modules=`` selection (None: every module).
        output_only: Only the model's output is observed (a compiled run).
        train_mode: The modules that mix samples in train mode (allowed by the user).
        allow_train: Compare although the runs mix samples or draw random numbers.
        explain: ``compare()``'s ``explain=`` as given (its probes are made by the
            pipeline: :mod:`divtrace.assembly`).
        ops: Op sites too (True), op sites and the model's output only (``"only"``: no
            hook inside the model), or none (False).
        graphs: Chunked runs replayed from a CUDA graph: ``"auto"``, True or False.
        graph_obstacle: Why no run of this comparison can be graphed (None: they may be).
        walk: The model's modules, parameters and buffers, as the checks found them.
        kind: The kind of comparison given (a :class:`divtrace.Kind`; None: the built-in
            kind that claims the plan, :func:`divtrace.kinds.registry.kind_of`).
    """

    batch: BatchedInput
    samples: tuple[int, ...]
    a: Run
    b: Run
    a_chunks: Chunks
    b_chunks: Chunks
    modules: tuple[str | type, ...] | None
    output_only: bool
    rtol: float | None
    atol: float | None
    keep: bool
    offload: bool
    progress: bool
    train_mode: tuple[str, ...]
    allow_train: bool = False
    explain: Any = None
    ops: bool | str = False
    graphs: GraphMode = False
    graph_obstacle: str | None = None
    walk: Walk | None = field(default=None, repr=False, compare=False)
    kind: Any = None

    def name(self, which: str) -> str:
        """How sentences, errors and the progress bar name run ``"a"`` or ``"b"``."""
        run = self.a if which == "a" else self.b
        if run == Run(chunk=run.chunk):  # no setting but the batch size
            return "batched run" if run.chunk is None else "split run"
        return f"run {which} ({run.label()})"

    @property
    def default_pair(self) -> bool:
        """Whether the runs differ in their batch size alone: run a in chunks, run b whole
        (the batched run against the split run)."""
        return (self.name("a"), self.name("b")) == ("split run", "batched run")


#: Runs a and b when they are not given: the split run (per sample) and the batched run.
DEFAULT_A, DEFAULT_B = Run(chunk=1), Run()


def _runs(a: Run | None, b: Run | None, size: int) -> tuple[Run, Run]:
    """Runs a and b (by default the split run and the batched run), a chunk that takes
    the whole batch made ``None``; two runs that are the same are refused."""
    for name, run in (("a", a), ("b", b)):
        if run is not None and not isinstance(run, Run):
            raise DivtraceTypeError(
                f"{name} must be a divtrace.Run (e.g. divtrace.Run(chunk=4)); got "
                f"{type(run).__name__}")
    first, second = (a or DEFAULT_A, b or DEFAULT_B)
    whole = [r if r.chunk is None or r.chunk < size else replace(r, chunk=None)
             for r in (first, second)]
    if whole[0] == whole[1]:
        passes = "one pass" if whole[0].chunk is None else f"passes of {whole[0].chunk}"
        chunk = first.chunk if first.chunk is not None else second.chunk
        taken = f"; chunk={chunk} takes it whole" if chunk is not None and chunk >= size else ""
        raise DivtraceValueError(
            f"runs a and b are the same: {whole[0].label()}, the B={size} rows in {passes}"
            f"{taken}. Give run a a chunk below {size} (a=divtrace.Run(chunk=1): per "
            f"sample) or another setting")
    return whole[0], whole[1]


def _resources(resources: Any) -> Resources:
    if resources is None:
        return Resources()
    if not isinstance(resources, Resources):
        raise DivtraceTypeError(
            f"resources must be a divtrace.Resources (e.g. divtrace.Resources(keep=True)); "
            f"got {type(resources).__name__}")
    return resources


def _check_ops(ops: Any, runs: tuple[Run, Run]) -> bool | str:
    if ops not in (False, True, "only") or not isinstance(ops, bool | str):
        raise DivtraceValueError(
            f"ops must be False, True (op sites besides module outputs) or 'only' (op "
            f"sites and the model's output, no hook inside the model); got {ops!r}")
    if ops and any(run.compile for run in runs):
        raise DivtraceValueError(
            "ops= records the ATen ops of an eager run; a compiled run (Run(compile=...)) "
            "runs fused code instead. Leave ops out, or compare eager runs")
    return ops


def _graph_obstacle(graphs: GraphMode, devices: set[torch.device], batch: BatchedInput,
                    runs: tuple[Run, Run], ops: bool | str, offload: bool, dispatched: bool
                    ) -> str | None:
    """Why the chunked runs cannot be replayed from a CUDA graph (None: they may be);
    under ``Resources(graphs=True)`` an error."""
    obstacle = next((why for why, where in (
        ("op sites (ops=) are recorded eagerly", bool(ops)),
        ("Resources(offload=True) keeps the rows in CPU memory", offload),
        ("a compiled run (Run(compile=...)) is left to torch.compile",
         any(run.compile for run in runs)),
        ("the model lies on several devices",
         dispatched or len(devices) > 1)) if where),
        None)
    on_cuda = any(isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in batch.leaves)
    moved = [torch.device(run.device).type for run in runs if run.device is not None]
    if obstacle is None and not on_cuda and "cuda" not in moved:
        obstacle = "the input is not on a CUDA device"
    if graphs is True and obstacle is not None:
        raise DivtraceValueError(
            f"Resources(graphs=True), but the split run cannot be replayed from a CUDA graph: "
            f"{obstacle}. Pass Resources(graphs='auto') or False")
    return obstacle


def _dispatched(modules: list[nn.Module]) -> bool:
    """Whether accelerate placed the model (its hooks move weights and inputs per call)."""
    return any("_hf_hook" in vars(m) for m in modules)  # (set as a plain attribute)


def _check_materialised(tensors: list[tuple[str, torch.Tensor]], batch: BatchedInput,
                        dispatched: bool) -> None:
    """Tensors on the meta device have no values: nothing could be compared."""
    inputs = [name for name, leaf in zip(batch.names, batch.leaves, strict=True)
              if isinstance(leaf, torch.Tensor) and leaf.is_meta]
    if inputs:
        raise DivtraceValueError(
            f"{', '.join(inputs)} lie(s) on the meta device, which holds shapes but no "
            f"values; pass real tensors")
    if dispatched:
        return  # accelerate supplies offloaded weights at call time
    empty = [name for name, t in tensors if t.is_meta]
    if empty:
        raise DivtraceValueError(
            f"the model's {', '.join(empty[:4])}{' and more' if len(empty) > 4 else ''} lie "
            f"on the meta device (not materialised: shapes, no values); load the weights "
            f"first, e.g. model.to_empty(device=...) then load_state_dict(...), or "
            f"accelerate's load_checkpoint_and_dispatch")


_CONV: dict[type[nn.Module], int] = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def _check_input(modules: list[nn.Module], x: Any, batch: BatchedInput,
                 runs: tuple[Run, Run], dispatched: bool, devices: set[torch.device]) -> None:
    """Mistakes that the model would only report deep inside, caught before it runs."""
    if isinstance(x, torch.Tensor):
        conv = next((m for m in modules if type(m) in _CONV), None)
        if conv is not None and x.dim() == _CONV[type(conv)] + 1 and (
                x.shape[0] == conv.in_channels):
            raise DivtraceValueError(
                f"x has shape {tuple(x.shape)}: one example without a batch dimension (the "
                f"model's first {type(conv).__name__} takes {conv.in_channels} channels)? "
                f"Add one with x.unsqueeze(0), and stack several examples to compare a "
                f"batch with its samples")
    if any(run.device is not None for run in runs) or dispatched:
        return  # the runs move the inputs (or accelerate does)
    if len(devices) != 1:
        return
    (device,) = devices
    for name, leaf in zip(batch.names, batch.leaves, strict=True):
        if isinstance(leaf, torch.Tensor) and leaf.device != device:
            raise DivtraceValueError(
                f"{name} is on {leaf.device} but the model's parameters are on {device}; "
                f"move it first: {name}.to('{device}')")


def make_plan(model: nn.Module, x: Any, *, samples: Iterable[int] | None = None,
              batch_dim: BatchDim = 0, modules: ModuleSpec = None, ops: bool | str = False,
              explain: Any = None, rtol: float | None = None, atol: float | None = None,
              allow_train: bool = False, a: Run | None = None, b: Run | None = None,
              resources: Resources | None = None, progress: bool = True, kind: Any = None
              ) -> Plan:
    """Validates ``compare()``'s arguments and decides what will run (see
    :func:`divtrace.compare`); ``explain`` is kept as given (the pipeline makes its
    probes: :mod:`divtrace.assembly`); ``kind``: a :class:`divtrace.Kind` (None: the
    built-in one that claims the plan), checked by the pipeline."""
    if not isinstance(model, nn.Module):
        raise DivtraceTypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise DivtraceTypeError(
            "the model is a TorchScript module (torch.jit.script or trace), which takes no "
            "forward hooks; compare the eager model, or wrap it to compare its output: "
            "divtrace.compare(torch.nn.Sequential(model), x)")
    rtol, atol = tolerance(rtol, "rtol"), tolerance(atol, "atol")
    batch = prompts_input(x, batch_dim) or prepare_input(x, batch_dim, stacklevel=4)
    walk = Walk.of(model)  # the model walked once for all the checks
    hidden = {name: kind for name, kind in unobservable(walk.named).items()
              if kind != "parameters"}
    if hidden:
        why = {"TorchScript": "its children run inside TorchScript, where no hook fires; "
                              "its own output is compared",
               "scripted": "a scripted module takes no forward hooks; the next observed "
                           "module's input shows what came out",
               "torch.compile": "hooks inside compiled code would make it recompile; the "
                                "compiled module's output is compared"}
        listed = "; ".join(f"'{name}' ({kind}: {why[kind]})"
                           for name, kind in list(hidden.items())[:4])
        warnings.warn(f"not observed inside: {listed}"
                      f"{' and more' if len(hidden) > 4 else ''}. To see inside, compare "
                      f"the eager module", DivtraceWarning, stacklevel=3)
    dispatched = _dispatched(walk.modules)
    _check_materialised([*walk.parameters, *walk.buffers], batch, dispatched)
    rows = prepare_samples(samples, batch.batch_size)
    size = batch.batch_size
    if kind is not None:  # a kind may set its own runs
        a, b = kind.runs(a, b)
    ref, test = _runs(a, b, size)
    resources = _resources(resources)
    keep, offload = resources.keep, resources.offload
    devices = {p.device for _, p in walk.parameters}
    _check_input(walk.modules, x, batch, (ref, test), dispatched, devices)
    train_mode = refuse_mixing(walk.named, allow_train)
    output_only = bool(ref.compile or test.compile)
    ops = _check_ops(ops, (ref, test))
    graphs = check_graphs(resources.graphs)
    return Plan(
        batch=batch, samples=tuple(rows), a=ref, b=test,
        a_chunks=tuple(chunks_for(rows, ref.chunk or size, size)),
        b_chunks=tuple(chunks_for(rows, test.chunk, size)) if test.chunk else (),
        modules=check_modules(model, modules, walk.named),
        output_only=output_only, rtol=rtol, atol=atol, keep=keep, offload=offload,
        progress=progress, train_mode=train_mode, allow_train=allow_train,
        explain=explain, ops=ops, graphs=graphs,
        graph_obstacle=_graph_obstacle(graphs, devices, batch, (ref, test), ops, offload,
                                      dispatched),
        walk=walk, kind=kind)
