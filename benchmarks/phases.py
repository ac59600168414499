"""Where compare()'s time goes: each phase timed against its bare counterpart.

    python benchmarks/phases.py [--device cuda] [--case alexnet_b100_per_sample]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import CASES, build, timed

from divtrace.batch import chunks_for
from divtrace.measure import Meter
from divtrace.record import observe
from divtrace.sites import select_modules
from divtrace.split import SplitRecording


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--case", default="alexnet_b100_per_sample", choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    case = CASES[args.case]
    model, x = build(case, device)
    samples = case["samples"] or list(range(case["batch"]))
    chunks = chunks_for(samples, case["chunk"], case["batch"])
    selected = select_modules(model, None)

    def bare_split() -> None:
        for start, stop in chunks:
            model(x[start:stop])

    def hooked_split() -> SplitRecording:
        split = SplitRecording(samples, 0, False, case["chunk"])
        with observe(selected, split) as tracker:
            for start, stop in chunks:
                done = False
                while not done:
                    tracker.reset()
                    split.begin_chunk(start, stop)
                    model(x[start:stop])
                    done = split.end_chunk()
        return split

    def hooked_batched(split: SplitRecording) -> None:
        meter = Meter(split, None, None, False)
        with observe(selected, lambda s, t: meter.measure(s, t, case["batch"])):
            model(x)
        stats = [s.stats for s in meter.sites if s.stats is not None]
        torch.cat([s.reshape(-1) for s in stats]).cpu()

    def nothing(site: object, tensor: object) -> None:
        return None

    def empty_hooks_split() -> None:
        with observe(selected, nothing) as tracker:
            for start, stop in chunks:
                tracker.reset()
                model(x[start:stop])

    with torch.no_grad():
        for fn in (bare_split, empty_hooks_split, lambda: model(x)):
            fn()
        rows = {"bare batched": [], "bare split": [], "split, empty hooks": [],
                "split, recording": [], "batched, measuring": []}
        for _ in range(args.repeats):
            rows["bare batched"].append(timed(lambda: model(x), device))
            rows["bare split"].append(timed(bare_split, device))
            rows["split, empty hooks"].append(timed(empty_hooks_split, device))
            box: list[SplitRecording] = []
            rows["split, recording"].append(
                timed(lambda box=box: box.append(hooked_split()), device))
            rows["batched, measuring"].append(
                timed(lambda box=box: hooked_batched(box[0]), device))
    for name, times in rows.items():
        print(f"{name:>20}: {statistics.median(times) * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
