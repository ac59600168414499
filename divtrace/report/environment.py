"""Where a comparison ran: versions, devices, and the settings in force for each run."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from divtrace.compat import cuda_driver
from divtrace.plan.runs import Run, backend_flags
from divtrace.version import __version__

__all__ = ["environment", "run_settings"]


def environment() -> dict[str, Any]:
    """divtrace, torch, CUDA, cuDNN, the GPUs and the driver (None where absent)."""
    cuda = torch.cuda.is_available()
    driver = cuda_driver() if cuda else None
    return {
        "divtrace": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda else [],
        "driver": None if driver is None else f"{driver // 1000}.{driver % 1000 // 10}",
        "threads": torch.get_num_threads(),
    }


def run_settings(run: Run, model: nn.Module) -> dict[str, Any]:
    """The backend flags in force while ``run`` executes, and its model's device and dtype."""
    with run.flags():
        flags = backend_flags()
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    found = {"label": run.label(), "device": None if first is None else str(first.device),
             "dtype": None if first is None else str(first.dtype).removeprefix("torch."),
             **flags}
    if run.other_model is not None:
        found["model"] = type(model).__name__
    return found
