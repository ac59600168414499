"""Nothing of the user's changes: modes, grad and inference mode, buffers, random state,
the cyclic garbage collector's state."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from divtrace.compat import TorchDispatchMode, foreach_copy, version
from divtrace.errors import DivtraceWarning, user_level
from divtrace.plan.walk import Walk

__all__ = ["RandomDraws", "SeededOps", "collector_held", "cuda_devices", "untouched"]


def _version(tensor: torch.Tensor) -> int | None:
    """The version counter (None for an inference tensor, which has none)."""
    return None if tensor.is_inference() else version(tensor)


@contextmanager
def collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector off during a comparison, then back as it was.

    A comparison keeps thousands of small objects alive across its passes (a site's
    figures, places for them, rows); with the collector on, they are promoted to its
    oldest generation, and every few calls one of them sets off a full collection, which
    walks every object of the process (torch's and the user's too). Held off, they never
    are; the comparison's own reference cycles are collected when it ends, in one young
    collection, and the collector is on again. Where it was off already, nothing changes.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.collect(0)
        gc.enable()


def cuda_devices(models: Iterable[nn.Module | Walk], tensors: Iterable[object]) -> list[int]:
    """The CUDA devices the models' parameters and buffers and the tensors live on (a
    model given as its :class:`~divtrace.plan.walk.Walk` is not walked again; the first
    one given of a model is read)."""
    if not torch.cuda.is_available():
        return []
    unique: dict[int, Walk] = {}
    for model in models:  # the runs often share the user's model
        key = id(model.model if isinstance(model, Walk) else model)
        if key not in unique:
            unique[key] = model if isinstance(model, Walk) else Walk.of(model)
    found = {t.device.index or 0 for walk in unique.values()
             for _, t in (*walk.parameters, *walk.buffers) if t.is_cuda}
    found |= {t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
    return sorted(found)


def _restore(buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies every buffer back from its snapshot. All of them: a kernel may update a
    buffer without moving its version (BatchNorm's running statistics on the CPU do), and
    comparing would cost a host synchronisation per buffer; the copies are launched
    together, per device and dtype (a list of one dtype takes the fused path)."""
    groups: dict[tuple[torch.device, torch.dtype, bool],
                 list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for buf, saved in buffers:
        groups.setdefault((buf.device, buf.dtype, buf.is_inference()), []).append(
            (buf, saved))
    for (_device, _dtype, inference), pairs in groups.items():
        with torch.inference_mode(inference), torch.no_grad():  # inference tensors: inside
            foreach_copy([b for b, _ in pairs], [s for _, s in pairs])


def _snapshot(buffers: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer with a copy of it, the copies launched together per device."""
    saved = [torch.empty_like(buf, memory_format=torch.preserve_format) for buf in buffers]
    _restore(list(zip(saved, buffers, strict=True)))  # the copies, the other way round
    return list(zip(buffers, saved, strict=True))


@contextmanager
def untouched(walk: Walk, devices: list[int]) -> Iterator[None]:
    """Runs with grad and inference mode off; afterwards the training flags, the buffers
    of the walked model and the random generators of the CPU and of ``devices`` are as
    before. A parameter changed in place cannot be restored (a copy of every parameter
    would cost as much memory as the model): that is a warning."""
    modes = [(module, module.training) for _, module in walk.named]
    buffers = _snapshot([buffer for _, buffer in walk.buffers])
    params = [(name, p, _version(p)) for name, p in walk.parameters]
    try:  # inference mode off (it turns grad mode on: no_grad after it), since its
        # tensors track no version and lineage needs them
        with torch.random.fork_rng(devices=devices), torch.inference_mode(False), (
                torch.no_grad()):
            yield
    finally:
        for module, mode in modes:
            if module.training != mode:  # (setting it goes through Module.__setattr__)
                module.training = mode
        _restore(buffers)
        changed = [name for name, p, seen in params if seen is not None and version(p) != seen]
        if changed:
            warnings.warn(
                f"the model's forward pass changed these parameters in place, and divtrace "
                f"cannot put them back: {', '.join(changed[:6])}"
                f"{' and more' if len(changed) > 6 else ''}", DivtraceWarning,
                stacklevel=user_level())


class RandomDraws:
    """Notices whether a forward pass drew random numbers: a generator's state moved."""

    def __init__(self, devices: list[int]) -> None:
        self.devices = devices
        self.seen = False
        self._state = self._now()

    def _now(self) -> list[torch.Tensor]:
        return [torch.get_rng_state(), *(torch.cuda.get_rng_state(i) for i in self.devices)]

    def drew(self) -> bool:
        """Whether a generator moved since the last call (or since made)."""
        now = self._now()
        moved = any(not torch.equal(a, b) for a, b in zip(now, self._state, strict=True))
        self._state = now
        self.seen |= moved
        return moved


class SeededOps(TorchDispatchMode):
    """Notices ops that draw from a random generator (PyTorch tags them
    ``nondeterministic_seeded``) in this thread only: dispatch modes are per thread, so
    draws by another thread are not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))
