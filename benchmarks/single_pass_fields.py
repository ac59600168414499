"""What one pass over the rows would save on the CPU, and which figures it would change.

The fields of a model's queued sites (batch 16 of 3×64×64, samples [0, 1], per sample)
are computed two ways, beside the bare passes, in one process, medians of interleaved
repeats:

- as divtrace computes them: the queue's flush (one ``block_stats`` of a few dozen torch
  calls per dtype, tolerance and row width);
- by a single pass over each pair of rows, compiled with numba (``pip install numba``; not
  a dependency of divtrace), the rows first gathered into one array per run (timed with
  the gathering, and alone).

It then prints, per field, in how many rows the single pass gives divtrace's value bit
for bit, and the largest relative difference: its sums do not follow torch's reduction
order, it sums squares where divtrace squares a float64 norm, and it sums the dot product
(which no figure reads) in float64 where divtrace sums it in the rows' dtype.

    python benchmarks/single_pass_fields.py [--model mobilenet_v3_small] [--repeats 41]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from floors import passes

import divtrace
from divtrace.measure.fields import FIELDS, INDEX
from divtrace.measure.host import Host
from divtrace.measure.queue import StatsQueue

_Pairs = list[tuple[torch.Tensor, torch.Tensor, float, float]]


def queued_pairs(model: torch.nn.Module, x: torch.Tensor) -> _Pairs:
    """The pairs of blocks one ``compare()`` call queues on the CPU (copies of them)."""
    pairs: _Pairs = []
    original = StatsQueue._measure

    def keep(self: StatsQueue, key: tuple[Any, ...], group: list[Any]) -> None:
        _dtype, rtol, atol, _width, _same = key
        pairs.extend((b.clone(), r.clone(), rtol, atol) for _, b, r in group)
        original(self, key, group)

    StatsQueue._measure = keep  # type: ignore[method-assign]
    try:
        divtrace.compare(model, x, samples=[0, 1], progress=False)
    finally:
        StatsQueue._measure = original  # type: ignore[method-assign]
    return pairs


def divtrace_fields(pairs: _Pairs) -> tuple[float, np.ndarray]:
    """The queue's flush of ``pairs``: its time, and every row's fields."""
    host = Host()
    queue = StatsQueue(host, budget=1 << 40)  # one flush
    places = [queue.add(b, r, rtol, atol) for b, r, rtol, atol in pairs]
    began = time.perf_counter()
    queue.flush()
    spent = time.perf_counter() - began
    host.fetch()
    return spent, np.concatenate([place.get() for place in places])


def single_pass(pairs: _Pairs, kernel: Any) -> tuple[float, float, np.ndarray]:
    """The single pass over ``pairs``: its time with the rows gathered first, the pass's
    own time, and the fields."""
    began = time.perf_counter()
    b = torch.cat([b.reshape(-1) for b, _, _, _ in pairs]).numpy()
    r = torch.cat([r.reshape(-1) for _, r, _, _ in pairs]).numpy()
    widths = np.array([b.shape[1] for b, _, _, _ in pairs for _ in range(b.shape[0])])
    starts = np.cumsum(widths) - widths
    rtol, atol = pairs[0][2], pairs[0][3]
    out = np.empty((len(widths), len(FIELDS)))
    gathered = time.perf_counter()
    kernel(b, r, starts, widths, rtol, atol, out, INDEX["mismatch"], INDEX["nonfinite"],
           INDEX["exceed"], INDEX["max_abs"], INDEX["sum_abs"], INDEX["sq_diff"],
           INDEX["sq_ref"], INDEX["sq_out"], INDEX["dot"], INDEX["max_ulp"])
    done = time.perf_counter()
    return done - began, done - gathered, out


def compile_kernel() -> Any:
    """The single pass, compiled (float32 rows; NaN and infinities as divtrace counts
    them; the ULP distance across zero as divtrace measures it)."""
    from numba import njit, prange

    @njit(parallel=True)  # type: ignore[misc]
    def fields(b: Any, r: Any, starts: Any, widths: Any, rtol: float, atol: float,
               out: Any, MISMATCH: int, NONFINITE: int, EXCEED: int, MAX_ABS: int,
               SUM_ABS: int, SQ_DIFF: int, SQ_REF: int, SQ_OUT: int, DOT: int,
               MAX_ULP: int) -> None:
        bits_b, bits_r = b.view(np.int32), r.view(np.int32)
        for row in prange(starts.shape[0]):
            mismatch = nonfinite = exceed = ulp = 0
            largest = sum_abs = sq_diff = sq_ref = sq_out = dot = 0.0
            for i in range(starts[row], starts[row] + widths[row]):
                x, y = b[i], r[i]
                diff = abs(np.float32(x - y))
                if not np.isfinite(diff):
                    nonfinite += 1
                    if x != y and not (np.isnan(x) and np.isnan(y)):
                        mismatch += 1
                        exceed += 1
                    continue
                mismatch += diff != 0
                exceed += diff > np.float32(abs(y) * np.float32(rtol)) + np.float32(atol)
                largest = max(largest, np.float64(diff))
                sum_abs += np.float64(diff)
                sq_diff += np.float64(diff) * np.float64(diff)
                sq_ref += np.float64(y) * np.float64(y)
                sq_out += np.float64(x) * np.float64(x)
                dot += np.float64(x) * np.float64(y)
                xb, yb = np.int64(bits_b[i]), np.int64(bits_r[i])
                distance = ((xb & 0x7FFFFFFF) + (yb & 0x7FFFFFFF) if (xb ^ yb) < 0
                            else abs(xb - yb))
                ulp = max(ulp, distance)
            out[row, MISMATCH], out[row, NONFINITE], out[row, EXCEED] = mismatch, nonfinite, exceed
            out[row, MAX_ABS], out[row, SUM_ABS], out[row, SQ_DIFF] = largest, sum_abs, sq_diff
            out[row, SQ_REF], out[row, SQ_OUT], out[row, DOT] = sq_ref, sq_out, dot
            out[row, MAX_ULP] = ulp

    return fields


def main() -> int:
    import torchvision.models

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    try:
        import numba
    except ImportError:
        print("numba is not installed (pip install numba): nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().eval()
    x = torch.rand(16, 3, 64, 64)
    pairs = queued_pairs(model, x)
    if any(b.dtype != torch.float32 for b, _, _, _ in pairs) or len(
            {(rtol, atol) for _, _, rtol, atol in pairs}) != 1:
        print("the single pass here takes float32 rows of one tolerance only")
        return 1
    kernel = compile_kernel()
    single_pass(pairs, kernel)  # compiled on first use

    bare = passes(model, x)
    times: dict[str, list[float]] = {"bare": [], "divtrace": [], "single pass": [],
                                     "the pass alone": []}
    for _ in range(args.repeats):
        began = time.perf_counter()
        bare()
        times["bare"].append(time.perf_counter() - began)
        times["divtrace"].append(divtrace_fields(pairs)[0])
        whole, alone, _ = single_pass(pairs, kernel)
        times["single pass"].append(whole)
        times["the pass alone"].append(alone)
    median = {way: statistics.median(t) for way, t in times.items()}
    rows = sum(b.shape[0] for b, _, _, _ in pairs)
    elements = sum(b.numel() for b, _, _, _ in pairs)
    print(f"{args.model}: {len(pairs)} queued sites, {rows} rows, {elements} compared "
          f"elements per run; bare passes {median['bare'] * 1e3:.2f} ms")
    for way in ("divtrace", "single pass", "the pass alone"):
        print(f"  {way:14} {median[way] * 1e3:6.2f} ms  {median[way] / median['bare']:.2f}× "
              f"the bare passes")
    ours, theirs = divtrace_fields(pairs)[1], single_pass(pairs, kernel)[2]
    for field in FIELDS:
        a, b = ours[:, INDEX[field.name]], theirs[:, INDEX[field.name]]
        same = int(np.sum(a.view(np.int64) == b.view(np.int64)))
        scale = np.maximum(np.abs(a), np.finfo(np.float64).tiny)
        worst = float(np.max(np.abs(a - b) / scale))
        print(f"  {field.name:10} the same bits in {same}/{len(a)} rows; largest relative "
              f"difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
