"""Time and peak memory of ``compare()`` against the bare forward passes it must run.

The bare passes are the batched pass plus the split passes of the chunks that hold the
compared samples, without hooks. Both are run in one process, interleaved, several
times; the figures are medians. Peak memory: on CUDA, the allocator's peak above the
memory in use before the call; on CPU, the peak resident set size above the resident
size before the call (Linux only). "extra / stored" is compare()'s extra peak over
the bare passes' peak, divided by the bytes of the split run's rows that compare() keeps.

    python benchmarks/overhead.py [--device cuda] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import divtrace
from divtrace.plan.samples import chunks_for

CASES: dict[str, dict[str, Any]] = {
    "vgg11_features_b128_chunk2": {
        "model": "vgg11_features", "batch": 128, "size": 128, "chunk": 2, "samples": [0, 1]},
    "alexnet_b100_per_sample": {
        "model": "alexnet", "batch": 100, "size": 224, "chunk": 1, "samples": None},
}


#: compare() options whose cost the benchmark can measure, each on its own.
OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "independence=False": {"independence": False},
    "local": {"local": True},
    "truth=fp64": {"truth": "fp64"},
    "repeat=1": {"repeat": 1},
    "kernels": {"kernels": True},
}


def build(case: dict[str, Any], device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    from torchvision.models import alexnet, vgg11

    torch.manual_seed(0)
    model = vgg11().features if case["model"] == "vgg11_features" else alexnet()
    x = torch.rand(case["batch"], 3, case["size"], case["size"])
    return model.eval().to(device), x.to(device)


def use_seed_settings(device: torch.device) -> None:
    """The settings of the seed reports on CUDA: cuDNN deterministic, no benchmark, TF32
    off."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def bare_passes(model: nn.Module, x: torch.Tensor, case: dict[str, Any]) -> None:
    samples = case["samples"] or list(range(case["batch"]))
    with torch.no_grad():
        for start, stop in chunks_for(samples, case["chunk"], case["batch"]):
            model(x[start:stop])
        model(x)


def with_divtrace(model: nn.Module, x: torch.Tensor, case: dict[str, Any],
                  options: dict[str, Any] | None = None) -> divtrace.Comparison:
    return divtrace.compare(model, x, a=divtrace.Run(chunk=case["chunk"]), samples=case["samples"],
                            progress=False, **(options or {}))


@contextmanager
def calls_timed(targets: Iterable[tuple[Any, str, str]], record: Callable[[str, float], object],
                device: torch.device | None = None) -> Iterator[None]:
    """While inside, each ``(owner, attribute, label)`` of ``targets`` times its calls and
    hands ``(label, seconds)`` to ``record`` (on CUDA with ``device``: after a
    synchronisation, so the seconds hold the call's GPU work); put back on exit."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def wrap(original: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                record(label, time.perf_counter() - began)
        return timed_call

    for (owner, name, original), (_, _, label) in zip(originals, targets, strict=True):
        setattr(owner, name, wrap(original, label))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def cuda_peak(fn: Callable[[], object], device: torch.device) -> tuple[int, object]:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base, out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def cpu_peak(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak resident memory of ``fn()`` above the resident memory before it (Linux).

    The high-water mark is reset through /proc/self/clear_refs; the benchmark runs with
    MALLOC_MMAP_THRESHOLD_ set, so that freed large blocks leave the resident set.
    """
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    out = fn()
    return (_status_kib("VmHWM") - base) * 1024, out


def measure(name: str, device: torch.device, repeats: int, option: str = "default"
            ) -> dict[str, Any]:
    case, options = CASES[name], OPTIONS[option]
    model, x = build(case, device)
    bare_passes(model, x, case)  # warm-up: kernels, algorithm choice, allocator
    with_divtrace(model, x, case, options)
    bare_times, divtrace_times = [], []
    for _ in range(repeats):
        bare_times.append(timed(lambda: bare_passes(model, x, case), device))
        divtrace_times.append(timed(lambda: with_divtrace(model, x, case, options), device))
    peak_of = cpu_peak if device.type == "cpu" else lambda fn: cuda_peak(fn, device)
    bare_peak, _ = peak_of(lambda: bare_passes(model, x, case))
    peak, result = peak_of(lambda: with_divtrace(model, x, case, options))
    stored = result.meta.stored_bytes  # type: ignore[attr-defined]
    bare_t, div_t = statistics.median(bare_times), statistics.median(divtrace_times)
    return {
        "case": name, "options": option, "device": str(device), "repeats": repeats,
        "bare_s": bare_t, "compare_s": div_t, "time_ratio": div_t / bare_t,
        "bare_peak_bytes": bare_peak, "compare_peak_bytes": peak, "stored_bytes": stored,
        "extra_over_stored": (peak - bare_peak) / stored if stored else float("nan"),
    }


def case_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """The arguments every benchmark of a case takes."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--options", nargs="*", default=["default"], choices=list(OPTIONS),
                        help="compare() options to measure, each on its own")
    parser.add_argument("--json", type=Path, help="also write the figures here")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    case_arguments(parser, repeats=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    use_seed_settings(device)
    if device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc keeps freed memory unless large blocks are mapped: start again with that
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    rows = [measure(name, device, args.repeats, option)
            for name in args.cases for option in args.options]
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(f"environment: {env}")
    print("| case | options | device | bare (s) | compare (s) | time ratio | stored (MiB) "
          "| extra peak (MiB) | extra / stored |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        extra = (r["compare_peak_bytes"] - r["bare_peak_bytes"]) / 2**20
        print(f"| {r['case']} | {r['options']} | {r['device']} | {r['bare_s']:.4f} "
              f"| {r['compare_s']:.4f} "
              f"| {r['time_ratio']:.3f} | {r['stored_bytes'] / 2**20:.1f} | {extra:.1f} "
              f"| {r['extra_over_stored']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
