"""Where the time of one ``compare()`` goes, timed inside its calls: the plan, the
guard's snapshot of the buffers, run a's recording, run b's measuring, the statistics
computed together at the fetch, the table's figures and its DataFrame; beside the bare
passes (run a's split passes, the batched pass) and the whole call. Medians of
interleaved repeats, in one process. ``--output-only``: the call observes only the
model's output (``modules=[]``), so what it costs beyond the bare passes is its own.

    python -m benchmarks parts [--model mobilenet_v3_small] [--chunk 1] [--device cpu]
        [--repeats 9] [--output-only]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import divtrace
from benchmarks.common import calls_timed, timed, use_seed_settings
from divtrace import pipeline
from divtrace.measure.host import Host
from divtrace.plan.samples import chunks_for
from divtrace.record import guard
from divtrace.report import table


def main(argv: list[str]) -> int:
    import torchvision.models

    parser = argparse.ArgumentParser(prog="python -m benchmarks parts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--chunk", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output-only", action="store_true",
                        help="observe only the model's output (modules=[])")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    use_seed_settings(device)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().eval().to(device)
    x = torch.rand(16, 3, 64, 64, device=device)
    samples = [0, 1]
    chunks = chunks_for(samples, args.chunk, len(x))
    selection: dict[str, Any] = {"modules": []} if args.output_only else {}
    entry = importlib.import_module("divtrace.compare")
    parts = ((entry, "make_plan", "plan"),
             (pipeline, "record", "run a, recording"),
             (pipeline, "_measure", "run b, measuring"),
             (Host, "fetch", "statistics together, at the fetch"),
             (table, "_measured_rows", "the table's figures"),
             (guard, "_snapshot", "the guard's snapshot of the buffers"),
             (table.pd.DataFrame, "__init__", "the table's DataFrame"))

    def split() -> None:
        with torch.no_grad():
            for start, stop in chunks:
                model(x[start:stop])

    def batched() -> None:
        with torch.no_grad():
            model(x)

    ways: dict[str, Callable[[], object]] = {
        "bare split passes": split, "bare batched pass": batched,
        "compare()": lambda: divtrace.compare(model, x, samples=samples,
                                              a=divtrace.Run(chunk=args.chunk),
                                              progress=False, **selection)}
    times: defaultdict[str, list[float]] = defaultdict(list)
    with calls_timed(parts, lambda label, seconds: times[label].append(seconds), device):
        for fn in ways.values():
            fn()
        times.clear()
        for _ in range(args.repeats):
            for label, fn in ways.items():
                times[label].append(timed(fn, device))
    print(f"{args.model}, batch 16 of 3x64x64, samples {samples}, chunk {args.chunk}, "
          f"{args.device}{', output only' if args.output_only else ''}:")
    for label, values in times.items():
        print(f"  {label:36} {statistics.median(values) * 1e3:8.2f} ms")
    return 0
