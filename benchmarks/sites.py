"""Models with hundreds of small sites: ``compare()`` against the bare forward passes.

mobilenet_v3_small, efficientnet_b0 and resnet18 (random weights), batch 16 of 3×64×64,
samples [0, 1], run a per sample (two split passes, then the batched pass; with
``--chunk 2`` one split pass of both), in one process, interleaved, medians. "µs per
site" is ``compare()``'s time beyond the bare passes over its sites. ``--old`` times an
older checkout beside this one. ``--hooks`` also times the same passes with a forward
hook on every module that does nothing ("hooks"), or copies the compared rows ("hooks +
copies"): no recorder made of module hooks can cost less. ``--selections`` also times
``compare()`` observing only Conv2d and Linear modules, and only the output
(``modules=[]``: the call without sites); with ``--hooks``, "least with every module
hooked" is the output-only ratio plus the hooks' share. On CUDA it also prints the
extra peak memory over the bare passes' peak, per byte of the stored rows.

    python -m benchmarks sites [--device cuda] [--chunk 2] [--repeats 7] [--old CHECKOUT]
        [--hooks] [--selections] [--size 64] [--json out.json]

``parts`` (:func:`parts_main`): where the time of one ``compare()`` goes, timed inside
its calls: the plan, the guard's snapshot of the buffers, run a's recording, run b's
measuring, the verdict's two tests (the independence test; the precision test, its
float64 copy of the model apart), the statistics computed together at the fetch, the
table's figures and its DataFrame; beside the bare passes (run a's split passes, the
batched pass), the floor's further passes without divtrace (the independence test's
batched passes with other values; a float64 copy of the model and its split and batched
passes) and the whole call; the statistics' queues, flushed (inside run b's part and
the tests'). Medians of interleaved repeats, in one process (a part called more than
once in a call: its calls summed). ``--output-only``: the call observes only the
model's output (``modules=[]``), so what it costs beyond the bare passes is its own.
``--case NAME``: an image case of ``python -m benchmarks floor`` instead (its model,
batch, chunk and samples; the floor holds a batched pass per group of the independence
test, as many as the call made). ``--model llama``: the small Llama's prompts of
``python -m benchmarks lm`` (every prompt compared, run a prompt by prompt; ``--chunk``
does not apply), its floor a batched pass per group of the independence test and the
float64 copy's passes.

    python -m benchmarks parts [--model mobilenet_v3_small|llama] [--chunk 1] [--case NAME]
        [--device cpu] [--repeats 9] [--output-only]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import divtrace
from benchmarks.common import (
    CASES,
    arguments,
    bare_passes,
    build,
    calls_timed,
    environment,
    load_old,
    peak,
    stored_bytes,
    timed,
    use_seed_settings,
)
from divtrace import pipeline
from divtrace.explain.independence import Independence
from divtrace.explain.precision import Precision
from divtrace.measure.host import Host
from divtrace.measure.queue import FusedQueue, StatsQueue, WideQueue
from divtrace.plan.samples import chunks_for
from divtrace.record import guard
from divtrace.record.runner import Runner
from divtrace.report import table

MODELS = ("mobilenet_v3_small", "efficientnet_b0", "resnet18")
#: The modules ``--selections`` observes.
SELECTED = (torch.nn.Conv2d, torch.nn.Linear)
_KEPT: list[torch.Tensor] = []  # the rows the copying hooks keep, until the passes end


def hooked(model: torch.nn.Module, bare: Callable[[], None], copy: bool
           ) -> Callable[[], None]:
    """``bare`` with a forward hook on every module that does nothing with the output, or
    keeps a copy of its compared rows."""

    def keep(_module: torch.nn.Module, _args: object, output: object) -> None:
        if copy and isinstance(output, torch.Tensor) and output.dim():
            _KEPT.append(output[:2].clone())

    def run() -> None:
        handles = [module.register_forward_hook(keep) for module in model.modules()]
        try:
            bare()
        finally:
            for handle in handles:
                handle.remove()
            _KEPT.clear()

    return run


def ways_for(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace, old: Any
             ) -> dict[str, Callable[[], object]]:
    case = {"samples": [0, 1], "chunk": args.chunk, "batch": len(x)}

    def bare() -> None:
        bare_passes(model, x, case)

    def run(package: Any, **more: Any) -> Callable[[], object]:
        kwargs = arguments(package, args.chunk, [0, 1]) | more
        return lambda: package.compare(model, x, **kwargs)

    ways: dict[str, Callable[[], object]] = {"bare": bare, "new": run(divtrace)}
    if old is not None:
        ways["old"] = run(old)
    if args.hooks:
        ways["hooks"] = hooked(model, bare, copy=False)
        ways["hooks + copies"] = hooked(model, bare, copy=True)
    if args.selections:
        ways["conv + linear"] = run(divtrace, modules=list(SELECTED))
        ways["output only"] = run(divtrace, modules=[])
    return ways


def measure(name: str, device: torch.device, args: argparse.Namespace, old: Any
            ) -> dict[str, Any]:
    import torchvision.models

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval().to(device)
    x = torch.rand(16, 3, args.size, args.size, device=device)
    ways = ways_for(model, x, args, old)
    for fn in ways.values():
        fn()
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way, fn in ways.items():
            times[way].append(timed(fn, device))
    median = {way: statistics.median(t) for way, t in times.items()}
    sites = len(divtrace.compare(model, x, samples=[0, 1], progress=False).table)
    ratios = {way: value / median["bare"] for way, value in median.items() if way != "bare"}
    if args.hooks and args.selections:  # a call that observes every module costs both
        ratios["least with every module hooked"] = ratios["output only"] + ratios["hooks"] - 1
    row: dict[str, Any] = {"model": name, "sites": sites, "bare_s": median["bare"],
                           "ratio": ratios.pop("new"), "ratios": ratios,
                           "per_site_us": (median["new"] - median["bare"]) / sites * 1e6}
    if device.type == "cuda":  # the extra peak over the bare passes, per stored byte
        bare_peak, _ = peak(ways["bare"], device)
        for way in ("new", "old") if old is not None else ("new",):
            used, result = peak(ways[way], device)
            row[f"extra_over_stored_{way}"] = (used - bare_peak) / stored_bytes(result)
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks sites", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1, choices=[1, 2])
    parser.add_argument("--old", type=Path, help="an older checkout to time beside")
    parser.add_argument("--hooks", action="store_true",
                        help="also time bare passes with hooks that do nothing or copy rows")
    parser.add_argument("--selections", action="store_true",
                        help="also time compare() observing fewer modules")
    parser.add_argument("--size", type=int, default=64, help="the input's height and width")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    use_seed_settings(device)
    old = load_old(args.old) if args.old else None
    rows = [measure(name, device, args, old) for name in MODELS]
    for row in rows:
        others = ", ".join(f"{way} {value:.2f}×" for way, value in row["ratios"].items())
        memory = (f"; extra peak / stored {row['extra_over_stored_new']:.2f}"
                  if "extra_over_stored_new" in row else "")
        print(f"{row['model']}: {row['sites']} sites, bare {row['bare_s'] * 1e3:.1f} ms, "
              f"compare {row['ratio']:.2f}× ({row['per_site_us']:.0f} µs per site)"
              f"{'; ' + others if others else ''}{memory}")
    if args.json:
        args.json.write_text(json.dumps({"environment": environment(device),
                                         "chunk": args.chunk, "results": rows}, indent=1))
    return 0


def parts_main(argv: list[str]) -> int:
    """``python -m benchmarks parts``: where the time of one ``compare()`` goes."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks parts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v3_small",
                        help="a torchvision model, or llama: the small Llama's prompts")
    parser.add_argument("--chunk", type=int, default=1)
    parser.add_argument("--case", choices=list(CASES),
                        help="an image case of the floor benchmark instead (its model, "
                             "batch, chunk and samples)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output-only", action="store_true",
                        help="observe only the model's output (modules=[])")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    use_seed_settings(device)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    selection: dict[str, Any] = {"modules": []} if args.output_only else {}
    if args.case is not None:
        case = CASES[args.case]
    else:
        case = {"model": args.model, "batch": 16, "size": 64, "chunk": args.chunk,
                "samples": [0, 1]}
    title, ways = (_prompt_ways(device, selection) if args.model == "llama"
                   else _image_ways(case, device, selection))
    entry = importlib.import_module("divtrace.compare")
    parts = ((entry, "make_plan", "plan"),
             (pipeline, "record", "run a, recording"),
             (pipeline, "_measure", "run b, measuring"),
             (Independence, "_after", "the independence test"),
             (Precision, "_after", "the precision test"),
             (Runner, "of", "runs made (the float64 copy)"),
             (StatsQueue, "flush", "the statistics' queues, flushed"),
             (FusedQueue, "flush", "the statistics' queues, flushed"),
             (Host, "fetch", "statistics together, at the fetch"),
             (WideQueue, "_measure", "float64 sites' fields on CUDA, at scale"),
             (table, "_measured_rows", "the table's figures"),
             (guard, "_snapshot", "the guard's snapshot of the buffers"),
             (table.pd.DataFrame, "__init__", "the table's DataFrame"))
    times: defaultdict[str, list[float]] = defaultdict(list)
    inside: defaultdict[str, float] = defaultdict(float)  # this call's parts, summed

    def note(label: str, seconds: float) -> None:
        inside[label] += seconds

    with calls_timed(parts, note, device):
        for fn in ways.values():
            fn()
        for _ in range(args.repeats):
            for label, fn in ways.items():
                inside.clear()
                times[label].append(timed(fn, device))
                for part, seconds in inside.items():
                    times[part].append(seconds)
    print(f"{title}, {args.device}{', output only' if args.output_only else ''}:")
    for label, values in times.items():
        print(f"  {label:40} {statistics.median(values) * 1e3:8.2f} ms")
    return 0


def _image_ways(case: dict[str, Any], device: torch.device, selection: dict[str, Any]
                ) -> tuple[str, dict[str, Callable[[], object]]]:
    """The image case's bare passes, the floor's further passes (a batched pass per group
    of the independence test, the float64 copy and its passes) and the call."""
    model, x = build(case, device)
    samples, chunk = case["samples"], case["chunk"]
    compared = samples or list(range(len(x)))
    chunks = chunks_for(compared, chunk, len(x))

    def call() -> object:
        return divtrace.compare(model, x, samples=samples, a=divtrace.Run(chunk=chunk),
                                progress=False, **selection)

    notes = call().meta.notes  # type: ignore[attr-defined]
    groups = int(notes.get("independence", {}).get("groups", 0))
    other = torch.rand_like(x)

    def split() -> None:
        with torch.no_grad():
            for start, stop in chunks:
                model(x[start:stop])

    def batched() -> None:
        with torch.no_grad():
            model(x)

    def independence() -> None:
        with torch.no_grad():
            for _ in range(groups):  # one batched pass per group of held samples
                model(other)

    def float64() -> None:
        bare_passes(copy.deepcopy(model).double(), x.double(), case)

    shape = "x".join(str(n) for n in x.shape[1:])
    said = "every sample" if samples is None else f"samples {samples}"
    return (f"{case['model']}, batch {len(x)} of {shape}, {said}, chunk {chunk}", {
        "bare split passes": split, "bare batched pass": batched,
        f"floor: {groups} batched passes, other values": independence,
        "floor: float64 copy and its passes": float64, "compare()": call})


def _prompt_ways(device: torch.device, selection: dict[str, Any]
                 ) -> tuple[str, dict[str, Callable[[], object]]]:
    """The small Llama's prompts (``benchmarks.lm``'s case for ``device``, every prompt
    compared): the bare passes, the floor's further passes (a batched pass per group of
    the independence test, the float64 copy and its passes) and the call."""
    from benchmarks.lm import PROMPTS, _llama, given_prompts, prompt_passes

    case = PROMPTS[device.type]
    model = _llama(case, device)
    given = given_prompts(case, device)

    def call() -> object:
        return divtrace.compare(model, given, progress=False, **selection)

    tested = int(call().meta.notes.get("independence", {}).get("passes", 0))  # type: ignore[attr-defined]

    def independence() -> None:
        for _ in range(tested):
            prompt_passes(model, given, split=False)

    return (f"a small Llama ({case['layers']} layers of {case['hidden']}), "
            f"{len(given.prompts)} prompts of {case['shortest']}-{case['longest']} tokens, "
            f"every prompt", {
                "bare split passes": lambda: prompt_passes(model, given, batched=False),
                "bare batched pass": lambda: prompt_passes(model, given, split=False),
                f"floor: {tested} batched passes": independence,
                "floor: float64 copy and its passes": lambda: prompt_passes(
                    copy.deepcopy(model).double(), given),
                "compare()": call})


#: The counting child of ``ops``: one warm call of a case under a dispatch mode that
#: counts every op by the innermost frame of divtrace's own files that made it (else
#: "the model"); prints them as JSON. ``--cuda-path``: the CUDA queues' path on the CPU,
#: their Triton kernels in Triton's interpreter (as ``tests/test_kernels.py`` runs them).
_COUNT = r"""
import collections, json, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
import divtrace
from benchmarks.common import CASES, arguments, build
if sys.argv[2] == "cuda-path":
    from divtrace.measure import fused, queue
    fused.supports = lambda b: b.dtype in (torch.float32, torch.float64)
    queue.StatsQueue.takes = lambda *args: False
    from divtrace.measure import printkernels
    if hasattr(printkernels, "takes"):  # (a version before it: the CPU's fingerprints)
        printkernels.takes = lambda device: True
case = CASES[sys.argv[1]]
model, x = build(case, torch.device("cpu"))
kwargs = arguments(divtrace, case["chunk"], case["samples"])
divtrace.compare(model, x, **kwargs)
made = collections.Counter()
class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame, where = sys._getframe(1), "the model"
        while frame is not None and "/torch/nn/modules/" not in frame.f_code.co_filename:
            name = frame.f_code.co_filename.replace("\\", "/")
            if "/divtrace" in name and "/site-packages/" not in name and (
                    frame.f_code.co_name != "__torch_function__"):  # (the replay's mode)
                where = name.rsplit("/divtrace", 1)[1].split("/", 1)[1] + ": " + (
                    frame.f_code.co_name)
                break
            frame = frame.f_back
        made[where] += 1
        return func(*args, **(kwargs or {}))
with Count():
    divtrace.compare(model, x, **kwargs)
print(json.dumps(made))
"""


def ops_main(argv: list[str]) -> int:
    """``python -m benchmarks ops``: the ops one warm ``compare()`` makes, by the function
    of divtrace's that made them (each op a dispatch, so a host cost on a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks ops", description=(
        "The ops (dispatches) of one warm compare() on the CPU, by divtrace's function "
        "that made them, against the model's own; --old: an older checkout's beside."))
    parser.add_argument("--case", choices=list(CASES), default="mobilenet_v3_small_b16_chunk2")
    parser.add_argument("--cuda-path", action="store_true",
                        help="the CUDA queues' path, their kernels in Triton's interpreter")
    parser.add_argument("--old", type=Path, help="an older checkout, counted beside")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    counts = {}
    for label, checkout in (("this", root), ("old", args.old)):
        if checkout is None:
            continue
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(checkout), str(root)]),
                            **({"TRITON_INTERPRET": "1"} if args.cuda_path else {})}
        done = subprocess.run([sys.executable, "-c", _COUNT, args.case,
                               "cuda-path" if args.cuda_path else "cpu"], env=env,
                              cwd=checkout, capture_output=True, text=True, check=True)
        counts[label] = json.loads(done.stdout.splitlines()[-1])
    this = counts["this"]
    names = sorted(this, key=lambda name: -this[name])[:args.top]
    print(f"{args.case}, {'the CUDA path (interpreted)' if args.cuda_path else 'cpu'}: ops "
          f"of one warm call{', this version / the old one' if args.old else ''}")
    for name in ["(total)", "(divtrace's)", *names]:
        row = [_ops_of(found, name) for found in counts.values()]
        print(f"  {' / '.join(f'{n:6d}' for n in row)}  {name}")
    return 0


def _ops_of(found: dict[str, int], name: str) -> int:
    if name == "(total)":
        return sum(found.values())
    if name == "(divtrace's)":
        return sum(n for key, n in found.items() if key != "the model")
    return found.get(name, 0)
