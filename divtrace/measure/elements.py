"""The model's output judged element by element, as ``torch.allclose`` judges it: what a
user who compared the outputs that way saw, set beside the norm-based figures."""

from __future__ import annotations

import torch

__all__ = ["ALLCLOSE", "ELEMENTWISE", "NEAR_ZERO", "elementwise"]

#: What :func:`elementwise` returns, in order.
ELEMENTWISE = ("max_rel", "split_value", "batched_value", "largest", "beyond", "beyond_near_zero",
               "finite", "beyond_at_zero", "beyond_allclose", "beyond_allclose_near_zero")
#: ``torch.allclose``'s own defaults (``torch.testing.assert_close`` has others).
ALLCLOSE = (1e-5, 1e-8)
#: An element whose |value| is below this share of the output's largest lies near zero.
NEAR_ZERO = 1e-3


def elementwise(b: torch.Tensor, r: torch.Tensor, rtol: float, atol: float,
                given: tuple[float | None, float | None] = (None, None)) -> torch.Tensor:
    """The output judged element by element as ``torch.allclose(b, r, rtol, atol)`` does
    (the measured run against the reference run), and as ``torch.allclose`` with its own
    defaults for what the user did not ``given``: see :data:`ELEMENTWISE`."""
    b, r = b.reshape(-1).double(), r.reshape(-1).double()
    finite = torch.isfinite(b) & torch.isfinite(r)
    diff, size = (b - r).abs(), r.abs()
    rel = torch.where(finite & (size > 0), diff / size.clamp_min(1e-300), 0.0)
    beyond = finite & (diff > atol + rtol * size)
    largest = torch.where(finite, size, 0.0).max() if size.numel() else size.new_zeros(())
    near_zero = size <= NEAR_ZERO * largest
    near = beyond & near_zero
    own_rtol, own_atol = (ALLCLOSE[0] if given[0] is None else given[0],
                          ALLCLOSE[1] if given[1] is None else given[1])
    plain = finite & (diff > own_atol + own_rtol * size)
    at = rel.argmax() if rel.numel() else 0
    return torch.stack([rel.max() if rel.numel() else largest, r[at] if r.numel() else largest,
                        b[at] if b.numel() else largest, largest, beyond.sum().double(),
                        near.sum().double(), finite.sum().double(),
                        (beyond & (size == 0)).sum().double(), plain.sum().double(),
                        (plain & near_zero).sum().double()])
