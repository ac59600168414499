"""The private torch APIs divtrace leans on, in one place: they may change between torch
releases, and this is the one file to mend when they do."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import nn
from torch.testing._comparison import default_tolerances
from torch.utils import _pytree as pytree

__all__ = ["BATCH_NORM", "DROPOUT", "cuda_driver", "default_tolerances", "foreach_copy",
           "pytree", "version"]

#: The base classes of BatchNorm and of Dropout layers (they mix samples, or draw random
#: numbers, in train mode).
BATCH_NORM: type[nn.Module] = nn.modules.batchnorm._BatchNorm
DROPOUT: type[nn.Module] = nn.modules.dropout._DropoutNd


#: ``version(tensor)``: the tensor's version counter, which moves whenever the tensor is
#: changed in place (a C-level getter: it runs in every hook).
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def foreach_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copies each source into its target, launched together."""
    torch._foreach_copy_(targets, sources)


def cuda_driver() -> int | None:
    """The CUDA driver's version (e.g. 13000 for 13.0), or None without one."""
    try:
        return int(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None
