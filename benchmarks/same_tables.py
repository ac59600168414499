"""Every table of this version equals an older checkout's, figure for figure (the
per-site table and the per-sample table, compared with ``DataFrame.equals``): models with
many small sites and a few large ones, per sample, partial samples, chunk 2, explain
options, half precision. ``--except`` leaves columns out of the comparison (a change
meant to change them) and says in how many rows each of them differs.

    python benchmarks/same_tables.py --old <older checkout> [--device cuda]
        [--except cosine]
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
    parser.add_argument("--except", dest="left_out", nargs="*", default=[],
                        help="columns left out of the comparison")
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
            new_table, old_table = new_result.table, old_result.table
            same = (new_table.drop(columns=args.left_out).equals(
                old_table.drop(columns=args.left_out))
                and new_result.samples.equals(old_result.samples))
            differ = "".join(
                f"; {column} differs in {_differing(new_table[column], old_table[column])}"
                f" of {len(new_table)} rows" for column in args.left_out)
            print(f"{name} {options}{' fp16' if inputs.dtype == torch.half else ''}: "
                  f"{'equal' if same else 'DIFFERENT'}{differ}", flush=True)
            if not same:
                return 1
            checked += 1
    left_out = f" ({', '.join(args.left_out)} left out)" if args.left_out else ""
    print(f"equal tables in {checked} comparisons{left_out}")
    return 0


def _differing(new: Any, old: Any) -> int:
    """Rows where two columns differ (missing in both counts as the same)."""
    return int((~((new == old) | (new.isna() & old.isna()))).sum())


if __name__ == "__main__":
    raise SystemExit(main())
