"""The compared samples and the chunks of the split run."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.checks import whole_number

__all__ = ["check_chunk", "chunks_for", "prepare_samples"]


def prepare_samples(samples: Any, batch_size: int) -> list[int]:
    """Validates ``samples`` and returns them as a sorted list of row indices."""
    if samples is None:
        return list(range(batch_size))
    if getattr(samples, "ndim", None) == 0 or (
            isinstance(samples, numbers.Integral) and not isinstance(samples, bool)):
        one = int(samples.item() if hasattr(samples, "item") else samples)
        raise DivtraceTypeError(  # "the first 3" or "row 3"? Both are common readings
            f"samples={one} is one number; samples takes the rows to compare: "
            f"samples=[{one}] for row {one} alone, samples=range({one}) for the first "
            f"{one} rows (or None for all)")
    if isinstance(samples, torch.Tensor):
        samples = samples.reshape(-1).tolist()
    elif isinstance(samples, range):
        samples = list(samples)
    if isinstance(samples, str | bytes | dict) or not hasattr(samples, "__iter__"):
        raise DivtraceTypeError(
            f"samples must be a list of row indices (or None for all rows); got "
            f"{type(samples).__name__}"
        )
    out: list[int] = []
    for s in samples:
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise DivtraceTypeError(f"samples must hold ints; got {s!r} ({type(s).__name__})")
        index = whole_number(s, "samples")
        if not 0 <= index < batch_size:
            raise DivtraceValueError(
                f"sample {index} is out of range: the batch has B={batch_size} rows, so "
                f"samples must lie in 0..{batch_size - 1}"
            )
        out.append(index)
    if not out:
        raise DivtraceValueError("samples is empty; name at least one row, or pass None")
    if len(set(out)) != len(out):
        dup = sorted({s for s in out if out.count(s) > 1})
        raise DivtraceValueError(f"samples names rows {dup} more than once; name each once")
    return sorted(out)


def chunks_for(samples: list[int], chunk: int, batch_size: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` chunks of the split run that hold at least one compared row."""
    starts = sorted({s // chunk * chunk for s in samples})
    return [(start, min(start + chunk, batch_size)) for start in starts]


def check_chunk(chunk: Any, batch_size: int) -> int:
    """Validates the split run's chunk size."""
    if isinstance(chunk, bool) or not hasattr(chunk, "__index__"):
        raise DivtraceTypeError(f"chunk must be an int; got {type(chunk).__name__}")
    size = whole_number(chunk, "chunk")
    if size < 1:
        raise DivtraceValueError(f"chunk must be at least 1; got {size}")
    if size >= batch_size:
        raise DivtraceValueError(
            f"chunk={size} but the batch has only B={batch_size} rows, so the split run "
            f"would be the batched run; pass a chunk below {batch_size} (1 = per-sample)"
        )
    return size
