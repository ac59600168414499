"""Causes read off the model: why a module that lets other samples in does so, in words
that name the fix (None where the module does not tell)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["cause_of", "deterministic", "op_cause"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def cause_of(module: nn.Module, batch_dim: int) -> str | None:
    """What makes ``module`` mix the samples of a batch taken along ``batch_dim``, as a
    sentence (None: nothing that its type and settings show)."""
    kind = type(module).__name__
    if isinstance(module, nn.RNNBase):
        along = 0 if module.batch_first else 1
        if batch_dim % 3 != along:
            return (f"this {kind} takes the batch along dim {along} (batch_first="
                    f"{module.batch_first}) but the comparison cut it along dim {batch_dim}: "
                    f"pass batch_dim={along}")
        return None
    if isinstance(module, _BATCH_NORMS) and not module.track_running_stats:
        return (f"this {kind} has no running statistics (track_running_stats=False), so it "
                f"normalises with the batch's own mean and variance in eval mode too")
    if isinstance(module, _BATCH_NORMS) and module.training:
        return f"this {kind} is in train mode: it normalises with the batch's statistics"
    if type(module).__module__.startswith("torch.ao.nn.quantized.dynamic"):
        return (f"this {kind} is dynamically quantized: the scale of its activations is "
                f"taken over the whole batch, so each sample's rounding depends on the "
                f"others")
    return None


def op_cause(op: str, dim: int) -> str:
    """What an op that takes the batch's dimension as its ``dim`` does, as a sentence."""
    name = op.removesuffix(".default").replace("aten._", "aten.")
    return (f"this {name} runs along dim {dim}, the batch's: each sample's result takes "
            f"the other samples' values in (check the dim it is given)")


class deterministic:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` and cuDNN's
    deterministic flag while it is in force; both put back on exit."""

    def __enter__(self) -> None:
        self._was = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled(),
                     torch.backends.cudnn.deterministic)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True

    def __exit__(self, *_: object) -> None:
        enabled, warn_only, cudnn = self._was
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn
