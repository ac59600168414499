"""Nothing of the user's model changes: modes, grad mode and (if asked) buffers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["untouched"]


@contextmanager
def untouched(model: nn.Module, restore_buffers: bool) -> Iterator[None]:
    """No grad inside; the modules' training flags (and, if asked, buffers) restored after."""
    modes = [(module, module.training) for module in model.modules()]
    saved = [buf.detach().clone() for buf in model.buffers()] if restore_buffers else []
    try:  # inference mode off (it turns grad mode on: no_grad after it), since its
        # tensors track no version and lineage needs them
        with torch.inference_mode(False), torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode
        with torch.no_grad():
            for buf, old in zip(model.buffers(), saved, strict=False):
                buf.copy_(old)
