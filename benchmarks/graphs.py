"""The split run replayed from a CUDA graph against the eager one, as ratios to the bare
eager passes a user would otherwise write (the split loop plus the batched pass, no hook).

For each case, in one process, interleaved, medians: the bare passes, ``compare(...,
graphs=False)`` and ``compare(..., graphs="auto")``; peak memory above the memory in use
before (the allocator's peak), the stored rows and the graph's own pool; and whether
both give the same table (they must).

    python benchmarks/graphs.py [--repeats 5] [--cases ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import bare_passes, cuda_peak, timed, use_seed_settings

import divtrace

CASES: dict[str, dict[str, Any]] = {
    "alexnet_b100_per_sample": {"model": "alexnet", "batch": 100, "size": 224, "chunk": 1,
                                "samples": None},
    "resnet50_b64_per_sample": {"model": "resnet50", "batch": 64, "size": 224, "chunk": 1,
                                "samples": None},
    "vgg11_features_b128_chunk2": {"model": "vgg11_features", "batch": 128, "size": 128,
                                   "chunk": 2, "samples": [0, 1]},
    "vgg11_features_b32_per_sample": {"model": "vgg11_features", "batch": 32, "size": 128,
                                      "chunk": 1, "samples": None},
    "mlp_b8_per_sample": {"model": "mlp", "batch": 8, "size": 256, "chunk": 1,
                          "samples": None},
    # hundreds of small sites, one split pass (benchmarks/many_sites.py --chunk 2)
    "mobilenet_v3_small_b16_chunk2": {"model": "mobilenet_v3_small", "batch": 16,
                                      "size": 64, "chunk": 2, "samples": [0, 1]},
    "resnet18_b16_samples01": {"model": "resnet18", "batch": 16, "size": 64, "chunk": 1,
                               "samples": [0, 1]},
}


def build(case: dict[str, Any], device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    import torchvision.models

    torch.manual_seed(0)
    name, size = case["model"], case["size"]
    if name == "mlp":  # a small model: passes of a few kernels
        layers = [nn.Sequential(nn.Linear(size, size), nn.GELU()) for _ in range(4)]
        return nn.Sequential(*layers).eval().to(device), torch.randn(case["batch"], size,
                                                                       device=device)
    model = (torchvision.models.vgg11().features if name == "vgg11_features"
             else getattr(torchvision.models, name)())
    x = torch.rand(case["batch"], 3, size, size)
    return model.eval().to(device), x.to(device)


def measure(name: str, device: torch.device, repeats: int) -> dict[str, Any]:
    case = CASES[name]
    model, x = build(case, device)
    ways = {
        "bare": lambda: bare_passes(model, x, case),
        "eager": lambda: divtrace.compare(model, x, a=divtrace.Run(chunk=case["chunk"]),
                                          resources=divtrace.Resources(graphs=False),
                                          samples=case["samples"],
                                          progress=False),
        "graphs": lambda: divtrace.compare(model, x, a=divtrace.Run(chunk=case["chunk"]),
                                           resources=divtrace.Resources(graphs="auto"),
                                           samples=case["samples"],
                                           progress=False),
    }
    for fn in ways.values():
        fn()  # warm-up: kernels, algorithm choice, allocator
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, fn in ways.items():
            times[way].append(timed(fn, device))
    median = {way: statistics.median(t) for way, t in times.items()}
    peaks: dict[str, int] = {}
    results: dict[str, Any] = {}
    for way, fn in ways.items():
        peaks[way], results[way] = cuda_peak(fn, device)
    graphed, eager = results["graphs"], results["eager"]
    run = graphed.meta.graphed["a"]
    stored = graphed.meta.stored_bytes
    return {
        "case": name, "repeats": repeats, "bare_s": median["bare"],
        "eager_ratio": median["eager"] / median["bare"],
        "graphs_ratio": median["graphs"] / median["bare"],
        "replayed": run["replayed"], "passes": run["passes"], "reason": run["reason"],
        "lanes": run["lanes"], "capture_s": run["capture_s"],
        "same_table": bool(graphed.table.equals(eager.table)
                           and graphed.per_sample.equals(eager.per_sample)),
        "stored_bytes": stored, "pool_bytes": run["pool_bytes"],
        "bare_peak_bytes": peaks["bare"], "eager_peak_bytes": peaks["eager"],
        "graphs_peak_bytes": peaks["graphs"],
        "graphs_extra_over_stored_and_pool":
            (peaks["graphs"] - peaks["bare"]) / (stored + run["pool_bytes"]),
        "eager_extra_over_stored": (peaks["eager"] - peaks["bare"]) / stored,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    use_seed_settings(device)
    rows = [measure(name, device, args.repeats) for name in args.cases]
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(device)}
    print(f"environment: {env}")
    print("| case | bare (ms) | eager | graphs | replayed | lanes | capture (ms) | same table "
          "| stored (MiB) | pool (MiB) | graphs extra / (stored + pool) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['bare_s'] * 1e3:.1f} | {r['eager_ratio']:.2f}× "
              f"| {r['graphs_ratio']:.2f}× | {r['replayed']}/{r['passes']} | {r['lanes']} "
              f"| {r['capture_s'] * 1e3:.0f} "
              f"| {r['same_table']} | {r['stored_bytes'] / 2**20:.0f} "
              f"| {r['pool_bytes'] / 2**20:.0f} "
              f"| {r['graphs_extra_over_stored_and_pool']:.3f} |")
        if r["reason"]:
            print(f"  ({r['case']}: {r['reason']})")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
