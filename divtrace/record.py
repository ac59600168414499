"""Forward hooks: observe every selected module's output, and always clean up."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.sites import flatten_output, site_key

__all__ = ["SiteInfo", "Tracker", "observe"]


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
    """Call counts within one forward pass, and the last site reached (for error notes)."""

    calls: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    last_site: str | None = None

    def reset(self) -> None:
        self.calls.clear()
        self.last_site = None


@contextmanager
def observe(
    modules: dict[str, nn.Module], callback: Callable[[SiteInfo, torch.Tensor], None]
) -> Iterator[Tracker]:
    """Calls ``callback(site, tensor)`` for every tensor output of every module.

    The tensor is the module's own output: a callback must not keep it beyond the call
    (a later in-place op may change it), only copies or figures made from it.

    The hooks are registered after the user's own, so the user's hooks still fire first
    and any output they replace is what is observed. Every hook is removed on exit, also
    when the forward pass raises.
    """
    tracker = Tracker()
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def make_hook(name: str, module: nn.Module) -> Callable[[nn.Module, Any, Any], None]:
        module_type = type(module).__name__
        leaf = next(module.children(), None) is None
        infos: dict[tuple[int, str], SiteInfo] = {}

        def info(call: int, path: str) -> SiteInfo:
            found = infos.get((call, path))
            if found is None:
                key = site_key(name, call, path)
                found = infos[call, path] = SiteInfo(key, name, module_type, call, path, leaf)
            return found

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            call = tracker.calls[name]
            tracker.calls[name] = call + 1
            if isinstance(output, torch.Tensor):  # the common case, kept cheap
                site = info(call, "")
                tracker.last_site = site.key
                callback(site, output)
                return
            for path, tensor in flatten_output(output):
                site = info(call, path)
                tracker.last_site = site.key
                callback(site, tensor)

        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(make_hook(name, module)))
        yield tracker
    finally:
        for handle in handles:
            handle.remove()
