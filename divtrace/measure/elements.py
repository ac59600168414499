"""The model's output judged element by element, as ``torch.allclose`` judges it: what a
user who compared the outputs that way saw, set beside the norm-based figures."""

from __future__ import annotations

import torch

__all__ = ["ALLCLOSE", "ELEMENTWISE", "NEAR_ZERO", "argmax", "elementwise"]

#: What :func:`elementwise` returns, in order.
ELEMENTWISE = ("max_rel", "a_value", "b_value", "largest", "beyond", "beyond_near_zero",
               "finite", "beyond_at_zero", "beyond_allclose", "beyond_allclose_near_zero")
#: ``torch.allclose``'s own defaults (``torch.testing.assert_close`` has others).
ALLCLOSE = (1e-5, 1e-8)
#: An element whose |value| is below this share of the output's largest lies near zero.
NEAR_ZERO = 1e-3


#: Elements judged at once (the temporaries stay a few times this, whatever the output).
_BLOCK = 1 << 22


def elementwise(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float,
                given: tuple[float | None, float | None] = (None, None)) -> torch.Tensor:
    """The output judged element by element as ``torch.allclose(b, r, rtol, atol)`` does
    (the measured run against the reference run, in their own dtype, at least float32),
    and as ``torch.allclose`` with its own defaults for what the user did not ``given``:
    see :data:`ELEMENTWISE`. Computed in blocks, on the device, without waiting."""
    dtype = torch.float64 if b.dtype == torch.float64 else torch.float32
    b, r = b.reshape(-1), r.reshape(-1)
    if not r.numel():
        return torch.zeros(len(ELEMENTWISE), dtype=torch.float64, device=b.device)
    own = (ALLCLOSE[0] if given[0] is None else given[0],
           ALLCLOSE[1] if given[1] is None else given[1])
    spans = [(lo, min(lo + _BLOCK, r.numel())) for lo in range(0, r.numel(), _BLOCK)]
    largest = torch.stack([_largest(r[lo:hi].to(dtype)) for lo, hi in spans]).amax()
    parts = [_block(b[lo:hi].to(dtype), r[lo:hi].to(dtype), rtol, atol, own, largest)
             for lo, hi in spans]
    joined = torch.stack(parts)  # [blocks, fields]: the largest ratio's block wins
    best = joined[:, 0].argmax().reshape(1)
    head = joined.index_select(0, best)[0, :3]
    return torch.cat([head, largest.double().reshape(1), joined[:, 4:].sum(0)])


def _largest(r: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(r), r.abs(), 0).amax()


def _block(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float,
           own: tuple[float, float], largest: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(b) & torch.isfinite(r)
    diff, size = (b - r).abs(), r.abs()
    rel = torch.where(finite & (size > 0), diff / size.clamp_min(torch.finfo(size.dtype).tiny),
                      0.0)
    beyond = finite & (diff > atol + rtol * size)
    near_zero = size <= NEAR_ZERO * largest
    plain = finite & (diff > own[1] + own[0] * size)
    at = rel.argmax().reshape(1)  # a tensor index, not an int: the host does not wait
    counts = [beyond, beyond & near_zero, finite, beyond & (size == 0), plain,
              plain & near_zero]
    return torch.cat([rel.index_select(0, at).double(), r.index_select(0, at).double(),
                      b.index_select(0, at).double(), largest.double().reshape(1),
                      torch.stack([c.sum() for c in counts]).double()])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the largest value (float8 has no argmax: upcast, exactly)."""
    return (logits.float() if logits.element_size() == 1 else logits).argmax(1)
