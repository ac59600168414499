"""The figures themselves: ULP distance, signed zeros, zero-safe ratios."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
from torch import nn

from divtrace.explain.held import READS, REL_READS, figures_of
from divtrace.measure import scale
from divtrace.measure.block import count_above, max_ulp, nonzero_count, true_count
from divtrace.measure.fields import FIELDS, INDEX
from divtrace.measure.figures import site_figures
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.measure.stats import block_stats, blocks, combine, ulp_ordered
from divtrace.plan.inputs import prepare_input
from divtrace.plan.selection import select_modules
from divtrace.record.hooks import ModuleHooks
from divtrace.record.loop import drive
from tests import models
from tests.test_repeats import _record

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


def _exact_one_minus_cosine(b: torch.Tensor, r: torch.Tensor) -> float:
    """1 − cos of two float rows, from exact rational sums (the square roots to 40 digits)."""
    from decimal import Decimal, getcontext
    from fractions import Fraction

    getcontext().prec = 40
    bs = [Fraction(float(v)) for v in b.double()]
    rs = [Fraction(float(v)) for v in r.double()]
    dot = sum((x * y for x, y in zip(bs, rs, strict=True)), Fraction(0))
    bb, rr = sum(x * x for x in bs), sum(y * y for y in rs)

    def exact(q: Fraction) -> Decimal:
        return Decimal(q.numerator) / Decimal(q.denominator)

    return float(1 - exact(dot) / (exact(bb).sqrt() * exact(rr).sqrt()))


def test_cosine_resolves_rounding_level_divergence() -> None:
    # rows whose elements differ by a step or two in their last bit, up or down at random
    # (as float32 rounding differs): 1 − cos is some 1e-15, far below the rounding of a
    # dot product summed in float32 (about 1e-7), which used to give 0 or about 1e-7
    generator = torch.Generator().manual_seed(0)
    r = torch.randn(4096, generator=generator)
    b = r.clone()
    for _ in range(2):
        away = torch.where(torch.rand(4096, generator=generator) < 0.5, -math.inf, math.inf)
        b = torch.nextafter(b, away)
    expected = _exact_one_minus_cosine(b, r)
    assert 1e-15 < expected < 1e-13
    got = 1 - stats(b, r)["cosine"]
    spacing = math.ulp(1.0)  # the cosine is a float64 near 1: its steps are this wide
    assert abs(got - expected) <= 0.05 * expected + spacing


def test_cosine_of_unrelated_opposite_and_orthogonal_rows() -> None:
    generator = torch.Generator().manual_seed(1)
    b, r = torch.randn(1000, generator=generator), torch.randn(1000, generator=generator)
    assert stats(b, r)["cosine"] == pytest.approx(1 - _exact_one_minus_cosine(b, r), abs=1e-6)
    assert stats(-r, r)["cosine"] == -1
    orthogonal = stats(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))["cosine"]
    assert orthogonal == pytest.approx(0, abs=1e-15)  # (the squared norms are rounded)
    assert stats(r, r)["cosine"] == 1


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
    for same in (False, True, False):  # a part of one pair each: measured where they lie
        b = torch.randn(2, 140_000, generator=generator)
        r = b.clone() if same else b + 1e-6 * torch.randn(2, 140_000, generator=generator)
        pairs.append((queue.add(b, r, 1.3e-6, 1e-5), b, r))
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


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_hosts_ulp_distance_across_zero_is_the_devices(dtype: torch.dtype) -> None:
    """The CPU takes the pairs of opposite signs alone; the device path (no branch on
    values, a float64 distance for every pair) is the oracle: equal bit for bit."""
    generator = torch.Generator().manual_seed(1)
    finfo = torch.finfo(dtype)
    r = torch.randn(5, 4001, generator=generator).to(dtype)
    b = (r.double() + 1e-3 * torch.randn(5, 4001, generator=generator, dtype=torch.float64)
         ).to(dtype)
    b[0] = -r[0]  # every pair across zero
    b[1, ::3] = finfo.max  # the largest distances: beyond the bits' own integer type
    r[1, ::3] = -finfo.max
    b[2, :7] = -0.0  # signed zeros: no distance
    r[2, :7] = 0.0
    tiny = torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype))
    b[3, 10], r[3, 10] = tiny, -tiny  # across zero by two steps
    r[4] = b[4]  # a row without a difference
    finite = (b.float() - r.float()).isfinite()
    finite[1, ::6] = False  # pairs left out: their distance is not counted
    for left_out in (None, finite):
        host = max_ulp(b, r, left_out, True)
        device = max_ulp(b, r, left_out, False)
        assert torch.equal(host, device), (dtype, left_out is None)
    assert max_ulp(b, r, None, True)[4] == 0
    assert max_ulp(b, r, None, True)[1] > float(torch.iinfo(torch.int16).max)
    same_sign = r.abs() + 1  # no pair across zero: the short path
    assert torch.equal(max_ulp(same_sign, same_sign.nextafter(same_sign + 1), None, True),
                       max_ulp(same_sign, same_sign.nextafter(same_sign + 1), None, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_count_above_counts_as_a_mask_does(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    values = torch.rand(4, 30_001, generator=generator, dtype=dtype)
    limits = torch.rand(4, 30_001, generator=generator, dtype=dtype)
    limits[0] = values[0]  # equal is not above
    values[1, ::4] = math.nan  # NaN is above nothing
    limits[2, ::5] = math.inf
    values[3] = math.inf
    limits[3, ::2] = math.inf
    expected = true_count(values > limits)
    assert torch.equal(count_above(values, limits.clone()), expected)
    assert expected[0] == 0
    assert expected[3] == 15_000


def test_a_passes_figures_together_are_each_sites_alone() -> None:
    """``figures_of`` computes the tests' two figures of every site at once: each is the
    number the site alone gives, bit for bit, over sums of many samples (numpy's pairwise
    summation), NaN and infinite fields, zero norms, and counts that differ per sample."""
    from types import SimpleNamespace

    from divtrace.explain.held import figures_of

    rng = np.random.default_rng(0)
    for samples in (1, 3, 129):  # a pass's sites all hold the compared samples
        sites, expected = [], {}
        for i in range(40):
            array = np.abs(rng.standard_normal((samples, len(FIELDS)))) * 10.0 ** (
                rng.integers(-300, 300, size=(samples, len(FIELDS))))
            array[:, [f.name for f in FIELDS].index("mismatch")] = rng.integers(0, 50, samples)
            if i % 5 == 1:
                array[0, 1] = np.nan
            if i % 5 == 2:
                array[:] = 0.0
            if i % 7 == 3:
                array[-1, 2] = np.inf
            elements = 50 if i % 2 else rng.integers(50, 80, samples)
            stats = SimpleNamespace(get=lambda a=array: a)
            key = f"site{i}"
            sites.append(SimpleNamespace(stats=stats, site=SimpleNamespace(key=key),
                                         per_sample=lambda _b, e=elements: e))
            with np.errstate(over="ignore"):  # its cosine, not read here, overflows
                alone = site_figures(array, elements)
            expected[key] = (alone["mismatch"], alone["rel_l2"])
        sites.append(SimpleNamespace(stats=None))  # not measured: left out
        found = figures_of(SimpleNamespace(sites=sites), 129)  # type: ignore[arg-type]
        assert list(found) == list(expected)  # in the order of the sites
        for key, (share, rel) in expected.items():
            assert np.array_equal(np.array(found[key]), np.array([share, rel]),
                                  equal_nan=True), key


class _Extremes(nn.Module):
    """Rows with huge values, overflow to infinity and NaN; and rows whose differences are
    too small for their sums of squares beside a huge value (rel_l2 NaN in float64, never
    a false 0), at a small or a wide site."""

    def __init__(self, scale: float, wide: int) -> None:
        super().__init__()
        self.scale, self.wide = scale, wide

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        huge = torch.cat([x, x * self.scale, x * self.scale * 1e10], 1)
        tiny = torch.cat([x / self.scale, torch.full_like(x, self.scale ** 0.5)], 1)
        return (torch.where(huge > 1.5 * self.scale, math.nan, huge).repeat(1, self.wide),
                tiny.repeat(1, self.wide))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wide", [1, 2500])
def test_a_pass_measured_for_the_tests_gives_their_figures_exactly(
        dtype: torch.dtype, wide: int) -> None:
    scale = 1e300 if dtype == torch.float64 else 1e36
    model = nn.Sequential(models.OrderedLinear(16, 32, variant_from=2),
                          _Extremes(scale, wide)).to(dtype).eval()
    x = torch.randn(6, 16, dtype=dtype, generator=torch.Generator().manual_seed(wide))
    samples = [0, 1, 4]
    found = []
    for reads in (None, READS, REL_READS):
        meter = Meter(_record(model, x, samples), len(x), Host(), reads=reads)
        with torch.no_grad():
            drive(model, ModuleHooks(select_modules(model, None)), meter, prepare_input(x),
                  [(0, len(x))], lambda s, e: "pass")
        meter.host.fetch()
        found.append(figures_of(meter, len(x)))
        if reads is not None:  # the unread fields were not computed
            stats = next(m.stats for m in meter.sites if m.site.key == "0").get()
            assert np.isnan(stats[:, INDEX["max_ulp"]]).all()
    assert found[0].keys() == {"0", "1/0", "1/1", "(model)/0", "(model)/1"}
    torch.testing.assert_close(found[1], found[0], rtol=0, atol=0, equal_nan=True)
    rel = [{key: pair[1] for key, pair in figures.items()} for figures in found]
    torch.testing.assert_close(rel[2], rel[0], rtol=0, atol=0, equal_nan=True)  # rel_l2 alone
    # the batch-variant layer differs, and so do the huge rows after it: rel_l2 finite
    # where the squares of 1e300 would overflow, NaN matched with NaN; NaN (not 0) where
    # the differences' squares underflow beside a huge value
    assert all(0 < found[0][key][1] < 1e-6 for key in ("0", "1/0", "(model)/0"))
    tiny = found[0]["1/1"]
    assert tiny[0] > 0
    assert math.isnan(tiny[1]) if dtype == torch.float64 else 0 < tiny[1] < 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_rows_whose_fields_show_them_within_range_keep_their_sums_bit_for_bit(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # float64 (and complex128) rows from 2**-460 to 2**460 (the range edge at 2**±400),
    # zeros, rows that differ or not, one run beyond the range where the other is within
    # it, NaN and infinity: the fields' shortcut gives what looking at every value gives,
    # and takes rows at the edge again at their scale
    rng = torch.Generator().manual_seed(0)
    exponents = [-460, -402, -401, -400, -399, -351, -350, 0, 349, 350, 351, 399, 400, 401]
    seen = {True: 0, False: 0}
    for e in exponents:
        for case in range(6):
            r = torch.randn(3, 64, dtype=dtype, generator=rng) * 2.0 ** e
            b = r.clone()
            if case >= 1:
                b[1:] += torch.randn(2, 64, dtype=dtype, generator=rng) * 2.0 ** (e - 20)
            if case == 2:
                r[2] = 0.0
            if case == 3:
                b[0, 5] = math.nan
            if case == 4:
                r[1, 0] = math.inf
            if case == 5:  # r within the range, b beyond it
                b[0, 3] = 2.0 ** 401
            for reads in (None, READS, REL_READS):
                found = block_stats(b, r, 1e-7, 1e-7, reads)
                within = scale.within(found)
                seen[within] += 1
                measure = partial(block_stats, rtol=1e-7, atol=1e-7, reads=reads)
                quick = scale.rescaled(found, b, r, measure)
                with monkeypatch.context() as patched:
                    patched.setattr(scale, "within", lambda _found: False)
                    slow = scale.rescaled(found, b, r, measure)
                assert torch.equal(quick.isnan(), slow.isnan()), (e, case)
                assert torch.equal(quick.nan_to_num(), slow.nan_to_num()), (e, case)
                if within:
                    assert not quick[:, scale.SCALE].any(), (e, case)
    assert seen[True]
    assert seen[False]
    edge = torch.full((1, 8), 2.0 ** 400, dtype=torch.float64)
    assert not scale.within(block_stats(edge, edge.clone(), 1e-7, 1e-7))
    assert scale.rescaled(block_stats(edge, edge * (1 + 2.0 ** -40), 1e-7, 1e-7), edge,
                          edge * (1 + 2.0 ** -40), lambda x, y: block_stats(
                              x, y, 1e-7, 1e-7))[0, scale.SCALE] == 401
