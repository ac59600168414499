"""Which kernels each site launched: one profiled forward pass, a range per module call."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from divtrace.record.recorder import OP_RANGE, Recorder

__all__ = ["kernel_family", "kernels_by_site"]

_PREFIX = "divtrace::"

#: Substrings of kernel (or CPU op) names, most specific first, and the family they name.
_FAMILIES = (
    # inductor's Triton kernels, named by what they do (triton_<kind>_fused_<ops>_<n>)
    ("triton_per_", "persistent reduction"),
    ("triton_red_", "looped reduction"),
    ("triton_poi_", "pointwise"),
    ("triton_tem_", "Triton template"),
    ("winograd", "Winograd"),
    ("fft", "FFT"),
    ("implicit_precomp", "implicit GEMM (precomputed)"),
    ("implicit", "implicit GEMM"),
    ("direct", "direct convolution"),
    ("gemv", "GEMV"),
    ("splitk", "split-K GEMM"),
    ("split_k", "split-K GEMM"),
    ("cutlass", "CUTLASS GEMM"),
    ("xmma", "xmma GEMM"),
    ("gemm", "GEMM"),
    ("mkldnn_conv", "oneDNN convolution"),
    ("conv", "convolution"),
    ("addmm", "GEMM"),
    ("aten::mm", "GEMM"),
    ("aten::bmm", "GEMM"),
    ("matmul", "GEMM"),
)


#: The profiler's event for a Python dispatch mode (the op recorder's): the op that
#: computes is inside it.
_MODE = "PythonDispatchMode"

#: CPU ops that move, view or allocate rather than compute.
_PLUMBING = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided",
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::to", "aten::_to_copy",
    "aten::copy_", "aten::detach", "aten::resolve_conj", "aten::resolve_neg",
    "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose",
    "aten::permute", "aten::contiguous", "aten::clone", "aten::select", "aten::slice",
    "aten::narrow", "aten::zeros", "aten::zero_", "aten::fill_", "aten::result_type",
    "aten::item", "aten::_local_scalar_dense", "aten::alias", "aten::lift_fresh",
    "aten::flatten", "aten::_unsafe_view", "aten::expand_as", "aten::unbind",
    "aten::as_strided_", "aten::resize_", "aten::set_", "aten::_nnpack_available",
    "aten::detach_", "detach_",
})


def _innermost(event: Any) -> bool:
    """A CPU op that computes and has no computing op below it."""
    if event.name in _PLUMBING or event.name == _MODE:
        return False
    return not any(child.name not in _PLUMBING and not child.name.startswith(_PREFIX)
                   for child in event.cpu_children)


def kernel_family(name: str) -> str:
    """A short family name for a GPU kernel or CPU op name.

    Known algorithms get their family (``FFT``, ``implicit GEMM``, ``GEMV``, ...); a
    family that names no algorithm (``GEMM``, ``convolution``) keeps the kernel's bare
    name beside it (``convolution (_slow_conv2d_forward)``); any other kernel its bare
    function name (``void at::native::elementwise_kernel<...>(...)`` becomes
    ``elementwise_kernel``).
    """
    low = name.lower()
    bare = name.removeprefix("void ").split("<", 1)[0].split("(", 1)[0]
    bare = bare.rsplit("::", 1)[-1].strip() or name
    for pattern, family in _FAMILIES:
        if pattern in low:
            # a family that names no algorithm keeps the kernel's own name beside it, so
            # that two runs' kernels of one family still read apart
            return f"{family} ({_short(bare)})" if family in _GENERIC else family
    return bare


#: Families that say what a kernel computes but not how.
_GENERIC = frozenset({"GEMM", "convolution", "persistent reduction", "looped reduction",
                      "pointwise", "Triton template"})


def _short(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[:limit - 1] + "…"


#: What the profiler's own start-up prints on stderr, none of it the user's business.
_NOISE = re.compile(r"gpuGetDeviceCount failed|SyncActivityProfilerHandler|^USDT|"
                    r"profiler_(start|stop)")


@contextmanager
def _quiet() -> Iterator[None]:
    """Drops the profiler's start-up noise from stderr (it writes there from C++, so the
    file descriptor itself is caught); every other line is written out afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines()
                    if line.strip() and not _NOISE.search(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")


def _calls_around(event: Any) -> list[str]:
    """The innermost module call whose range holds ``event`` and, inside it, the op call's."""
    sites = []
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(_PREFIX):
            site = parent.name[len(_PREFIX):]
            sites.append(site.removeprefix(OP_RANGE))
            if not site.startswith(OP_RANGE):
                break
        parent = parent.cpu_parent
    return sites


def kernels_by_site(model: nn.Module, recorder: Recorder, rows: int, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> dict[str, list[str]]:
    """Runs one forward pass under ``torch.profiler``; per call, what it launched.

    The recorder names a profiler range per call (module calls; with ops, op calls too).
    On CUDA: the names of the GPU kernels, attributed to the innermost call whose range
    holds the op that launched them. On the CPU: the names of the innermost ops.
    """
    cuda = any(t.is_cuda for t in model.parameters()) or any(
        isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings():  # one profiled pass: the profiler's cycle notice is moot
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with _quiet(), profile(activities=activities) as prof, recorder.ranges(_PREFIX, rows), (
                torch.no_grad()):
            model(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
    found: dict[str, list[str]] = defaultdict(list)
    for event in prof.events():
        if event.name.startswith(_PREFIX):
            continue
        names = ([k.name for k in getattr(event, "kernels", [])] if cuda
                 else ([event.name] if _innermost(event) else []))
        if not names:
            continue
        for site in _calls_around(event):
            for name in names:
                if name not in found[site]:
                    found[site].append(name)
    return dict(found)
