"""The seed question on a GPU: vgg11().features and one Conv2d, batch 128 vs its first 2.

Settings as in the seed report: fp32, TF32 off, cuDNN deterministic, no benchmark mode.
Writes the two tables, the overlaid snowball plot and a summary (with the environment)
into --out.

    python benchmarks/gpu/seed_gpu.py --out docs/results/h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace

#: The seed reports' settings: fp32 without TF32, cuDNN deterministic, no benchmark mode.
SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    with SEED.flags():
        return run(args)


def run(args: argparse.Namespace) -> int:
    from matplotlib.figure import Figure
    from torchvision.models import vgg11

    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    features = vgg11().features.eval().cuda()
    conv = nn.Conv2d(3, 64, kernel_size=3, padding=1).eval().cuda()
    x = torch.rand(args.batch, 3, args.size, args.size, device="cuda")
    with torch.no_grad():
        plain = features(x)  # for the observer check below
    results = {}
    captured: list[torch.Tensor] = []
    handle = features.register_forward_hook(
        lambda m, a, o: captured.append(o.clone()) if o.shape[0] == args.batch else None)
    try:
        results["vgg11().features"] = divtrace.compare(
            features, x, a=divtrace.Run(chunk=2), samples=[0, 1], progress=False)
    finally:
        handle.remove()
    results["Conv2d(3, 64)"] = divtrace.compare(conv, x, a=divtrace.Run(chunk=2), samples=[0, 1],
                                                progress=False)
    observer_ok = torch.equal(captured[0], plain)
    env = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(), "batch": args.batch,
        "input": [3, args.size, args.size], "chunk": 2, "samples": [0, 1],
        "tf32": False, "cudnn_deterministic": True, "cudnn_benchmark": False,
        "observer_check_bit_identical": observer_ok,
    }
    lines = [json.dumps(env, indent=1), ""]
    for name, result in results.items():
        stem = "seed_" + ("vgg11_features" if "vgg" in name else "conv2d")
        result.to_csv(args.out / f"{stem}.csv")
        table = result.table
        ok = table[table["status"] == "ok"]
        first = result.first_divergence
        lines += [f"== {name} ==", result.summary(),
                  f"bit-identical sites: {int((ok['mismatch'] == 0).sum())} of {len(ok)}; "
                  f"first divergent site: {None if first is None else first['site']}; "
                  f"final rel_l2: {result.output['rel_l2']:.3g}; final mismatch: "
                  f"{result.output['mismatch']:.1%}", ""]
    figure = Figure(figsize=(10, 4.5))
    ax = divtrace.overlay(list(results.values()), list(results), ax=figure.subplots())
    ax.set_title(f"{env['gpu']}: batch of {args.batch} vs first 2 (fp32, TF32 off)")
    figure.savefig(args.out / "seed_snowball.png", dpi=120, bbox_inches="tight")
    (args.out / "seed_summary.txt").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
