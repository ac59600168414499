"""Why the runs part, on a GPU: sources, local error, float64 truth, noise and kernels.

For vgg11().features (batch 128 vs its first 2), AlexNet (batch 100 vs per sample) and
efficientnet_v2_s (batch 64 vs its first 2), random weights, fp32, TF32 off, cuDNN
deterministic, no benchmark mode — the seed reports' settings. Writes one table per model,
a summary with the environment, and two figures into --out.

    python benchmarks/gpu/explain_gpu.py --out docs/results/h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace

EXPLAIN = ["local", "fp64", divtrace.Repeat(2), "kernels"]


def cases() -> dict[str, tuple[torch.nn.Module, torch.Tensor, dict]]:
    from torchvision.models import alexnet, efficientnet_v2_s, vgg11

    torch.manual_seed(0)
    return {
        "vgg11_features": (vgg11().features, torch.rand(128, 3, 128, 128),
                           {"a": divtrace.Run(chunk=2), "samples": [0, 1]}),
        "alexnet": (alexnet(), torch.rand(100, 3, 224, 224), {}),
        "efficientnet_v2_s": (efficientnet_v2_s(), torch.rand(64, 3, 224, 224),
                              {"a": divtrace.Run(chunk=2), "samples": [0, 1]}),
    }


#: The seed reports' settings: fp32 without TF32, cuDNN deterministic, no benchmark mode.
SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with SEED.flags():
        return run(args)


def run(args: argparse.Namespace) -> int:
    from matplotlib.figure import Figure

    args.out.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(),
           "explain": [p if isinstance(p, str) else repr(p) for p in EXPLAIN]}
    lines = [json.dumps(env), ""]
    snowballs = Figure(figsize=(13, 15))
    sources = Figure(figsize=(12, 12))
    axes = snowballs.subplots(3, 1, gridspec_kw={"hspace": 0.95})
    source_axes = sources.subplots(3, 1, gridspec_kw={"hspace": 0.35})
    for i, (name, (model, x, how)) in enumerate(cases().items()):
        model = model.eval().cuda()
        start = time.perf_counter()
        result = divtrace.compare(model, x.cuda(), progress=False, **how, explain=EXPLAIN)
        seconds = time.perf_counter() - start
        result.to_csv(args.out / f"explain_{name}.csv")
        said = ", ".join(f"{k}={v.label() if isinstance(v, divtrace.Run) else v}"
                         for k, v in how.items()) or "per sample"
        lines += [f"== {name}: batch {x.shape[0]}, {said} ({seconds:.1f} s) ==",
                  result.summary(), ""]
        table = result.sources
        shown = ["site", "module_type", "mismatch", "rel_l2", "local_rel_l2",
                 "kernels_differ", "kernels_a", "kernels_b"]
        lines += ["sources:", table[shown].to_string(max_colwidth=90), ""]
        result.plot(ax=axes[i])
        axes[i].set_title(f"{name}: rel_l2 by depth ({env['gpu']})")
        result.plot_sources(ax=source_axes[i])
        source_axes[i].set_title(f"{name}: where error enters")
        print("\n".join(lines[-4:]), flush=True)
        del model, result
        torch.cuda.empty_cache()
    snowballs.savefig(args.out / "explain_snowball.png", dpi=100, bbox_inches="tight")
    sources.savefig(args.out / "explain_sources.png", dpi=100, bbox_inches="tight")
    (args.out / "explain_summary.txt").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
