"""The module-hook recorder: every selected module's output, through forward hooks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from divtrace.align.sites import Site, flatten_output, site_key
from divtrace.align.status import Status
from divtrace.compat import forward_hooks
from divtrace.plan.walk import is_leaf
from divtrace.record.recorder import Recorder, Sink, Tracker

__all__ = ["ModuleHooks"]


class ModuleHooks(Recorder):
    """Observes the outputs of ``modules`` (qualified name -> module) with forward hooks.

    The hooks are registered after the user's own, so the user's hooks still fire first
    and any output they replace is what is observed. For leaf modules, the sink's
    ``on_call`` first sees the call's inputs.
    """

    def __init__(self, modules: dict[str, nn.Module], inside: dict[str, str] | None = None,
                 blocks: dict[str, nn.Module] | None = None) -> None:
        self.modules = modules
        #: modules that see the tokens flattened (inside a mixture-of-experts block), by
        #: the block whose input says the pass's (rows, sequence): ``blocks``
        self.inside = dict(inside or {})
        self.blocks = dict(blocks or {})
        self._target = _Target()
        self._hooks: list[tuple[nn.Module, Callable[..., None]]] | None = None

    def observe(self, sink: Sink) -> AbstractContextManager[Tracker]:
        return self.attach(sink, Tracker())

    @contextmanager
    def attach(self, sink: Sink, tracker: Tracker) -> Iterator[Tracker]:
        """Observes with the given ``tracker`` (one that another recorder shares)."""
        if self._target.sink is not None:
            raise RuntimeError("this recorder is already observing a run")
        if self._hooks is None:  # made once: every run of the comparison uses them
            self._hooks = [(module, _hook(name, module, self._target, self.inside.get(name)))
                           for name, module in self.modules.items()]
        self._target.bind(sink, tracker)
        handles = [block.register_forward_pre_hook(_tokens(name, self._target))
                   for name, block in self.blocks.items()]
        try:
            with forward_hooks(self._hooks):
                yield tracker
        finally:
            for handle in handles:
                handle.remove()
            self._target.bind(None, None)

    @contextmanager
    def ranges(self, prefix: str, rows: int = 0) -> Iterator[None]:
        """A profiler range per module call, named ``prefix`` + the call's key."""
        calls: defaultdict[str, int] = defaultdict(int)
        open_ranges: list[Any] = []
        handles = []

        def make(name: str) -> tuple[Any, Any]:
            def pre(_module: nn.Module, _args: Any) -> None:
                scope = record_function(prefix + site_key(name, calls[name], ""))
                scope.__enter__()
                open_ranges.append(scope)

            def post(_module: nn.Module, _args: Any, _output: Any) -> None:
                calls[name] += 1
                open_ranges.pop().__exit__(None, None, None)

            return pre, post

        try:
            for name, module in self.modules.items():
                pre, post = make(name)
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post, always_call=True))
            yield
        finally:
            for handle in handles:
                handle.remove()


class _Target:
    """The sink and tracker the hooks of a :class:`ModuleHooks` hand to, while it
    observes (the hooks are made once, the target set for each run)."""

    __slots__ = ("on_call", "on_tensor", "sink", "tokens", "tracker")

    def __init__(self) -> None:
        self.tokens: dict[str, tuple[int, int]] = {}  # block -> (rows, sequence)
        self.bind(None, None)

    def bind(self, sink: Sink | None, tracker: Tracker | None) -> None:
        self.sink, self.tracker = sink, tracker
        self.on_call = None if sink is None else sink.on_call
        self.on_tensor = None if sink is None else sink.on_tensor


def _tokens(block: str, target: _Target) -> Callable[..., None]:
    """A mixture-of-experts block's pre-hook: the (rows, sequence) of its input."""
    def pre(_module: nn.Module, args: Any) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.dim() >= 3:
            target.tokens[block] = (int(first.shape[0]), int(first.shape[1]))
        else:
            target.tokens.pop(block, None)
    return pre


def _unflattened(tensor: torch.Tensor, tokens: tuple[int, int] | None) -> torch.Tensor:
    """``tensor`` read as ``(rows, sequence, ...)`` when its first axis holds the block's
    tokens flattened (as it is handed on, else)."""
    if tokens is None or tensor.dim() == 0 or tensor.shape[0] != tokens[0] * tokens[1]:
        return tensor
    return tensor.unflatten(0, tokens)


def _hook(name: str, module: nn.Module, target: _Target, block: str | None = None
          ) -> Callable[..., None]:
    """The forward hook of one module (kept lean: it runs for every module call);
    ``block``: the mixture-of-experts block it lies in, whose tokens it sees flattened."""
    module_type = type(module).__name__
    leaf = is_leaf(module)
    sites: dict[tuple[int, str, Status | None], Site] = {}

    def site(call: int, path: str, opaque: Status | None = None) -> Site:
        found = sites.get((call, path, opaque))
        if found is None:
            found = sites[call, path, opaque] = Site(site_key(name, call, path), name,
                                                     module_type, call, path, leaf,
                                                     opaque=opaque)
        return found

    def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        tracker, on_tensor = target.tracker, target.on_tensor
        if tracker is None or on_tensor is None or tracker.replaying:
            return
        call = tracker.calls[name]
        tracker.calls[name] = call + 1
        if leaf and target.on_call is not None:
            target.on_call(site(call, ""), mod, args, kwargs, output, tracker)
        tokens = None if block is None else target.tokens.get(block)
        if isinstance(output, torch.Tensor) and tokens is None:  # the common case, cheap
            here = site(call, "")
            tracker.last_site = here.key
            on_tensor(here, output)
            tracker.produced(here.key, output)
            return
        for path, tensor, opaque in flatten_output(output):
            here = site(call, path, opaque)
            tracker.last_site = here.key
            on_tensor(here, _unflattened(tensor, tokens))
            tracker.produced(here.key, tensor)

    return hook
