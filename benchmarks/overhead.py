"""Time and peak memory of ``compare()`` against the bare forward passes it must run.

The bare passes are run a's chunks that hold the compared samples plus the batched pass,
without hooks. The floor is those passes and the passes the verdict's tests made in that
call, run without divtrace (``benchmarks.common.floor_passes``): a pass per group of the
independence test, and the precision test's float64 copy of the model with the bare
passes in float64. Each repeat times the bare passes, the floor, ``compare()`` (and with
``--old`` an older checkout's), in rotating order; the figures are medians. Peak memory: on CUDA the
allocator's peak above the memory in use before the call, on the CPU the resident set's
(Linux). "extra / stored" is the extra peak over the bare passes' peak, divided by the
bytes of run a's rows that ``compare()`` keeps. Options are measured each on its own:
``independence=off``, ``precision=off``, ``local``, ``fp64``, ``repeat=1``, ``kernels``,
``graphs=False``.
``--remedies``: also what ``Comparison.remedies()`` costs (each candidate verified by a
comparison of its own, then timed ``--remedy-repeats`` times), over the bare passes and
over ``compare()``.

    python -m benchmarks overhead [--device cuda] [--repeats 5] [--cases ...]
        [--options default independence=off ...] [--old CHECKOUT] [--json out.json]
        [--remedies] [--remedy-repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import divtrace
from benchmarks.common import (
    CASES,
    OPTIONS,
    arguments,
    bare_passes,
    build,
    environment,
    floor_passes,
    load_old,
    mapped_frees,
    peak,
    stored_bytes,
    timed,
    use_seed_settings,
)

#: The cases measured unless ``--cases`` names others.
DEFAULT_CASES = ("vgg11_features_b128_chunk2", "alexnet_b100_per_sample")


def measure(name: str, device: torch.device, repeats: int, option: str,
            old: Any = None) -> dict[str, Any]:
    case = CASES[name]
    model, x = build(case, device)

    def run(package: Any) -> Callable[[], object]:
        kwargs = arguments(package, case["chunk"], case["samples"], option)
        return lambda: package.compare(model, x, **kwargs)

    ways = {"bare": lambda: bare_passes(model, x, case), "new": run(divtrace)}
    if old is not None:
        ways["old"] = run(old)
    for fn in ways.values():  # warm-up: kernels, algorithm choice, allocator
        fn()
    notes = ways["new"]().meta.notes  # type: ignore[attr-defined]
    other = torch.rand_like(x)
    ways["floor"] = lambda: floor_passes(model, x, case, notes, other)
    ways["floor"]()
    times: dict[str, list[float]] = {way: [] for way in ways}
    order = list(ways)
    for i in range(repeats):
        for way in order[i % len(order):] + order[:i % len(order)]:
            times[way].append(timed(ways[way], device))
    median = {way: statistics.median(t) for way, t in times.items()}
    bare_peak, _ = peak(ways["bare"], device)
    new_peak, result = peak(ways["new"], device)
    stored = stored_bytes(result)
    row = {"case": name, "options": option, "device": str(device), "repeats": repeats,
           "bare_s": median["bare"], "compare_s": median["new"],
           "time_ratio": median["new"] / median["bare"],
           "floor_s": median["floor"], "floor_ratio": median["floor"] / median["bare"],
           "over_floor": median["new"] / median["floor"],
           "bare_peak_bytes": bare_peak, "compare_peak_bytes": new_peak,
           "stored_bytes": stored,
           "extra_over_stored": (new_peak - bare_peak) / stored if stored else float("nan")}
    graphed = result.meta.graphed.get("a")  # type: ignore[attr-defined]
    if graphed:
        row["replayed"], row["passes"] = graphed["replayed"], graphed["passes"]
    if old is not None:
        row["old_s"], row["old_ratio"] = median["old"], median["old"] / median["bare"]
        row["new_over_old"] = median["new"] / median["old"]
    return row


def remedies(name: str, device: torch.device, repeats: int, compare_s: float,
             bare_s: float) -> dict[str, Any]:
    """The time of one ``remedies()`` call, over the bare passes and over compare()."""
    case = CASES[name]
    model, x = build(case, device)
    result = divtrace.compare(model, x, **arguments(divtrace, case["chunk"], case["samples"]))
    seconds = timed(lambda: result.remedies(repeats=repeats, progress=False), device)
    found = result.remedies(repeats=repeats, progress=False)
    tried = int(found.table["identical"].notna().sum())
    best = found.best
    return {"case": name, "remedies_s": seconds, "remedy_repeats": repeats,
            "tried": tried, "over_bare": seconds / bare_s, "over_compare": seconds / compare_s,
            "best": None if best is None else best.name}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=list(CASES))
    parser.add_argument("--options", nargs="*", default=["default"], choices=list(OPTIONS),
                        help="compare() options to measure, each on its own")
    parser.add_argument("--old", type=Path, help="an older checkout, timed beside this one")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--remedies", action="store_true",
                        help="also time Comparison.remedies() on each case")
    parser.add_argument("--remedy-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    mapped_frees(device)
    use_seed_settings(device)
    old = load_old(args.old) if args.old else None
    rows = [measure(name, device, args.repeats, option, old)
            for name in args.cases for option in args.options]
    env = environment(device)
    print(f"environment: {env}")
    print("| case | options | bare (s) | floor | compare (s) | time ratio | over the floor "
          "| older | stored (MiB) | extra peak (MiB) | extra / stored |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = (r["compare_peak_bytes"] - r["bare_peak_bytes"]) / 2**20
        older = f"{r['old_ratio']:.3f}" if "old_ratio" in r else "-"
        print(f"| {r['case']} | {r['options']} | {r['bare_s']:.4f} | {r['floor_ratio']:.3f} "
              f"| {r['compare_s']:.4f} | {r['time_ratio']:.3f} | {r['over_floor']:.3f} "
              f"| {older} | {r['stored_bytes'] / 2**20:.1f} "
              f"| {extra:.1f} | {r['extra_over_stored']:.3f} |")
    found = [remedies(r["case"], device, args.remedy_repeats, r["compare_s"], r["bare_s"])
             for r in rows if args.remedies and r["options"] == "default"]
    if found:
        print("\n| case | remedies() (s) | candidates tried | over the bare passes "
              "| over compare() | best |")
        print("|---|---|---|---|---|---|")
    for r in found:
        print(f"| {r['case']} | {r['remedies_s']:.2f} | {r['tried']} | {r['over_bare']:.1f} "
              f"| {r['over_compare']:.1f} | {r['best']} |")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": rows,
                                         "remedies": found}, indent=1))
    return 0
