"""The seed questions on a GPU: does it happen with cuDNN off, deterministic, TF32, bf16,
on the CPU — and at which batch size does each layer start to diverge?

1. Batched vs split under each setting (vgg11().features, batch 128 vs its first 2;
   AlexNet, batch 100 vs per sample for its first 8 samples).
2. Each setting's run against the GPU float32 run (the "CPU and GPU differ by 10 %" report).
3. A batch-size sweep of vgg11().features: 2, 4, ..., 128 against per-sample runs.

    python benchmarks/gpu/configs_gpu.py --out docs/results/h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from divtrace import Run

SEED = {"deterministic": True, "benchmark": False, "tf32_matmul": False, "tf32_cudnn": False}
SETTINGS = [
    Run(name="GPU fp32 (seed settings)", **SEED),
    Run(name="cuDNN off", cudnn=False, **SEED),
    Run(name="deterministic off, benchmark on", deterministic=False, benchmark=True,
        tf32_matmul=False, tf32_cudnn=False),
    Run(name="TF32 on", deterministic=True, benchmark=False, tf32_matmul=True, tf32_cudnn=True),
    Run(name="bfloat16", dtype=torch.bfloat16, **SEED),
    Run(name="float64", dtype=torch.float64, **SEED),
    Run(name="CPU", device="cpu"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from matplotlib.figure import Figure
    from torchvision.models import alexnet, vgg11

    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cases = {
        "vgg11_features": (vgg11().features.eval().cuda(), torch.rand(128, 3, 128, 128),
                           {"chunk": 2, "samples": [0, 1]}),
        "alexnet": (alexnet().eval().cuda(), torch.rand(100, 3, 224, 224),
                    {"chunk": 1, "samples": list(range(8))}),
    }
    gpu = torch.cuda.get_device_name()
    lines = [json.dumps({"gpu": gpu, "torch": torch.__version__,
                         "cudnn": torch.backends.cudnn.version()}), ""]
    figure = Figure(figsize=(9, 8))
    axes = figure.subplots(2, 1, gridspec_kw={"hspace": 0.35})
    for i, (name, (model, x, how)) in enumerate(cases.items()):
        x = x.cuda()
        found = divtrace.sweep(model, x, SETTINGS, chunk=how["chunk"],
                               samples=how["samples"], progress=False)
        found.table.to_csv(args.out / f"configs_split_{name}.csv", index=False)
        lines += [f"== {name}: batched vs split under each setting {how} ==",
                  found.table.to_string(), ""]
        found.plot(ax=axes[i])
        axes[i].set_title(f"{name}: batched vs split, per setting ({gpu})")
        pairs = divtrace.sweep(model, x, SETTINGS[1:], a=SETTINGS[0],
                               samples=how["samples"], progress=False)
        pairs.table.to_csv(args.out / f"configs_pairs_{name}.csv", index=False)
        lines += [f"== {name}: each setting against GPU fp32, whole batch ==",
                  pairs.table.to_string(), ""]
        print("\n".join(lines[-6:]), flush=True)
    figure.savefig(args.out / "configs_sweep.png", dpi=100, bbox_inches="tight")

    model, x, _ = cases["vgg11_features"]
    with SETTINGS[0].flags():
        sizes = divtrace.sweep_batch(model, x.cuda(), samples=[0, 1], progress=False)
    sizes.onset.to_csv(args.out / "batch_sweep_vgg11_features.csv", index=False)
    lines += ["== vgg11_features: first batch size at which each site diverges "
              "(per-sample reference, samples 0 and 1) ==", sizes.onset.to_string(), ""]
    figure = Figure(figsize=(8, 7))
    sizes.plot(ax=figure.subplots())
    figure.savefig(args.out / "batch_sweep_vgg11_features.png", dpi=100, bbox_inches="tight")
    (args.out / "configs_summary.txt").write_text("\n".join(lines))
    print("\n".join(lines[-3:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
