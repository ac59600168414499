"""Two versions of divtrace in one process: the time of compare() with each, interleaved.

The other version is a checkout (or a copy) of divtrace elsewhere; it is loaded under the
name ``divtrace_old``. Each repeat times the bare forward passes, the other version and
this one, in rotating order, on the same model and input; the figures are medians.

    git worktree add /tmp/divtrace-old <commit>
    python benchmarks/versions.py --old /tmp/divtrace-old [--device cuda] [--repeats 30]
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import (
    CASES,
    OPTIONS,
    bare_passes,
    build,
    case_arguments,
    timed,
    use_seed_settings,
)

import divtrace


def load_old(checkout: Path) -> Any:
    """The divtrace package of ``checkout``, imported as ``divtrace_old``."""
    target = Path(tempfile.mkdtemp()) / "divtrace_old"
    shutil.copytree(checkout / "divtrace", target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(from|import) divtrace\b", r"\1 divtrace_old", text))
    sys.path.insert(0, str(target.parent))
    return importlib.import_module("divtrace_old")


def measure(name: str, old: Any, device: torch.device, repeats: int,
            option: str = "default") -> dict[str, Any]:
    case = CASES[name]
    model, x = build(case, device)

    def run(package: Any) -> Callable[[], object]:
        return lambda: package.compare(model, x, a=divtrace.Run(chunk=case["chunk"]),
                                       samples=case["samples"],
                                       progress=False, **OPTIONS[option])

    contenders = {"bare": lambda: bare_passes(model, x, case), "old": run(old),
                  "new": run(divtrace)}
    for fn in contenders.values():  # warm-up: kernels, algorithm choice, allocator
        fn()
    times: dict[str, list[float]] = {key: [] for key in contenders}
    order = list(contenders)
    for i in range(repeats):
        for key in order[i % 3:] + order[:i % 3]:
            times[key].append(timed(contenders[key], device))
    median = {key: statistics.median(values) for key, values in times.items()}
    return {"case": name, "options": option, "device": str(device), "repeats": repeats,
            "bare_s": median["bare"], "old_s": median["old"], "new_s": median["new"],
            "old_ratio": median["old"] / median["bare"],
            "new_ratio": median["new"] / median["bare"],
            "new_over_old": median["new"] / median["old"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="checkout of the other version")
    case_arguments(parser, repeats=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    use_seed_settings(device)
    old = load_old(args.old)
    rows = [measure(name, old, device, args.repeats, option)
            for name in args.cases for option in args.options]
    print("| case | options | device | bare (s) | old (s) | new (s) | old ratio | new ratio "
          "| new / old |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['options']} | {r['device']} | {r['bare_s']:.4f} "
              f"| {r['old_s']:.4f} "
              f"| {r['new_s']:.4f} | {r['old_ratio']:.3f} | {r['new_ratio']:.3f} "
              f"| {r['new_over_old']:.3f} |")
    if args.json:
        env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
        args.json.write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
