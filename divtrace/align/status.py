"""Whether a tensor of the measured run lines up with the rows the other run recorded."""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

import torch

__all__ = ["Status", "comparable", "status_of"]


class Status(StrEnum):
    """Why a site was compared, or why not. The table holds the values (plain strings)."""

    OK = "ok"
    #: the measured run reached the site, the reference run did not
    MISSING_IN_SPLIT = "missing_in_split"
    #: the reference run reached the site, the measured run did not
    MISSING_IN_BATCHED = "missing_in_batched"
    #: the reference run reached the site for some compared samples only
    PARTIAL_IN_SPLIT = "partial_in_split"
    #: no batch dimension at ``batch_dim``
    UNBATCHED = "unbatched"
    SHAPE_MISMATCH = "shape_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    #: a nested tensor: each sample has its own shape; compared where it becomes padded
    NESTED = "nested"
    #: a field of a PackedSequence: time steps of several samples, or indices
    NOT_PER_SAMPLE = "not_per_sample"
    #: a token layout's tensor with no axis of the pass's tokens (or tokens that do not
    #: follow one another): not laid out token by token
    NOT_PER_TOKEN = "not_per_token"


class Recorded(Protocol):
    """What alignment needs to know of the rows recorded at a site."""

    status: Status
    row_shape: tuple[int, ...]
    dtype: torch.dtype


def comparable(tensor: torch.Tensor) -> torch.Tensor | Status:
    """The tensor as it can be compared: a sparse one as dense, a quantized one as its
    float values; a nested one not at all."""
    if tensor.is_nested:
        return Status.NESTED
    if tensor.layout != torch.strided:
        return tensor.to_dense()
    if tensor.is_quantized:
        return tensor.dequantize()
    return tensor


def status_of(recorded: Recorded | None, tensor: torch.Tensor, batch: int, batch_dim: int,
              complete: bool) -> Status:
    """Whether ``tensor`` (batch of ``batch`` rows at ``batch_dim``) can be compared with
    the rows ``recorded`` at its site; ``complete``: every compared sample was recorded."""
    if recorded is None:
        return Status.MISSING_IN_SPLIT
    if recorded.status != Status.OK:
        return recorded.status
    shape = tensor.shape
    dim = batch_dim % len(shape) if shape else 0
    if not shape or shape[dim] != batch:
        return Status.UNBATCHED
    if tuple(shape[:dim] + shape[dim + 1:]) != recorded.row_shape:
        return Status.SHAPE_MISMATCH
    if tensor.dtype != recorded.dtype and not (
            tensor.is_floating_point() and recorded.dtype.is_floating_point):
        return Status.DTYPE_MISMATCH
    if not complete:
        return Status.PARTIAL_IN_SPLIT
    return Status.OK
