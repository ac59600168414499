"""Where compare()'s time goes: each phase timed against its bare counterpart, and the
whole compare() beside them (on CUDA with the settings of overhead.py: cuDNN
deterministic, no benchmark, TF32 off). "no-op hooks": a PyTorch forward hook that does
nothing on every module; "hooks on": divtrace's hooks with a sink that does nothing,
attached beforehand; "empty hooks": the same through the chunk loop, attaching included.

    python benchmarks/phases.py [--device cuda] [--case alexnet_b100_per_sample]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graphs import CASES, build
from overhead import timed, use_seed_settings, with_divtrace

from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.plan.inputs import prepare_input
from divtrace.plan.samples import chunks_for
from divtrace.plan.selection import select_modules
from divtrace.record.graphs import GraphedRun
from divtrace.record.hooks import ModuleHooks
from divtrace.record.loop import drive
from divtrace.record.recorder import Sink
from divtrace.record.rows import RowStore


def _label(start: int, stop: int) -> str:
    return f"rows {start}:{stop}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--case", default="alexnet_b100_per_sample", choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    use_seed_settings(device)
    case = CASES[args.case]
    model, x = build(case, device)
    samples = case["samples"] or list(range(case["batch"]))
    chunks = chunks_for(samples, case["chunk"], case["batch"])
    batch = prepare_input(x, 0)
    recorder = ModuleHooks(select_modules(model, None))

    def bare_split() -> None:
        for start, stop in chunks:
            model(x[start:stop])

    def hooked_split() -> RowStore:  # the reference run, as compare() records it
        store = RowStore(samples, 0)
        drive(model, recorder, store, batch, chunks, _label)
        return store

    outcomes = []

    def graphed_split() -> RowStore:  # the same, replayed from a CUDA graph
        store = RowStore(samples, 0)
        graphed = GraphedRun(True)
        graphed.drive(model, recorder, store, batch, chunks, _label)
        outcomes.append(graphed.outcome)
        return store

    def hooked_batched(store: RowStore) -> None:  # the measured run and the host transfer
        host = Host()
        drive(model, recorder, Meter(store, case["batch"], host), batch,
              [(0, case["batch"])], _label)
        host.fetch()

    def empty_hooks_split() -> None:  # the same loop, with a sink that does nothing
        drive(model, recorder, Sink(), batch, chunks, _label)

    def attached_hooks_split() -> None:  # divtrace's hooks on, a sink doing nothing: the
        with recorder.observe(Sink()) as tracker:  # calls alone, the attaching apart
            started = time.perf_counter()
            for start, stop in chunks:
                tracker.reset(stop - start)
                model(x[start:stop])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            attached.append(time.perf_counter() - started)

    def noop_hooks_split() -> None:  # PyTorch's own hooks that do nothing, on every module
        handles = [m.register_forward_hook(lambda *_: None) for m in model.modules()]
        try:
            timed_noop.append(timed(bare_split, device))
        finally:
            for handle in handles:
                handle.remove()

    attached: list[float] = []
    timed_noop: list[float] = []

    with torch.no_grad():
        for fn in (bare_split, empty_hooks_split, lambda: model(x)):
            fn()
        with_divtrace(model, x, case)
        rows: dict[str, list[float]] = {
            "bare batched": [], "bare split": [], "split, no-op hooks": timed_noop,
            "split, hooks on": attached, "split, empty hooks": [],
            "split, recording": [], "split, graphed": [], "batched, measuring": [],
            "compare()": []}
        for _ in range(args.repeats):
            rows["bare batched"].append(timed(lambda: model(x), device))
            rows["bare split"].append(timed(bare_split, device))
            noop_hooks_split()
            attached_hooks_split()
            rows["split, empty hooks"].append(timed(empty_hooks_split, device))
            box: list[RowStore] = []
            rows["split, recording"].append(
                timed(lambda box=box: box.append(hooked_split()), device))
            if device.type == "cuda" and len(chunks) > 1:  # a graph replays passes 2, 3, ...
                rows["split, graphed"].append(timed(graphed_split, device))
            rows["batched, measuring"].append(
                timed(lambda box=box: hooked_batched(box[0]), device))
            rows["compare()"].append(timed(lambda: with_divtrace(model, x, case), device))
    for name, times in rows.items():
        if times:
            print(f"{name:>20}: {statistics.median(times) * 1e3:8.2f} ms")
    if outcomes:
        print(f"the last graphed split run: {outcomes[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
