"""Host tensors onto devices, without making the host wait."""

from __future__ import annotations

import torch

__all__ = ["upload"]


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU from pinned memory, so that the host does not
    wait for the GPU's queued work."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
