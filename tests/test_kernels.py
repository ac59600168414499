"""The fused Triton kernel gives the eager path's figures, and many sites in one launch give
each site's own figures (in Triton's interpreter; on CUDA where there is one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = r"""
import math, torch
from divtrace.measure import fused as kernels
from divtrace.measure.stats import block_stats
for dtype in [torch.float32, torch.float16, torch.bfloat16, torch.float64]:
    g = torch.Generator().manual_seed(0)
    b = torch.randn(3, 5000, dtype=torch.float64, generator=g)
    r = b + torch.randn(3, 5000, dtype=torch.float64, generator=g) * 1e-3
    b[0, 0], r[0, 0] = 0.0, -0.0                  # signed zeros
    b[1, :10] = -r[1, :10]                        # opposite signs
    b[2, 5] = r[2, 5] = math.nan                  # NaN vs NaN
    b[2, 7] = r[2, 7] = math.inf                  # inf vs inf
    b[2, 9] = math.nan                            # NaN vs a number
    b, r = b.to(dtype), r.to(dtype)
    for rows in (b, b[:, 1000:3100]):             # contiguous and strided rows
        rr = r[:, :rows.shape[1]] if rows is b else r[:, 1000:3100]
        eager = block_stats(rows, rr, 1e-3, 1e-5)
        fused = kernels.fused_stats(rows, rr, 1e-3, 1e-5)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert fused[0, 0] > 0
    assert kernels.fused_stats(b, r, 0, 0)[2, 1] == 3  # NaN, inf and NaN-vs-number
print("fused == eager")
"""


PRINTS = r"""
import torch
from divtrace.measure import printkernels as kernels
from divtrace.measure.prints import _PERIOD, Fingerprints, _rows_at, _words
g = torch.Generator().manual_seed(0)
for shape in [(3, 5), (2, 4096), (2, 70_001), (1, 2 * _PERIOD + 3)]:
    rows = torch.randn(shape, generator=g)
    words = _words(rows)
    eager = Fingerprints().of(rows)  # on the CPU: torch's wrapping integer sums
    assert torch.equal(kernels.fused_prints(words, _PERIOD), eager), shape
    changed = rows.clone()
    changed[-1, -1] += 1
    assert not torch.equal(kernels.fused_prints(_words(changed), _PERIOD), eager)
# many rows, each its own address and length (and empty ones): one launch for all
blocks = [torch.randn(1, n, generator=g) for n in (3, 17, 1, 40_000, 2 * _PERIOD + 5)]
blocks += [torch.randn(3, 7, generator=g).to(torch.bfloat16),
           torch.randn(1, 7001, generator=g)[:, 1:]]
eager = torch.cat([Fingerprints().of(b) for b in blocks])
words = [_words(b.reshape(b.shape[0], -1)) for b in blocks]
many = kernels.fused_many_prints(words + [torch.empty(2, 0, dtype=torch.int64)], _PERIOD)
assert torch.equal(many[:-2], eager) and not many[-2:].any(), (many, eager)
# each row where it lies (a contiguous block of whole words), else a copy of its words
blocks += [torch.randn(2, 6, generator=g).double(), torch.randn(4, 6, generator=g).t(),
           torch.randn(3, 0), torch.randn(2, 9, generator=g)[:, 1:]]
eager = torch.cat([Fingerprints().of(b) for b in blocks])
held = []
records = [r for b in blocks for r in _rows_at(b, held)]
assert len(held) == 8, len(held)  # (copied: rows not of whole words, rows that do not
#   start on a word, rows not side by side; the 40,000 and the float64 rows where they lie)
assert torch.equal(kernels.prints_at(records, torch.device("cpu"), _PERIOD), eager)
print("prints == eager")
"""


MANY = r"""
import math, sys, torch
from divtrace.measure import fused as kernels
from divtrace.measure.fields import FIELDS
device = sys.argv[1]
g = torch.Generator().manual_seed(0)
for dtype in [torch.float32, torch.float16, torch.bfloat16, torch.float64]:
    pairs = []
    for rows, cols in [(2, 100), (3, 2048), (2, 2049), (1, 5000), (4, 3), (2, 7000), (2, 96),
                       (2, 3000), (2, 4096), (1, 6000),  # (sharing a count of blocks)
                       (1, 140000), (1, 141000)]:  # (blocks enough to be combined alone)
        b = torch.randn(rows, cols, dtype=torch.float64, generator=g)
        r = b + torch.randn(rows, cols, dtype=torch.float64, generator=g) * 1e-3
        b[0, 0], r[0, 0] = 0.0, -0.0
        if cols > 10:
            b[-1, 5] = r[-1, 5] = math.nan
            b[-1, 7], b[-1, 9] = math.inf, math.nan
        pairs.append((b.to(dtype).to(device), r.to(dtype).to(device)))
    wide = torch.randn(3, 6000, generator=g).to(dtype).to(device)
    pairs.append((wide[:, 1000:3100], wide[:, 2000:4100]))  # strided rows
    pairs.append((wide[:, 1:97], wide[:, 3:99]))  # rows not aligned to 16 bytes
    grid = torch.randn(3, 4, 5, 7, generator=g).to(dtype).to(device)  # [rows, ...] blocks
    pairs.append((grid, grid + 1e-3))
    pairs.append((grid[:2].clone(), torch.randn(2, 4, 5, 7, generator=g).to(dtype).to(device)))
    many = kernels.fused_many(pairs, 1e-3, 1e-5)
    for (b, r), got in zip(pairs, many, strict=True):
        alone = kernels.fused_stats(b.reshape(len(b), -1), r.reshape(len(r), -1), 1e-3, 1e-5)
        assert got.shape == alone.shape == (len(b), len(FIELDS))
        assert torch.equal(got.contiguous().view(torch.int64),
                           alone.contiguous().view(torch.int64)), (dtype, b.shape)
    assert many[0][0, 0] > 0 and many[5][1, 1] == 3  # mismatches; NaN, inf, NaN-vs-number
    # planned once, launched again over the same memory with other values: each launch
    # gives what the pairs alone give then, in the pairs' order
    launch = kernels.ManyLaunch(pairs, 1e-3, 1e-5)
    assert not launch.copied  # (every pair's rows run along its memory)
    first = launch.gathered()
    for b, _ in pairs:
        b.mul_(3)
    again = launch.gathered()
    after = torch.cat([kernels.fused_stats(b.reshape(len(b), -1), r.reshape(len(r), -1),
                                           1e-3, 1e-5) for b, r in pairs])
    assert torch.equal(first.view(torch.int64), torch.cat(many).view(torch.int64)), dtype
    assert torch.equal(again.view(torch.int64), after.view(torch.int64)), dtype
    assert not torch.equal(first.view(torch.int64), again.view(torch.int64))
print("many == alone")
"""


QUEUED = r"""
import sys, torch
import divtrace
from divtrace.measure import fused, meter, queue
from tests import models
# the interpreter runs the kernels on the CPU: let the CUDA path take CPU tensors
fused.supports = lambda b: b.dtype in (torch.float32, torch.float64)
queue.StatsQueue.takes = lambda *args: False
limit = queue.FUSED_ELEMENTS
launches = []
run = fused.ManyLaunch.run  # every launch of the fused kernel over queued pairs
fused.ManyLaunch.run = lambda self: launches.append(len(self._spans)) or run(self)
model, x = models.variant_mlp(), torch.randn(12, 16)
wide = sys.argv[1] == "float64"  # rows beyond 2**±400 too: taken again at their scale
if wide:
    model, x = model.double(), x.double() * 2.0 ** torch.tensor([450.0, 0, -450, 0] * 3)[:, None]
found, counted = [], []
for elements, budget in ((queue.FUSED_ELEMENTS, None), (queue.FUSED_ELEMENTS, 1), (0, None)):
    queue.FUSED_ELEMENTS = elements  # 0: every site measured alone
    if budget is not None:  # a flush after every site
        meter.budget_for = lambda *args, **kwargs: budget
    launches.clear()
    found.append(divtrace.compare(model, x, samples=[0, 1, 5], progress=False,
                                  explain=["-independence"]))
    counted.append(list(launches))
for other in found[1:]:
    assert found[0].table.equals(other.table) and found[0].per_sample.equals(other.per_sample)
assert (found[0].table["mismatch"] > 0).any()
# one launch for the measured run's sites (float32) and one for the precision test's
# float64 pass (its fields show every row within the range); two for the float64 model's
# run beyond the range (as they are, and at their scale)
sites = counted[0][0]
assert counted[0] == [sites] * 2 and sites > 4, counted
assert counted[1] == [1] * sum(counted[0]) and counted[2] == [], counted
# sites of [rows, channels, height, width]: queued as they lie, as alone
class BySize(torch.nn.Module):  # the runs differ by design: a scale by the batch's size
    def forward(self, x):
        return x * (1 + 1e-3 * x.shape[0])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), BySize(), torch.nn.Conv2d(4, 2, 3),
                            torch.nn.Flatten(), torch.nn.Linear(2 * 4 * 4, 3)).eval()
x = torch.randn(6, 3, 8, 8)
if wide:
    model, x = model.double(), x.double() * 2.0 ** 450
grids = []
meter.budget_for = queue.budget_for  # (many sites a launch again)
for elements in (limit, 0):
    queue.FUSED_ELEMENTS = elements
    launches.clear()
    grids.append(divtrace.compare(model, x, samples=[0, 4], a=divtrace.Run(chunk=2),
                                  progress=False, explain=["-independence"]))
    assert max(launches, default=0) > (1 if elements else -1) and (
        bool(launches) == bool(elements)), launches
assert grids[0].table.equals(grids[1].table) and grids[0].per_sample.equals(grids[1].per_sample)
assert (grids[0].table["mismatch"] > 0).sum() >= 4
print("queued == alone")
"""


WIDE = r"""
import math, sys, numpy as np, torch
from divtrace.measure import fused, queue
from divtrace.measure.host import Host
from divtrace.measure.pair import pair_fields
from divtrace.measure import scale
from divtrace.measure.scale import SCALE, common
device = sys.argv[1]
if device == "cpu":  # the interpreter runs the kernels on the CPU
    fused.supports = lambda b: b.dtype == torch.float64
g = torch.Generator().manual_seed(0)
pairs = []
for width, scales in [(40, (450, 0, -450)), (700, (0, 0)), (5000, (600, 1, 0, -1020)),
                      (3, (0,)), (129, (-500, -500))]:
    b = torch.randn(len(scales), width, dtype=torch.float64, generator=g)
    r = b + torch.randn(b.shape, dtype=torch.float64, generator=g) * 1e-6
    power = 2.0 ** torch.tensor(scales, dtype=torch.float64)[:, None]
    pairs.append((b * power, r * power))
pairs[0][0][0, 3], pairs[0][1][0, 5], pairs[2][0][3, 7] = math.inf, math.nan, -math.inf
pairs[1][0][1], pairs[1][1][1] = 0.0, -0.0  # a row of zeros
wide = torch.randn(3, 6000, dtype=torch.float64, generator=g) * 2.0 ** 700
pairs.append((wide[:, 1000:3100], wide[:, 2000:4100]))  # strided rows
pairs = [(b.to(device), r.to(device)) for b, r in pairs]
alone = [common(pair_fields(b, r, 1e-3, 1e-5, 1 << 20)).cpu().numpy() for b, r in pairs]
for elements in (queue._WIDE_ELEMENTS, 10_000):  # in one part, and in several
    queue._WIDE_ELEMENTS = elements
    host = Host()
    wait = queue.WideQueue(host)
    places = [wait.add(b, r, 1e-3, 1e-5) for b, r in pairs]
    host.fetch()
    scales = []
    for (b, r), place, one in zip(pairs, places, alone, strict=True):
        got = place.get()
        assert got.shape == one.shape and np.array_equal(got.view(np.int64), one.view(
            np.int64)), (elements, b.shape, got, one)
        scales.append(int(got[0, SCALE]))
# (frexp's exponent: a row's largest value is 2**e times a number in [0.5, 1))
assert [s - t for s, t in zip(scales, [450, 0, 600, 0, -500, 700])] == [2, 0, 2, 0, 2, 3], scales
# every value finite and within the range, as the fields show: one launch a part, and the
# fields bit for bit those of every row taken again at 2**0 (the checks' shortcut off)
inside = []
for width, scales in [(40, (300, 0, -300)), (700, (0, 5)), (5000, (-200, 1)), (3, (0,))]:
    b = torch.randn(len(scales), width, dtype=torch.float64, generator=g)
    power = 2.0 ** torch.tensor(scales, dtype=torch.float64)[:, None]
    inside.append(((b * power).to(device), ((b + 1e-6 * torch.randn(
        b.shape, dtype=torch.float64, generator=g)) * power).to(device)))
within, scale.within = scale.within, lambda _found: False
slow = [common(pair_fields(b, r, 1e-3, 1e-5, 1 << 20)).cpu().numpy() for b, r in inside]
scale.within = within
launched = []
run = fused.ManyLaunch.run
fused.ManyLaunch.run = lambda self: launched.append(len(self._spans)) or run(self)
for elements in (queue._WIDE_ELEMENTS, 10_000):
    queue._WIDE_ELEMENTS = elements
    launched.clear()
    host = Host()
    wait = queue.WideQueue(host)
    places = [wait.add(b, r, 1e-3, 1e-5) for b, r in inside]
    host.fetch()
    for place, one in zip(places, slow, strict=True):
        got = place.get()
        assert np.array_equal(got.view(np.int64), one.view(np.int64)), (elements, got, one)
    assert sum(launched) == len(inside) and (len(launched) > 1) == (elements < 20_000), launched
print("wide queued == alone")
"""


def _run(script: str, *args: str, interpret: bool = True) -> str:
    env = os.environ | ({"TRITON_INTERPRET": "1"} if interpret else {})
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_fused_kernel_matches_the_eager_statistics() -> None:
    assert "fused == eager" in _run(CHECK)


@pytest.mark.slow
def test_the_fingerprint_kernel_gives_the_eager_fingerprints() -> None:
    assert "prints == eager" in _run(PRINTS)


@pytest.mark.slow
def test_many_sites_in_one_launch_give_each_sites_figures_bit_for_bit() -> None:
    assert "many == alone" in _run(MANY, "cpu")


@pytest.mark.slow
def test_sites_queued_for_one_launch_give_the_tables_of_sites_measured_alone() -> None:
    assert "queued == alone" in _run(QUEUED, "float32")


@pytest.mark.slow
def test_float64_sites_queued_give_the_tables_of_sites_measured_alone() -> None:
    assert "queued == alone" in _run(QUEUED, "float64")


@pytest.mark.slow
def test_float64_pairs_queued_are_taken_at_their_scale_as_alone() -> None:
    assert "wide queued == alone" in _run(WIDE, "cpu")


@pytest.mark.cuda
def test_float64_pairs_queued_on_cuda_are_taken_at_their_scale_as_alone() -> None:
    assert "wide queued == alone" in _run(WIDE, "cuda", interpret=False)


@pytest.mark.cuda
def test_many_sites_in_one_launch_on_cuda() -> None:
    assert "many == alone" in _run(MANY, "cuda", interpret=False)


@pytest.mark.cuda
def test_partial_blocks_of_many_sites_combine_as_each_sites_alone() -> None:
    """One reduction over the partial blocks of many sites (as ``fused_many_placed``
    makes it) gives each site's rows bit for bit what its own reduction gives, whatever
    the number of sites, rows and blocks."""
    import torch

    from divtrace.measure.fields import FIELDS
    from divtrace.measure.stats import reduce_blocks

    g = torch.Generator().manual_seed(0)
    differ = []
    for blocks in (2, 3, 5, 8, 9, 17, 33, 64):  # (fused_many_placed shares up to 64)
        for rows in (1, 2, 3, 8):
            for sites in (2, 7, 60):
                # magnitudes over many binades, so that the order of a sum shows
                shape = (sites * rows, blocks, len(FIELDS))
                scale = torch.exp2(torch.randint(-40, 40, shape, generator=g).double())
                partial = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).cuda()
                together = reduce_blocks(partial, 1)
                for site in range(sites):
                    part = slice(site * rows, (site + 1) * rows)
                    alone = reduce_blocks(partial[part].clone(), 1)
                    if not torch.equal(together[part].view(torch.int64),
                                       alone.view(torch.int64)):
                        differ.append((blocks, rows, sites))
                        break
    assert not differ, differ


@pytest.mark.cuda
def test_pairs_combined_alone_from_a_graph_are_each_pairs_own() -> None:
    """Pairs of more than 64 blocks a row (the prompts of a site) are combined one by one
    from a CUDA graph: bit for bit what each pair's own ``fused_stats`` gives, the graph's
    buffers used again for the next pairs of that layout."""
    import torch

    from divtrace.measure import fused, graphed

    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # the first makes the graph; the others replay it on other values
        pairs = []
        for rows, cols in ((1, 131_073), (2, 300_000), (1, 999_999), (1, 140_000)):
            scale = torch.exp2(torch.randint(-30, 30, (rows, cols), generator=g).float())
            b = torch.randn(rows, cols, generator=g) * scale
            r = b + torch.randn(rows, cols, generator=g) * scale * 1e-6
            pairs.append((b.cuda(), r.cuda()))
        placed = fused.fused_many_placed(pairs, 1e-3, 1e-5)
        assert graphed.reductions_for(pairs[0][0].device, tuple(
            (b.shape[0], -(-b.shape[1] // 2048)) for b, _ in pairs)) is not None
        for (b, r), (fields, (lo, hi)) in zip(pairs, placed, strict=True):
            alone = fused.fused_stats(b, r, 1e-3, 1e-5)
            assert torch.equal(fields[lo:hi].contiguous().view(torch.int64),
                               alone.contiguous().view(torch.int64)), b.shape
            assert (alone[:, 0] > 0).all()  # mismatching elements: real sums compared


@pytest.mark.cuda
def test_small_sites_queued_on_cuda_give_the_same_table(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    import torch
    from torchvision.models import mobilenet_v3_small

    import divtrace
    from divtrace.measure import queue

    torch.manual_seed(0)
    model = mobilenet_v3_small().eval().cuda()
    x = torch.rand(8, 3, 64, 64, device="cuda")
    results = []
    for elements in (queue.FUSED_ELEMENTS, 0):  # queued; each site alone
        monkeypatch.setattr(queue, "FUSED_ELEMENTS", elements)
        results.append(divtrace.compare(model, x, a=divtrace.Run(chunk=2), samples=[0, 1, 5],
                                        progress=False))
    queued, alone = results
    assert queued.table.equals(alone.table)
    assert queued.per_sample.equals(alone.per_sample)
    assert (queued.table["mismatch"] > 0).any()
