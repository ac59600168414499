"""Every table of this version equals an older checkout's, figure for figure (the
per-site table and the per-sample table, compared with ``DataFrame.equals``): models with
many small sites and a few large ones, per sample, partial samples, chunk 2, explain
options, half precision.

    python benchmarks/same_tables.py --old <older checkout> [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from versions import load_old

import divtrace

OPTIONS: tuple[dict[str, Any], ...] = (
    {"samples": [0, 1]}, {"samples": None}, {"chunk": 2, "samples": [0, 1, 5]},
    {"samples": [0, 1], "local": True}, {"samples": [3], "truth": "fp64"},
    {"samples": [0, 1], "keep": True})


def main() -> int:
    import torchvision.models

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    old = load_old(args.old)
    device = torch.device(args.device)
    checked = 0
    for name in ("mobilenet_v3_small", "efficientnet_b0", "resnet18", "alexnet"):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)().eval().to(device)
        x = torch.rand(20, 3, 64 if name != "alexnet" else 96, 64 if name != "alexnet"
                       else 96, device=device)
        cases = [(x, options) for options in OPTIONS]
        if device.type == "cuda":  # last: the model becomes half precision
            cases.append((x.half(), {"samples": [0, 1]}))
        for inputs, options in cases:
            net = model.half() if inputs.dtype == torch.half else model
            new_result = divtrace.compare(net, inputs, progress=False, **options)
            old_result = old.compare(net, inputs, progress=False, **options)
            same = (new_result.table.equals(old_result.table)
                    and new_result.samples.equals(old_result.samples))
            print(f"{name} {options}{' fp16' if inputs.dtype == torch.half else ''}: "
                  f"{'equal' if same else 'DIFFERENT'}", flush=True)
            if not same:
                return 1
            checked += 1
    print(f"equal tables in {checked} comparisons")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
