"""The rounding budget: how large an error floating-point reordering can give at a site,
under the precision in force (the verdict's scale; see :mod:`divtrace.report.verdict`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from divtrace.explain.probe import Settings

__all__ = ["CHECK", "MODELS", "budget", "own_budget", "reduced", "two_models"]

_OPERAND_ROUNDINGS = 8
_SUM_STEPS = 2.0**10  # sqrt(2**20): a reordered sum of up to a million terms
_TF32, _BF16 = 2.0**-11, 2.0**-8
#: What a two-model comparison's error beyond rounding points at.
MODELS = ("The two models compute differently there: other weights, another "
          "implementation of the layer, or lower precision than their settings say.")
CHECK = ("Check for a layer that mixes samples in eval mode (a statistic over the batch), "
          "a wrong batch_dim, random numbers, or padding that is not masked.")



def _unit(name: str | None) -> float | None:
    dtype = getattr(torch, name or "", None)
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        return None
    return float(torch.finfo(dtype).eps) / 2


def two_models(meta: Settings) -> bool:
    """Whether run b ran another model (``compare_models``)."""
    return "model" in meta.settings.get("b", {})


def reduced(meta: Settings) -> list[tuple[float, str]]:
    """The reduced-precision maths in force for float32 in either run: ``(u_op, what it
    is, in plain words)``."""
    found: dict[str, float] = {}
    for s in meta.settings.values():
        if s.get("dtype") != "float32":
            continue
        device = str(s.get("device", ""))
        if device.startswith("cuda"):
            if s.get("tf32_matmul"):
                found["TF32 for float32 matmuls on the GPU"] = _TF32
            if s.get("tf32_cudnn"):
                found["TF32 for float32 convolutions in cuDNN"] = _TF32
            if s.get("matmul_precision") == "medium":
                found["bfloat16 for float32 matmuls (matmul precision 'medium')"] = _BF16
        elif device.startswith("cpu") and s.get("bf16_matmul_cpu"):
            found["bfloat16 for float32 matmuls in oneDNN on the CPU"] = _BF16
    return [(u, name) for name, u in found.items()]


def budget(site_dtype: str, meta: Settings) -> tuple[float, float, str]:
    """``(budget, u_op, what u_op is)`` for a site of ``site_dtype`` under ``meta``."""
    candidates: list[tuple[float | None, str]] = [(_unit(site_dtype), site_dtype)]
    candidates += [(_unit(s.get("dtype")), str(s.get("dtype")))
                   for s in meta.settings.values()]
    candidates += [(u, "TF32" if u == _TF32 else "bfloat16 matmul") for u, _ in reduced(meta)]
    found = [(u, name) for u, name in candidates if u is not None]
    if not found:
        return math.inf, math.nan, site_dtype
    u_op, name = max(found, key=lambda item: item[0])
    return _of(u_op), u_op, str(name)


def _of(u_op: float) -> float:
    """The budget of operands rounded at ``u_op``, summed at float32 (or float64)."""
    u_acc = _unit("float64") if u_op <= 2.0**-52 else _unit("float32")
    assert u_acc is not None
    return _OPERAND_ROUNDINGS * u_op + _SUM_STEPS * u_acc


def own_budget(site_dtype: str) -> float:
    """The budget of a site of ``site_dtype`` from its own precision alone (none of the
    runs' settings: a lower bound of :func:`budget`)."""
    u_op = _unit(site_dtype)
    return 0.0 if u_op is None else _of(u_op)
