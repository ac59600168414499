"""The figures themselves: ULP distance, signed zeros, zero-safe ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from divtrace.measure.block import nonzero_count
from divtrace.measure.fields import FIELDS
from divtrace.measure.figures import site_figures
from divtrace.measure.stats import block_stats, blocks, combine, ulp_ordered

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def stats(b: torch.Tensor, r: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> dict:
    array = block_stats(b.reshape(1, -1), r.reshape(1, -1), rtol, atol).numpy()
    return site_figures(array, b.numel())


@pytest.mark.parametrize("dtype", FLOATS)
def test_ulp_distance_counts_representable_steps(dtype: torch.dtype) -> None:
    one = torch.tensor([1.0], dtype=dtype)
    up = torch.nextafter(one, torch.tensor([2.0], dtype=dtype))
    up3 = torch.nextafter(torch.nextafter(up, one + 1), one + 1)
    assert stats(up, one)["max_ulp"] == 1
    assert stats(up3, one)["max_ulp"] == 3
    tiny = torch.nextafter(torch.zeros(1, dtype=dtype), one)  # smallest subnormal
    assert stats(tiny, -tiny)["max_ulp"] == 2  # across zero
    assert (ulp_ordered(torch.tensor([-0.0], dtype=dtype))
            == ulp_ordered(torch.tensor([0.0], dtype=dtype))).all()


@pytest.mark.parametrize("dtype", FLOATS)
def test_signed_zeros_are_not_divergence(dtype: torch.dtype) -> None:
    figures = stats(torch.tensor([-0.0, 1.0], dtype=dtype), torch.tensor([0.0, 1.0], dtype=dtype))
    assert figures["mismatch"] == 0
    assert figures["max_ulp"] == 0
    assert figures["rel_l2"] == 0


def test_rel_l2_is_safe_when_both_are_zero_and_infinite_when_only_split_is() -> None:
    zeros = torch.zeros(4)
    assert stats(zeros, zeros)["rel_l2"] == 0
    assert stats(zeros, zeros)["cosine"] == 1
    assert math.isinf(stats(torch.ones(4), zeros)["rel_l2"])
    assert stats(torch.ones(4), zeros)["cosine"] == 0


def test_nan_pairs_match_but_are_never_close() -> None:
    b = torch.tensor([math.nan, 1.0, math.inf])
    r = torch.tensor([math.nan, 1.0, math.inf])
    figures = stats(b, r, rtol=1.0, atol=1.0)
    assert figures["mismatch"] == 0
    assert figures["nonfinite"] == 2
    assert figures["exceed"] == pytest.approx(1 / 3)  # NaN is not close, inf == inf is
    assert not (torch.isclose(b, r, rtol=1.0, atol=1.0)[0])


def test_exceed_agrees_with_torch_isclose() -> None:
    r = torch.randn(1000)
    b = r + torch.randn(1000) * 1e-5
    for rtol, atol in [(1.3e-6, 1e-5), (0.0, 1e-5), (1e-4, 0.0)]:
        expected = (~torch.isclose(b, r, rtol=rtol, atol=atol)).float().mean().item()
        assert stats(b, r, rtol, atol)["exceed"] == pytest.approx(expected)


def test_blocks_combine_to_the_whole() -> None:
    b, r = torch.randn(3, 1000), torch.randn(3, 1000)
    whole = block_stats(b, r, 1e-3, 1e-3)
    parts = [block_stats(b[:, lo:hi], r[:, lo:hi], 1e-3, 1e-3) for lo, hi in blocks(3, 1000, 301)]
    assert len(parts) == 10
    torch.testing.assert_close(combine(parts), whole, rtol=1e-6, atol=1e-6)
    assert [hi - lo for lo, hi in blocks(3, 10, 9)] == [3, 3, 3, 1]


def test_integer_stats_are_mismatch_only() -> None:
    array = block_stats(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 5, 3]]), 0, 0).numpy()
    names = [f.name for f in FIELDS]
    assert array[0, names.index("mismatch")] == 1
    assert np.isnan(array[0, names.index("max_abs")])
    assert np.isnan(array[0, names.index("max_ulp")])


def test_queued_sites_get_exactly_the_fields_each_gets_alone() -> None:
    from divtrace.measure.host import Host
    from divtrace.measure.queue import StatsQueue

    generator = torch.Generator().manual_seed(0)
    host = Host()
    queue = StatsQueue(host, budget=1 << 40)  # one flush, at the fetch
    pairs = []
    for site in range(60):  # groups wider than a flush block: flushed in parts
        width = (16384, 8192, 3000, 7)[site % 4]
        b = torch.randn(2, width, generator=generator)
        r = b + 1e-6 * torch.randn(2, width, generator=generator)
        if site % 5 == 0:
            r = b.clone()  # bit-identical: a group of its own
        elif site % 7 == 0:
            b[0, :3] = torch.tensor([math.nan, math.inf, -0.0])
            r[1, 1] = math.nan
        pairs.append((queue.add(b, r.clone(), 1.3e-6, 1e-5), b, r))
    host.fetch()
    for place, b, r in pairs:
        alone = block_stats(b, r, 1.3e-6, 1e-5).numpy()
        np.testing.assert_array_equal(place.get().view(np.int64), alone.view(np.int64))


def test_rel_l2_of_one_site_is_numpys_division() -> None:
    import itertools

    from divtrace.measure.figures import rel_l2

    values = [0.0, -0.0, 1.5, 3e-300, math.inf, math.nan, 1e308, 5e-324]
    for diff, ref in itertools.product(values, values):
        expected = rel_l2(np.array([diff]), np.array([ref]))[0]  # the array path
        for got in (rel_l2(diff, ref), rel_l2(np.float64(diff), np.float64(ref))):
            assert np.array_equal(np.array([got]), np.array([expected]), equal_nan=True)
            assert math.copysign(1.0, got) == math.copysign(1.0, expected) or math.isnan(got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nonzero_count_is_count_nonzero(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.rand(3, 70_001, generator=generator, dtype=dtype)
    magnitudes[magnitudes < 0.4] = 0
    magnitudes[1, ::5] = torch.finfo(dtype).tiny / 4  # subnormal
    magnitudes[2] = 0
    expected = torch.count_nonzero(magnitudes, dim=1).double()
    assert torch.equal(nonzero_count(magnitudes), expected)
    assert expected[2] == 0
    assert expected[0] > 0
