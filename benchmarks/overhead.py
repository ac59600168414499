"""Time and peak memory of ``compare()`` against the bare forward passes it must run.

The bare passes are run a's chunks that hold the compared samples plus the batched pass,
without hooks. The floor is those passes and the passes the verdict's tests made in that
call, run without divtrace (``benchmarks.common.floor_passes``): a pass per group of the
independence test, and the precision test's float64 copy of the model with the bare
passes in float64. Each repeat times the bare passes, the floor, ``compare()`` (and with
``--old`` an older checkout's), in rotating order; the figures are medians. Peak memory: on CUDA the
allocator's peak above the memory in use before the call, on the CPU the resident set's
(Linux), taken in a child process where glibc maps every large block so that frees leave
the resident set (``benchmarks.common.cpu_peaks``; the timings run with glibc's own
setting, as a user's process does). "extra / stored" is the extra peak over the bare
passes' peak, divided by the bytes of run a's rows that ``compare()`` keeps. Options
are measured each on its own: ``independence=off``, ``precision=off``, ``local``,
``fp64``, ``repeat=1``, ``kernels``, ``graphs=False``.
``--remedies``: also what ``Comparison.remedies()`` costs (each candidate verified by a
comparison of its own, then timed ``--remedy-repeats`` times), over the bare passes and
over ``compare()``.

    python -m benchmarks overhead [--device cuda] [--repeats 5] [--cases ...]
        [--options default independence=off ...] [--old CHECKOUT] [--json out.json]
        [--remedies] [--remedy-repeats 5]

``floor`` (:func:`floor_main`): every case against its floor, in one run — the table that
opens ``docs/performance.md``. For each case: the bare passes, **the floor** (the bare
passes plus the passes the default verdict's tests make, run without divtrace:
``benchmarks.common.floor_passes``, ``backward.floor``, for prompts the independence
test's batched passes and the float64 passes), divtrace's default call, and with
``--old`` an older checkout's call, timed in the same rotation; medians of ``--repeats``
after a first call, whose time is given against the warm call ("first / warm"; on a fresh
machine the first case's first call compiles the Triton kernels; ``--triton-cache DIR``
keeps Triton's compiled kernels there for the run: an empty directory gives the first
call of a fresh machine, the same directory again that of a new process on a machine
that has compiled them). "extra / stored": the
peak memory beyond the floor's peak (image cases; prompts on CUDA: beyond the bare
passes'), per byte of run a's rows the call keeps.

The cases: on the CPU, the small-site nets at chunk 2 (mobilenet_v3_small,
efficientnet_b0, resnet18; batch 16 of 3×64×64), mobilenet_v3_small per sample,
vgg11().features b128 chunk 2, a small Llama's prompts and its ``compare_backward`` in
float32; on CUDA the same nets, AlexNet b100 and ResNet50 b64 per sample (graphed), the
8B-shaped Llama's prompts in bfloat16 and ``compare_backward`` in bfloat16 and float32.

    python -m benchmarks floor [--device cuda] [--repeats 5] [--old CHECKOUT]
        [--only NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import divtrace
from benchmarks import backward, lm
from benchmarks.common import (
    CASES,
    OPTIONS,
    arguments,
    bare_passes,
    build,
    cpu_peaks,
    environment,
    floor_passes,
    load_old,
    measures_peaks,
    peak,
    stored_bytes,
    timed,
    use_seed_settings,
)

#: A row's peak-memory figures (on the CPU measured in a process of their own).
_PEAKS = ("bare_peak_bytes", "compare_peak_bytes", "extra_over_stored", "over_floor_peak")

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
    first = {way: timed(fn, device) for way, fn in ways.items()}  # warm-up: kernels,
    # algorithm choice, allocator (the first call of each, timed)
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
    if measures_peaks(device):
        bare_peak, _ = peak(ways["bare"], device)
        floor_peak, _ = peak(ways["floor"], device)
        new_peak, result = peak(ways["new"], device)
    else:  # measured in a process of their own (benchmarks.common.cpu_peaks): NaN
        # until merged, never a figure
        bare_peak = floor_peak = new_peak = math.nan
        result = ways["new"]()
    stored = stored_bytes(result)
    row = {"case": name, "options": option, "device": str(device), "repeats": repeats,
           "bare_s": median["bare"], "compare_s": median["new"],
           "time_ratio": median["new"] / median["bare"],
           "first_s": first["new"],
           "floor_s": median["floor"], "floor_ratio": median["floor"] / median["bare"],
           "over_floor": median["new"] / median["floor"],
           "bare_peak_bytes": bare_peak, "compare_peak_bytes": new_peak,
           "stored_bytes": stored,
           "extra_over_stored": (new_peak - bare_peak) / stored if stored else float("nan"),
           "over_floor_peak": (new_peak - floor_peak) / stored if stored else float("nan")}
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
    parser.add_argument("--peaks", type=Path, help=argparse.SUPPRESS)  # cpu_peaks' child
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    use_seed_settings(device)
    if args.peaks:  # the child of cpu_peaks: the peaks only
        args.peaks.write_text(json.dumps({
            f"{r['case']} {r['options']}": {key: r[key] for key in _PEAKS}
            for r in (measure(name, device, 1, option)
                      for name in args.cases for option in args.options)}))
        return 0
    peaks = cpu_peaks("overhead", argv) if device.type == "cpu" else {}
    old = load_old(args.old) if args.old else None
    rows = [measure(name, device, args.repeats, option, old)
            for name in args.cases for option in args.options]
    for r in rows:
        r.update(peaks.get(f"{r['case']} {r['options']}", {}))
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


#: Image cases per device (``benchmarks.common.CASES``).
IMAGES = {
    "cpu": ("mobilenet_v3_small_b16_chunk2", "efficientnet_b0_b16_chunk2",
            "resnet18_b16_chunk2", "mobilenet_v3_small_b16_per_sample",
            "vgg11_features_b128_chunk2"),
    "cuda": ("mobilenet_v3_small_b16_chunk2", "efficientnet_b0_b16_chunk2",
             "resnet18_b16_chunk2", "vgg11_features_b128_chunk2", "alexnet_b100_per_sample",
             "resnet50_b64_per_sample"),
}
#: ``compare_backward``'s dtypes per device.
BACKWARD = {"cpu": ("float32",), "cuda": ("bfloat16", "float32")}


def _image(name: str, device: torch.device, repeats: int, old: Any) -> dict[str, Any]:
    r = measure(name, device, repeats, "default", old)
    return {"case": name, "bare_s": r["bare_s"], "floor_s": r["floor_s"],
            "divtrace_s": r["compare_s"], "old_s": r.get("old_s"), "first_s": r["first_s"],
            "extra_over_stored": r["over_floor_peak"]}


def _prompts(device: torch.device, repeats: int, old: Any) -> dict[str, Any]:
    r = lm.prompts(device, repeats, old)
    seconds = r["seconds"]
    return {"case": f"llama_prompts_{r['case']['dtype']}",
            "bare_s": seconds["bare passes"],
            "floor_s": r["floor_s"],
            "divtrace_s": seconds["compare, every prompt"],
            "old_s": seconds.get("old: compare, every prompt"),
            "first_s": r["cold"]["compare, every prompt"],
            "extra_over_stored": r.get("extra_over_stored")}


def _backward(device: torch.device, dtype: str, repeats: int, old: Any) -> dict[str, Any]:
    r = backward.measure(device, getattr(torch, dtype), repeats, old=old)
    seconds = r["seconds"]
    return {"case": f"llama_backward_{dtype}", "bare_s": seconds["bare passes"],
            "floor_s": seconds["bare and the tests' passes"],
            "divtrace_s": seconds["compare_backward"],
            "old_s": seconds.get("old: compare_backward"),
            "first_s": r["cold"]["compare_backward"], "extra_over_stored": None}


def rows(device: torch.device, repeats: int, old: Any, only: list[str] | None,
         peaks: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Every case of ``device``, measured one after the other (``only``: those named;
    ``peaks``: the image cases' "extra / stored", measured in a process of their own)."""
    work = [(name, lambda n=name: _image(n, device, repeats, old))
            for name in IMAGES[device.type]]
    dtype = lm.PROMPTS[device.type]["dtype"]
    work.append((f"llama_prompts_{dtype}", lambda: _prompts(device, repeats, old)))
    work += [(f"llama_backward_{d}", lambda d=d: _backward(device, d, repeats, old))
             for d in BACKWARD[device.type]]
    found = []
    for name, run in work:
        if only and name not in only:
            continue
        row = run()
        if peaks is not None and row["case"] in peaks:
            row["extra_over_stored"] = peaks[row["case"]]
        print(_line(row), flush=True)
        found.append(row)
    return found


def _ratio(seconds: float | None, base: float) -> str:
    return "-" if seconds is None else f"{seconds / base:.2f}×"


def _line(r: dict[str, Any]) -> str:
    memory = r["extra_over_stored"]
    return (f"| {r['case']} | {r['bare_s']:.4f} | {_ratio(r['floor_s'], r['bare_s'])} "
            f"| {_ratio(r['divtrace_s'], r['bare_s'])} | {_ratio(r['divtrace_s'], r['floor_s'])} "
            f"| {_ratio(r['old_s'], r['floor_s'])} | {r['first_s'] / r['divtrace_s']:.2f} "
            f"| {'-' if memory is None else f'{memory:.2f}'} |")


def _kernels(cache: Path | None) -> int:
    """How many kernels Triton keeps compiled in ``cache`` (one group file each)."""
    return 0 if cache is None else sum(1 for _ in cache.glob("*/__grp__*.json"))


def floor_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--old", type=Path, help="an older checkout, timed beside this one")
    parser.add_argument("--only", nargs="*", help="only these cases")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--triton-cache", type=Path,
                        help="Triton's kernel cache for this run (empty: a fresh machine's)")
    parser.add_argument("--peaks", type=Path, help=argparse.SUPPRESS)  # cpu_peaks' child
    args = parser.parse_args(argv)
    if args.triton_cache:  # read by Triton when it first compiles or loads a kernel
        args.triton_cache.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(args.triton_cache.resolve())
    device = torch.device(args.device)
    use_seed_settings(device)
    if args.peaks:  # the child of cpu_peaks: the image cases' peaks only
        names = [n for n in IMAGES[device.type] if not args.only or n in args.only]
        args.peaks.write_text(json.dumps({n: _image(n, device, 1, None)["extra_over_stored"]
                                          for n in names}))
        return 0
    peaks = cpu_peaks("floor", argv) if device.type == "cpu" else None
    old = load_old(args.old) if args.old else None
    env = environment(device)
    print(f"environment: {env}")
    print("| case | bare (s) | floor / bare | divtrace / bare | divtrace / floor "
          "| before / floor | first / warm | extra / stored |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    kernels = _kernels(args.triton_cache)
    found = rows(device, args.repeats, old, args.only, peaks)
    if args.triton_cache:
        print(f"Triton's cache: {_kernels(args.triton_cache)} kernels, {kernels} of them "
              f"there before this run")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": found}, indent=1))
    return 0
