"""The op recorder: besides module outputs, every tensor-producing ATen op call is a site.

A ``TorchDispatchMode`` sees each ATen op as it runs; PyTorch's own module tracker
(``torch.utils.module_tracker``) says which module calls are running, and the innermost
of them is the op's *scope*. An op site is named by its scope, the op and its index
among the same ops in that scope call: ``layers.0.self_attn:aten.bmm#1``.

What is not a site: views and ops that only move values (``view``, ``transpose``,
``clone``, ``_unsafe_view``, a copy that keeps the dtype), ops that make a tensor from
nothing (``arange``, ``ones``), and ops that read only *constants* — parameters,
buffers, tensors without the batch dimension, and what is made from them alone. Each
kind still carries the lineage: a whole view of a site's output is that site's output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.nn.modules.module import register_module_forward_pre_hook

from divtrace.align.sites import CONSTANT, INPUT, ROOT, Site, input_site, op_key, site_key
from divtrace.compat import TorchDispatchMode, modes_off, module_tracker
from divtrace.record.hooks import ModuleHooks
from divtrace.record.lineage import InputPart, Origin
from divtrace.record.oplineage import (
    PART,
    Kind,
    OpTracker,
    keeps_dtype,
    kind_of,
    op_outputs,
    per_sample,
    written_args,
)
from divtrace.record.recorder import OP_RANGE, Recorder, Sink, Tracker

__all__ = ["OpRecorder"]

def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an ATen op's arguments, in order: arguments are tensors, lists of
    tensors (``cat``) or plain values, so one level is enough."""
    found = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


class _QuietSink(Sink):
    """Hands the module hooks' tensors on to ``sink`` with no dispatch mode active: the
    sink's own work (copies, statistics, replays) is not the model's."""

    def __init__(self, sink: Sink, flush: Callable[[], None]) -> None:
        self.sink, self.flush = sink, flush

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        with modes_off():
            self.flush()
            self.sink.on_call(call, module, args, kwargs, output, tracker)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        with modes_off():
            self.flush()
            self.sink.on_tensor(site, tensor)


class OpRecorder(Recorder):
    """Module outputs through :class:`ModuleHooks` (the selected modules, or with
    ``module_sites=False`` the model's output only: no hook inside the model) and every
    op run in one of the ``scopes`` (qualified names) as a site.

    ``through_views``: an op reading a whole view of a site's output reads that site;
    else such an input is recorded under a pseudo-site of its own (replays need it).
    """

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module], scopes: set[str],
                 batch_dim: int, module_sites: bool = True, through_views: bool = True
                 ) -> None:
        self.hooks = ModuleHooks(modules if module_sites else {ROOT: modules[ROOT]})
        self.model = model
        named = list(model.named_modules())
        self.names = {module: name or ROOT for name, module in reversed(named)}
        self.depth = {name or ROOT: name.count(".") + bool(name) for name, _ in named}
        self.types = {name or ROOT: type(module).__name__ for name, module in named}
        self.scopes = scopes
        self.batch_dim = batch_dim
        self.through_views = through_views
        #: op site key -> the dim of the batch that op reduced or ran along (its ``dim``
        #: argument, as ``aten._softmax(x, 0, ...)`` takes it): a cause the
        #: independence test names where that site's rows move
        self.along_batch: dict[str, int] = {}

    def observe(self, sink: Sink) -> AbstractContextManager[Tracker]:
        return self._observing(sink, "", 0)

    def ranges(self, prefix: str, rows: int) -> AbstractContextManager[None]:
        return self._observing(Sink(), prefix, rows)

    @contextmanager
    def _observing(self, sink: Sink, label: str, rows: int) -> Iterator[Any]:
        """Records into ``sink``; with ``label``, names a profiler range per op instead."""
        tracker = OpTracker()
        names = self.names

        def entered(module: nn.Module, _args: Any) -> None:
            name = names.get(module)
            if name is not None and not tracker.replaying:
                tracker.running[name] = tracker.entered[name]
                tracker.entered[name] += 1

        constants = {id(t) for t in (*self.model.parameters(), *self.model.buffers())}
        scopes = module_tracker(names)
        mode = _OpMode(self, sink, tracker, scopes.parents, constants, label)
        hooks = self.hooks.ranges(label, rows) if label else self.hooks.attach(
            _QuietSink(sink, mode.flush), tracker)
        handle = register_module_forward_pre_hook(entered)
        try:
            with scopes, hooks, mode:
                tracker.reset(rows)
                yield tracker if not label else None
        finally:
            handle.remove()


class _OpMode(TorchDispatchMode):
    """Records each op run in a selected scope (or, with ``label``, names its range).

    An op's outputs are handed on when the next op begins (or a module hook runs), not
    at once: the version counter of an in-place op's output (and a view's) is set only
    after the op has returned to the dispatcher, and the lineage reads it.
    """

    def __init__(self, recorder: OpRecorder, sink: Sink, tracker: OpTracker,
                 parents: set[str], constants: set[int], label: str) -> None:
        super().__init__()
        self.recorder, self.sink, self.tracker = recorder, sink, tracker
        self.parents, self.constants, self.label = parents, constants, label
        self.depth = recorder.depth
        self.kinds: dict[Any, Kind] = {}
        self.written: dict[Any, tuple[int, ...]] = {}
        self.dim_at: dict[Any, int | None] = {}  # per op: the place of its ``dim`` argument
        self.sites: dict[tuple[str, int, Any, int, str], Site] = {}

    def scope(self) -> str | None:
        """The innermost module call running (the module tracker's deepest name)."""
        best, deepest = None, -1
        for name in self.parents:
            d = self.depth.get(name, -1)
            if d > deepest:
                best, deepest = name, d
        return best

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tracker = self.tracker
        if tracker.pending:
            self.flush()
        name = None if tracker.replaying else self.scope()
        if name is None:  # outside the model, or divtrace's own replay
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        makers = [tracker.maker(t) for t in tensors]
        if all(m == CONSTANT or (m is None and self._constant(t))
               for m, t in zip(makers, tensors, strict=True)):
            out = self._run(func, args, kwargs)  # made from nothing, or from constants only
            self._note(CONSTANT, out)
            return out
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = kind_of(func)
        if kind is Kind.VIEW or (kind is Kind.CAST and keeps_dtype(func, tensors, kwargs)):
            out = self._run(func, args, kwargs)
            source = 1 if kind is Kind.CAST and len(tensors) > 1 else 0  # copy_(dst, src)
            self._view(makers[source], tensors[source], out)
            return out
        if name not in self.recorder.scopes:
            out = self._run(func, args, kwargs)
            self._note(PART, out)
            return out
        call = self._call(name, func)
        tracker.last_site = call.key
        if self.label:
            with record_function(self.label + OP_RANGE + call.key):
                out = func(*args, **kwargs)
            self._note(call.key, out)
            return out
        self.sink.on_op(call, func, args, kwargs, self._parts(call, tensors, makers),
                        tracker)
        if call.key not in self.recorder.along_batch and tensors:
            self._along(call.key, func, args, kwargs, tensors[0])
        out = self._run(func, args, kwargs)
        self._outputs(call, func, out)
        return out

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs the op, then counts an in-place op's writes to its arguments' memory (any
        op, site or not: the lineage and the row store's deferred copies read the counts).
        """
        out = func(*args, **kwargs)
        written = self.written.get(func)
        if written is None:
            written = self.written[func] = written_args(func)
        if written:
            schema = func._schema.arguments
            values = [args[i] if i < len(args) else kwargs.get(schema[i].name)
                      for i in written]
            self.tracker.wrote([v for v in values if isinstance(v, torch.Tensor)])
        return out

    def _along(self, key: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               first: torch.Tensor) -> None:
        """Notes that the op at ``key`` takes a ``dim`` that is the batch's."""
        if func not in self.dim_at:  # read from the schema once per op
            self.dim_at[func] = next((i for i, arg in enumerate(func._schema.arguments)
                                      if arg.name == "dim"), None)
        at = self.dim_at[func]
        if at is None or first.dim() == 0:
            return
        value = args[at] if at < len(args) else kwargs.get("dim")
        dims = value if isinstance(value, list | tuple) else [value]
        batch = self.recorder.batch_dim % first.dim()
        if any(isinstance(d, int) and d % first.dim() == batch for d in dims):
            self.recorder.along_batch[key] = batch

    def _call(self, name: str, func: Any) -> Site:
        tracker = self.tracker
        call = tracker.running.get(name, 0)
        counter = (name, call, func.overloadpacket)  # overloads share a name and a count
        index = tracker.op_calls[counter]
        tracker.op_calls[counter] = index + 1
        return self._site(name, call, func, index, "")

    def _site(self, name: str, call: int, func: Any, index: int, path: str) -> Site:
        found = self.sites.get((name, call, func, index, path))
        if found is None:  # made once per op call of the model, then looked up
            op = str(func)
            key = op_key(site_key(name, call, ""), op, index) + (f"/{path}" if path else "")
            found = self.sites[name, call, func, index, path] = Site(
                key, name, self.recorder.types.get(name, ""), call, path, True, op=op,
                index=index)
        return found

    def _constant(self, tensor: torch.Tensor) -> bool:
        """An input made before the pass: a parameter or buffer, or one without the batch."""
        if id(tensor) in self.constants:
            return True
        if tensor.is_nested:  # the batch, one sample per entry
            return False
        rows = self.tracker.rows
        if tensor.dim() == 0 or rows <= 0:
            return True
        size = tensor.shape[self.recorder.batch_dim % tensor.dim()]
        return size == 0 or size % rows != 0

    def _parts(self, call: Site, tensors: list[torch.Tensor], makers: list[str | None]
               ) -> list[InputPart]:
        parts = []
        for index, (tensor, maker) in enumerate(zip(tensors, makers, strict=True)):
            if maker is not None and maker != PART:
                parts.append(InputPart(Origin.SITE, maker, tensor))
            elif maker is None and self._constant(tensor):
                parts.append(InputPart(Origin.SITE, CONSTANT, tensor))
            else:  # made unseen (a part of a site's output, an op outside the scopes)
                rows = per_sample(tensor, self.recorder.batch_dim, self.tracker.rows)
                parts.append(InputPart(Origin.INPUT, input_site(call, index).key, rows))
        return parts

    def _view(self, maker: str | None, source: torch.Tensor, out: Any) -> None:
        """A view or copy of ``source``: made by the same site when it holds all of it,
        or when ``source`` holds no per-sample data; else a part."""
        if maker is None:
            return
        whole = maker in (INPUT, CONSTANT) or (
            self.recorder.through_views and isinstance(out, torch.Tensor)
            and not (out.is_nested or source.is_nested) and out.numel() == source.numel())
        self._note(maker if whole else PART, out)

    def _note(self, key: str | None, out: Any) -> None:
        self.tracker.pending.extend((key, item, None) for _, item in op_outputs(out))

    def _outputs(self, call: Site, func: Any, out: Any) -> None:
        pending = self.tracker.pending
        for path, tensor in op_outputs(out):
            site = self._site(call.module, call.call, func, call.index, path) if path else call
            pending.append((site.key, tensor, site if tensor.dim() > 0 or not path else None))

    def flush(self) -> None:
        """Hands the last op's outputs on, now that their version counters are set."""
        tracker = self.tracker
        pending, tracker.pending = tracker.pending, []
        rows, dim = tracker.rows, self.recorder.batch_dim
        for key, tensor, site in pending:
            if site is not None:
                tracker.last_site = site.key
                self.sink.on_tensor(site, per_sample(tensor, dim, rows))
            tracker.note(key, tensor)
