"""The floor under a graphed split run: the bare per-sample loop, eager, against the same
loop replayed from a CUDA graph of the bare model (no hook, no copy), one pass per replay
and as many side by side as divtrace's lanes (each on a stream of its own), and
divtrace's graphed split run (hooks and copies inside the graph) beside them. Where the
one-pass graph is no faster than the eager loop, the loop is bound by the GPU's own work
in one pass; lanes run several such passes at once.

    python benchmarks/graph_floor.py [--repeats 5] [--cases ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graphs import CASES, build
from overhead import use_seed_settings

from divtrace.plan.inputs import prepare_input
from divtrace.plan.samples import chunks_for
from divtrace.plan.selection import select_modules
from divtrace.record.graphs import MAX_LANES, GraphedRun
from divtrace.record.hooks import ModuleHooks
from divtrace.record.rows import RowStore


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _case(name: str, repeats: int) -> list[float]:
    """The eager loop, the bare graph's replays and divtrace's graphed run, in ms."""
    case = CASES[name]
    model, x = build(case, torch.device("cuda"))
    size = case["batch"]
    static = x[:1].clone()
    graph = torch.cuda.CUDAGraph()
    batch, samples = prepare_input(x), list(range(size))
    recorder = ModuleHooks(select_modules(model, None))

    def eager() -> None:
        for i in range(size):
            model(x[i:i + 1])

    def replays() -> None:
        for i in range(size):
            static.copy_(x[i:i + 1])
            graph.replay()

    lanes = [x[:1].clone() for _ in range(MAX_LANES)]
    laned = torch.cuda.CUDAGraph()

    def side_by_side() -> None:
        for start in range(0, size, MAX_LANES):
            for i, lane in enumerate(lanes):
                lane.copy_(x[min(start + i, size - 1)].unsqueeze(0))
            laned.replay()

    def graphed() -> None:
        store = RowStore(samples, 0)
        GraphedRun(True).drive(model, recorder, store, batch, chunks_for(samples, 1, size),
                               lambda _s, _e: name)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            model(static)
        streams = [torch.cuda.Stream() for _ in lanes]
        with torch.cuda.graph(laned):
            start = torch.cuda.current_stream()
            for stream, lane in zip(streams, lanes, strict=True):
                stream.wait_stream(start)
                with torch.cuda.stream(stream):
                    model(lane)
            for stream in streams:
                start.wait_stream(stream)
        ways = (eager, replays, side_by_side, graphed)
        for fn in ways:
            fn()  # warm-up
        return [_median_ms(fn, repeats) for fn in ways]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    per_sample = [name for name, case in CASES.items() if case["chunk"] == 1]
    parser.add_argument("--cases", nargs="*", default=per_sample, choices=per_sample)
    args = parser.parse_args()
    device = torch.device("cuda")
    use_seed_settings(device)
    print(f"| case | eager loop (ms) | bare graph replays (ms) | bare graph, {MAX_LANES} "
          f"passes side by side (ms) | divtrace graphed split run (ms) |")
    print("|---|---|---|---|---|")
    for name in args.cases:
        eager, replays, side_by_side, graphed = _case(name, args.repeats)
        print(f"| {name} | {eager:.1f} | {replays:.1f} | {side_by_side:.1f} "
              f"| {graphed:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
