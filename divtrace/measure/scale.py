"""Norms of float64 rows beyond the range where their squares fit in float64.

The sums of squares behind ``rel_l2`` and ``cosine`` are float64: for float32 and narrower
values they cannot overflow or underflow, but float64 values beyond about 1e±154 square to
infinity or to zero. Such rows have their four sums (``sq_diff``, ``sq_ref``, ``sq_out``,
``dot``) taken again from the values times ``2**-e`` — a power of two, so every product is
exact — with ``e`` the exponent of the row's largest finite value, and ``e`` is noted in the
``scale`` field. Rows within ``2**±400`` keep ``e = 0`` and their figures bit for bit. Only
ratios of these sums are read (``rel_l2``, ``cosine``), so a site's rows are brought to one
common scale (:func:`common`) and the ratios need no other change.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from divtrace.measure.fields import INDEX

__all__ = ["SCALE", "SUMS_AT", "WIDE", "common", "common_arrays", "common_many", "exponents",
           "finite_magnitudes", "ratio", "rescaled", "within"]

#: The dtypes whose squares can leave float64's range.
WIDE = (torch.float64, torch.complex128)
#: Rows whose largest value lies within 2**±this keep their sums as they are.
_RANGE = 400
_SUMS = sorted(INDEX[name] for name in ("sq_diff", "sq_ref", "sq_out", "dot"))
assert list(range(_SUMS[0], _SUMS[0] + 4)) == _SUMS, "the four sums lie side by side"
#: The four sums as a slice: indexing a device tensor with a list of ints would copy that
#: list to the device from pageable memory, a wait for the device per site.
SUMS_AT = slice(_SUMS[0], _SUMS[0] + 4)
#: Where a row's fields hold the exponent of its scale.
SCALE = INDEX["scale"]


def _largest(rows: torch.Tensor) -> torch.Tensor:
    """Per row, the largest finite magnitude (0 for a row without one). On the CPU, rows
    without NaN or infinity take their maxima as they are: the same numbers, in a
    thirtieth of the masked maxima's time (float64, 11 × 23040: 52 µs against 1.7 ms)."""
    magnitude = rows.abs()
    if rows.device.type == "cpu":
        top = magnitude.amax(1)  # NaN or inf where a row holds one
        if bool(top.isfinite().all()):
            return top
    return finite_magnitudes(rows, magnitude).amax(1)


def finite_magnitudes(values: torch.Tensor, magnitude: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``|values|`` where they are finite, 0 elsewhere (``magnitude``: ``|values|``, when
    already taken)."""
    return torch.where(values.isfinite(), values.abs() if magnitude is None else magnitude,
                       0.0)


#: Rows whose ``sq_ref`` lies within 2**±this and whose ``max_abs`` is at most
#: 2**(this / 2), all finite, have their largest value within 2**±:data:`_RANGE`.
_SURE = 700
_CHECKED = (INDEX["nonfinite"], INDEX["sq_ref"], INDEX["max_abs"])


def within(found: torch.Tensor) -> bool:
    """Whether a block's fields alone show every row's largest finite magnitude
    within 2**±400 (its scale 2**0), without a pass over its values: no pair non-finite,
    ``sq_ref`` (Σr² as computed: within a rounding of it) within 2**±700, ``max_abs`` at most
    2**350. Then ``max |r| <= 2**350`` and ``max |b| <= max |r| + max_abs < 2**352``,
    and ``max |r| >= 2**-350 / sqrt(n) > 2**-400`` for any row shorter than 2**98.
    False where a field was not computed (NaN), and inside a CUDA graph's capture (where
    nothing may wait for the device); elsewhere on a device, asking waits for it. Every
    sum of such rows is finite, so bringing them to one scale (times ``2**0``) leaves them
    bit for bit as they are."""
    if found.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    # (on the CPU through numpy: the same comparisons, a third of torch's calls' time)
    values = found.detach().numpy() if found.device.type == "cpu" else found
    nonfinite, square, largest = (values[:, i] for i in _CHECKED)
    return bool(((nonfinite == 0) & (square >= 2.0 ** -_SURE) & (square <= 2.0 ** _SURE)
                 & (largest <= 2.0 ** (_SURE // 2))).all())


def rescaled(found: torch.Tensor, b: torch.Tensor, r: torch.Tensor,
             measure: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``found`` (the fields of ``[rows, elements]`` blocks ``b``, ``r`` of a wide dtype)
    with the sums of the rows beyond the range taken again at their scale by
    ``measure``. Rows whose fields show them within the range are not looked at again
    (:func:`within`; on a device, one wait for it); on the CPU, nor are rows found within
    the range by their values; on a device (where asking again would wait for it) every
    other wide block is measured again."""
    if not len(b) or not b.shape[1] or within(found):
        return found
    top = torch.maximum(_largest(b), _largest(r))
    e = exponents(top)
    if b.device.type == "cpu" and not bool(e.any()):
        return found
    factor = torch.ldexp(torch.ones_like(top), -e)[:, None]
    again = measure(b * factor, r * factor)
    out = found.clone()
    out[:, SUMS_AT] = again[:, SUMS_AT]
    out[:, SCALE] = e.to(out.dtype)
    return out


def exponents(top: torch.Tensor) -> torch.Tensor:
    """Per row, from its largest finite magnitude ``top``, the exponent ``e`` of its scale
    (int32): that of ``top`` beyond ``2**±400``, else 0."""
    exponent = torch.frexp(top).exponent
    beyond = (exponent > _RANGE) | ((exponent < -_RANGE) & (top > 0))
    return torch.where(beyond, exponent, 0)


def common(stats: torch.Tensor) -> torch.Tensor:
    """A site's ``[rows, fields]`` with every row's sums at the largest scale among them
    (exact: each is multiplied by a power of two)."""
    return _at_scale(stats, stats[:, SCALE].amax())


def common_many(stats: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`common` of many sites' ``[rows, fields]`` end to end (``rows``: each site's
    count of rows, on the fields' device), in a few launches for all of them: the same
    numbers as :func:`common` of each site alone."""
    top = torch.segment_reduce(stats[:, SCALE], "max", lengths=rows,
                               unsafe=True)  # (checking the lengths would wait for the device)
    return _at_scale(stats, top.repeat_interleave(rows, output_size=len(stats)))


def _at_scale(stats: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``stats`` with every row's sums at the scale ``top`` (a number, or one per row)."""
    e = stats[:, SCALE]
    out = stats.clone()
    out[:, SUMS_AT] = stats[:, SUMS_AT] * torch.ldexp(torch.ones_like(e), 2 * (e - top).to(
        torch.int32))[:, None]
    out[:, SCALE] = top
    return out


def common_arrays(arrays: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """Several sites' host fields brought to one scale (e.g. the inputs of one call), and
    that scale's exponent; the arrays themselves when all are unscaled."""
    tops = [int(a[:, SCALE].max()) for a in arrays if len(a)]
    if not any(tops):
        return arrays, 0
    top = max(tops)
    out = []
    for a in arrays:
        a = a.copy()
        a[:, _SUMS] *= np.ldexp(1.0, (2 * (a[:, SCALE] - top)).astype(np.int64))[:, None]
        a[:, SCALE] = top
        out.append(a)
    return out, top


def ratio(a: float, a_scale: int, b: float, b_scale: int) -> float:
    """``a / b`` of two norms taken at the scales ``2**a_scale`` and ``2**b_scale``."""
    return float(np.ldexp(a / b, a_scale - b_scale))
