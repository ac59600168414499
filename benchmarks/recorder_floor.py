"""The floor under a recorder, with and without module hooks.

The passes ``compare()`` makes in ``benchmarks/many_sites.py``'s setting (mobilenet_v3_small,
efficientnet_b0, resnet18, random weights, batch 16 of 3×64×64, samples [0, 1] one at a
time, then the batched pass), timed in one process, interleaved, medians, as ratios to
the bare passes:

- "hooks": a forward hook on every module that does nothing with its output (what module
  hooks cost before a recorder does anything);
- "hooks + copies": the same hook copying rows 0 and 1 of the output;
- "traced": the model traced with ``torch.fx`` and run as the generated code, with a call
  after every leaf module's call that does nothing with its output (as the hooks do); no
  module hook runs. The traced code calls the leaf modules but not the containers, so it
  observes fewer sites (the number is printed);
- "traced + copies": the same call copying rows 0 and 1.

No divtrace code runs here: these are what a recorder built either way would pay before
any of its own work. The traced output is checked to be bit-identical to the model's.

    python benchmarks/recorder_floor.py [--device cuda] [--repeats 15] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from floors import copy_rows, hooked, observe, passes, traced
from many_sites import MODELS
from overhead import timed, use_seed_settings


def main() -> int:
    import torchvision.models

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    use_seed_settings(device)
    rows: list[dict[str, Any]] = []
    for name in MODELS:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)().eval().to(device)
        x = torch.rand(16, 3, 64, 64, device=device)
        seen, leaf_calls = traced(model, observe)
        copying, _ = traced(model, copy_rows)
        with torch.no_grad():
            if not torch.equal(seen(x), model(x)):
                raise SystemExit(f"{name}: the traced model's output differs")

        ways = {"bare": passes(model, x),  # (the hooks are many_sites.py's --floor's)
                "hooks": hooked(model, passes(model, x), copy=False),
                "hooks + copies": hooked(model, passes(model, x), copy=True),
                "traced": passes(seen, x), "traced + copies": passes(copying, x)}
        for fn in ways.values():
            fn()
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.repeats):
            for way, fn in ways.items():
                times[way].append(timed(fn, device))
        median = {way: statistics.median(t) for way, t in times.items()}
        row = {"model": name, "modules": len(list(model.modules())),
               "leaf_calls": leaf_calls, "bare_s": median["bare"],
               **{f"ratio_{way}": median[way] / median["bare"] for way in ways if way != "bare"}}
        rows.append(row)
        print(f"{name}: bare {median['bare'] * 1e3:.1f} ms; hooks on {row['modules']} "
              f"modules {row['ratio_hooks']:.2f}×, + copies {row['ratio_hooks + copies']:.2f}×; "
              f"traced, {leaf_calls} leaf calls seen {row['ratio_traced']:.2f}×, + copies "
              f"{row['ratio_traced + copies']:.2f}×")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "device": str(device),
                                         "threads": args.threads, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
