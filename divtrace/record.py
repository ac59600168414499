"""Forward hooks: observe every selected module's output, and always clean up."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.sites import flatten_output, site_key

__all__ = ["CallHook", "SiteInfo", "Tracker", "observe"]


@dataclass(frozen=True)
class SiteInfo:
    """What a site is: its key and the module call and output path it stands for."""

    key: str
    module: str
    module_type: str
    call: int
    path: str
    leaf: bool


@dataclass
class Tracker:
    """Call counts within one forward pass, the last site reached (for error notes), and
    which site produced which tensor (for telling sources from carriers)."""

    calls: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    last_site: str | None = None
    replaying: bool = False
    lineage: bool = True  # note which site produced which tensor
    _made: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = field(default_factory=dict)

    def reset(self) -> None:
        self.calls.clear()
        self.last_site = None
        self._made.clear()

    def produced(self, key: str, tensor: torch.Tensor) -> None:
        """Notes that the site ``key`` output ``tensor`` (while ``lineage`` is on)."""
        if self.lineage:
            self._made[id(tensor)] = (weakref.ref(tensor), key, tensor._version)

    def producer(self, tensor: torch.Tensor, in_place: bool = False) -> str | None:
        """The site that output this very tensor, unchanged since, in this pass (or None).

        ``in_place``: the module being looked at returns ``tensor`` itself, so the change
        of its version is that module's own doing.
        """
        entry = self._made.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        if tensor._version != entry[2] and not in_place:
            return None
        return entry[1]


#: ``on_call(site, module, args, kwargs, output, tracker)``: a leaf module's call, seen
#: before its outputs are.
CallHook = Callable[[SiteInfo, nn.Module, tuple[Any, ...], dict[str, Any], Any, "Tracker"],
                    None]


@contextmanager
def observe(
    modules: dict[str, nn.Module],
    callback: Callable[[SiteInfo, torch.Tensor], None],
    on_call: CallHook | None = None,
) -> Iterator[Tracker]:
    """Calls ``callback(site, tensor)`` for every tensor output of every module.

    The tensor is the module's own output: a callback must not keep it beyond the call
    (a later in-place op may change it), only copies or figures made from it. For leaf
    modules, ``on_call`` first sees the call's inputs. While ``tracker.replaying`` is set,
    the hooks do nothing.

    The hooks are registered after the user's own, so the user's hooks still fire first
    and any output they replace is what is observed. Every hook is removed on exit, also
    when the forward pass raises.
    """
    tracker = Tracker()
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def make_hook(name: str, module: nn.Module) -> Callable[..., None]:
        module_type = type(module).__name__
        leaf = next(module.children(), None) is None
        infos: dict[tuple[int, str], SiteInfo] = {}
        call_hook = on_call if leaf else None

        def info(call: int, path: str) -> SiteInfo:
            found = infos.get((call, path))
            if found is None:
                key = site_key(name, call, path)
                found = infos[call, path] = SiteInfo(key, name, module_type, call, path, leaf)
            return found

        def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if tracker.replaying:
                return
            call = tracker.calls[name]
            tracker.calls[name] = call + 1
            if call_hook is not None:
                call_hook(info(call, ""), mod, args, kwargs, output, tracker)
            if isinstance(output, torch.Tensor):  # the common case, kept cheap
                site = info(call, "")
                tracker.last_site = site.key
                callback(site, output)
                tracker.produced(site.key, output)
                return
            for path, tensor in flatten_output(output):
                site = info(call, path)
                tracker.last_site = site.key
                callback(site, tensor)
                tracker.produced(site.key, tensor)

        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(make_hook(name, module),
                                                        with_kwargs=True))
        yield tracker
    finally:
        for handle in handles:
            handle.remove()
