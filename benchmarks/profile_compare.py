"""Where the time of one ``compare()`` goes: cProfile of a comparison of a torchvision
model (random weights), after a warm-up, the top functions by their own time and by
cumulative time.

    python benchmarks/profile_compare.py [--model mobilenet_v3_small] [--device cuda]
        [--batch 16] [--size 64] [--chunk 2] [--samples 0 1] [--graphs auto]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import divtrace


def main() -> int:
    import torchvision.models

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2)
    parser.add_argument("--samples", type=int, nargs="*", default=[0, 1],
                        help="the compared rows (none given: all)")
    parser.add_argument("--graphs", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().eval().to(device)
    x = torch.rand(args.batch, 3, args.size, args.size, device=device)
    graphs = {"auto": "auto", "on": True, "off": False}[args.graphs]

    def run() -> divtrace.Comparison:
        result = divtrace.compare(model, x, a=divtrace.Run(chunk=args.chunk),
                                  resources=divtrace.Resources(graphs=graphs), samples=args.samples or None, progress=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return result

    run()
    start = time.perf_counter()
    result = run()
    print(f"{args.model}: {len(result.table)} sites, compare() {time.perf_counter() - start:.4f} s,"
          f" graphs {dict(result.meta['graphed'])}")
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
