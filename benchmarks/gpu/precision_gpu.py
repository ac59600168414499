"""The verdict's precision test on a GPU: values read from the batch's shape must be
named, and no rounding case may turn into a false bug.

- by design (must be *not rounding*, the shape named): a Linear/Tanh MLP with
  ``x + eps * x.shape[0]`` (eps 1e-6 and 1e-3), a scale by ``1 / x.shape[0]``, a code
  path for batches of more than one row; a GPT-2 given left-padded prompts without
  ``position_ids``;
- rounding (must stay *rounding* or *identical*), under the seed settings (fp32, TF32
  off, cuDNN deterministic): vgg11().features, batch 128 vs chunks of 2 (samples 0, 1);
  AlexNet, batch 100 per sample; efficientnet_v2_s, batch 64 vs its first 2; vgg11 with
  TF32 on and in bfloat16; an 8B-shaped Llama (hidden 4096, 32 layers) in bfloat16 with
  ``Prompts`` of different lengths;
- the cost: wall time of the default comparison against the same with
  ``explain=["-precision"]`` (medians of 3 after one warm-up), for vgg11 and AlexNet.

Writes ``precision_summary.txt`` and ``precision.json`` into --out.

    python benchmarks/gpu/precision_gpu.py --out docs/results/h200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from benchmarks.common import llama_8b
from tests.models import PerBatch, ShapeBias, ShapePath  # the tests' own

SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)


def record(found: list[dict[str, Any]], lines: list[str], name: str, expected: str,
           result: divtrace.Comparison, seconds: float) -> None:
    note = result.meta.notes.get("precision") or {}
    table = result.table
    kept = table[table["depends_on_shape"].astype("boolean").fillna(False).astype(bool)] if (
        "depends_on_shape" in table) else table.iloc[:0]
    out = result.output
    found.append({"case": name, "expected": expected, "verdict": result.verdict,
                  "as_expected": (result.verdict == "not rounding") == (expected == "bug"),
                  "first_by_shape": None if kept.empty else kept.iloc[0]["site"],
                  "output_rel_l2": None if out is None else float(out["rel_l2"]),
                  "output_fp64_rel_l2": None if out is None else float(
                      out.get("fp64_rel_l2", float("nan"))),
                  "precision": note, "seconds": round(seconds, 3)})
    lines += [f"== {name} (expected: {expected}; {seconds:.2f} s)", result.summary(), ""]
    print(name, result.verdict, found[-1]["first_by_shape"], f"{seconds:.2f}s", flush=True)


def timed(work: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    value = work()
    torch.cuda.synchronize()
    return value, time.perf_counter() - start


def cost(name: str, work: Any, lines: list[str], costs: dict[str, Any]) -> None:
    """Default against ``-precision``, interleaved, medians of 3 after a warm-up."""
    work(None)
    work(["-precision"])
    with_, without = [], []
    for _ in range(3):
        with_.append(timed(lambda: work(None))[1])
        without.append(timed(lambda: work(["-precision"]))[1])
    a, b = statistics.median(with_), statistics.median(without)
    costs[name] = {"default_s": a, "without_precision_s": b, "ratio": a / b}
    lines.append(f"cost {name}: default {a:.3f} s, explain=['-precision'] {b:.3f} s, "
                 f"ratio {a / b:.2f}")
    print(lines[-1], flush=True)


def main() -> int:
    import transformers
    from torchvision.models import alexnet, efficientnet_v2_s, vgg11

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-8b", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    found: list[dict[str, Any]] = []
    costs: dict[str, Any] = {}
    lines = [f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
             f"{torch.cuda.get_device_name(0)}", ""]
    cuda = torch.device("cuda")

    def case(name: str, expected: str, model: nn.Module, x: Any, **kwargs: Any) -> None:
        result, seconds = timed(lambda: divtrace.compare(model, x, progress=False, **kwargs))
        record(found, lines, name, expected, result, seconds)

    with SEED.flags():
        for label, middle in (("x + 1e-6 * x.shape[0]", ShapeBias(1e-6)),
                              ("x + 1e-3 * x.shape[0]", ShapeBias(1e-3)),
                              ("x * (1 / x.shape[0])", PerBatch()),
                              ("x * (1 + 1e-7) if x.shape[0] > 1", ShapePath())):
            torch.manual_seed(0)
            mlp = nn.Sequential(nn.Linear(32, 32), middle, nn.Tanh(),
                                nn.Linear(32, 8)).eval().to(cuda)
            x = torch.randn(8, 32, device=cuda)
            case(f"MLP with {label}, samples 0, 1", "bug", mlp, x, samples=[0, 1])
            case(f"MLP with {label}, every sample", "bug", mlp, x)
        torch.manual_seed(0)
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=256, n_layer=4, n_head=8, vocab_size=1000, n_positions=128)).eval().to(cuda)
        generator = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1, 1000, (n,), generator=generator).to(cuda)
                   for n in (5, 19, 3, 11)]
        case("GPT-2, left padding without position_ids", "bug", gpt2,
             divtrace.Prompts(prompts, position_ids=False))
        case("GPT-2, left padding with position_ids", "rounding", gpt2,
             divtrace.Prompts(prompts))

        torch.manual_seed(0)
        features = vgg11().features.eval().to(cuda)
        x128 = torch.rand(128, 3, 128, 128, device=cuda)
        case("seed: vgg11().features, 128 vs chunks of 2, samples 0, 1", "rounding", features,
             x128, a=divtrace.Run(chunk=2), samples=[0, 1])
        tf32 = {"tf32_matmul": True, "tf32_cudnn": True}
        case("vgg11().features, TF32 on", "rounding", features, x128,
             a=divtrace.Run(chunk=2, **tf32), b=divtrace.Run(**tf32), samples=[0, 1])
        case("vgg11().features in bfloat16", "rounding", features.to(torch.bfloat16),
             x128.to(torch.bfloat16), a=divtrace.Run(chunk=2), samples=[0, 1])
        features = features.float()
        cost("vgg11().features, 128 vs chunks of 2", lambda explain: divtrace.compare(
            features, x128, a=divtrace.Run(chunk=2), samples=[0, 1], progress=False,
            explain=explain), lines, costs)
        torch.manual_seed(0)
        net = alexnet().eval().to(cuda)
        x100 = torch.rand(100, 3, 227, 227, device=cuda)
        case("seed: AlexNet, 100 per sample", "rounding", net, x100)
        cost("AlexNet, 100 per sample", lambda explain, net=net, x100=x100: divtrace.compare(
            net, x100, progress=False, explain=explain), lines, costs)
        del net, x100
        torch.manual_seed(0)
        eff = efficientnet_v2_s().eval().to(cuda)
        case("seed: efficientnet_v2_s, 64 vs its first 2", "rounding", eff,
             torch.rand(64, 3, 224, 224, device=cuda), a=divtrace.Run(chunk=2),
             samples=[0, 1])
        del eff
        torch.cuda.empty_cache()
        if not args.skip_8b:
            model = llama_8b(cuda)
            generator = torch.Generator().manual_seed(5)
            prompts = [torch.randint(1, 128256, (n,), generator=generator).to(cuda)
                       for n in (17, 40, 9, 28)]
            case("8B-shaped Llama, bfloat16, Prompts of 17/40/9/28 tokens", "rounding",
                 model, divtrace.Prompts(prompts))
            lines.append(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    wrong = [f["case"] for f in found if not f["as_expected"]]
    lines.append(f"{len(found) - len(wrong)} of {len(found)} cases as expected"
                 + (f"; not: {wrong}" if wrong else ""))
    print(lines[-1])
    (args.out / "precision_summary.txt").write_text("\n".join(lines) + "\n")
    (args.out / "precision.json").write_text(json.dumps(
        {"cases": found, "costs": costs}, indent=1, default=str) + "\n")
    return 0 if not wrong else 1


if __name__ == "__main__":
    raise SystemExit(main())
