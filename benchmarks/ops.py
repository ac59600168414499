"""What op-level sites cost: ``compare(..., ops=True)`` against the bare forward passes.

For each case, in one process, interleaved, medians of several repeats:

- ``bare``: the batched pass and the split passes compare() must run, without hooks;
- ``bare + mode``: the same passes under a TorchDispatchMode that only calls each op
  (the floor of seeing every op from Python);
- ``compare``, ``compare ops=True``, ``compare ops='only'``.

Ratios are to ``bare``. On CUDA, also the peak memory above the bare passes' peak, over
the bytes of the split run's stored rows.

    python benchmarks/ops.py [--device cuda] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import bare_passes, cuda_peak, timed, use_seed_settings

import divtrace

#: Per device: the cases (the transformer is per sample over the whole batch, as a
#: per-prompt check of a language model is).
CASES: dict[str, dict[str, dict[str, Any]]] = {
    "cpu": {
        "vgg11_features_b16_chunk2": {"model": "vgg11_features", "batch": 16, "size": 64,
                                      "chunk": 2, "samples": [0, 1]},
        "transformer_b8_per_sample": {"model": "transformer", "batch": 8, "seq": 64,
                                      "chunk": 1, "samples": None},
    },
    "cuda": {
        "vgg11_features_b128_chunk2": {"model": "vgg11_features", "batch": 128, "size": 128,
                                       "chunk": 2, "samples": [0, 1]},
        "transformer_b32_per_sample": {"model": "transformer", "batch": 32, "seq": 128,
                                       "chunk": 1, "samples": None},
    },
}


class Block(nn.Module):
    """A pre-norm transformer block of plain modules (no fused fast path that hooks would
    turn off: the bare passes run the same code as the observed ones)."""

    def __init__(self, width: int = 256, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(self.norm2(x))


class Passthrough(TorchDispatchMode):
    """Sees every op and only calls it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        return func(*args, **(kwargs or {}))


def build(case: dict[str, Any], device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if case["model"] == "vgg11_features":
        from torchvision.models import vgg11

        model: nn.Module = vgg11().features
        x = torch.rand(case["batch"], 3, case["size"], case["size"])
    else:  # a small transformer: four pre-norm blocks of width 256
        model = nn.Sequential(*[Block() for _ in range(4)])
        x = torch.randn(case["batch"], case["seq"], 256)
    return model.eval().to(device), x.to(device)


def measure(name: str, case: dict[str, Any], device: torch.device, repeats: int
            ) -> dict[str, Any]:
    model, x = build(case, device)

    def run(**options: Any) -> Any:
        return divtrace.compare(model, x, a=divtrace.Run(chunk=case["chunk"]),
                                samples=case["samples"],
                                progress=False, **options)

    def moded() -> None:
        with Passthrough():
            bare_passes(model, x, case)

    ways = {"bare": lambda: bare_passes(model, x, case), "bare + mode": moded,
            "compare": run, "compare ops=True": lambda: run(ops=True),
            "compare ops='only'": lambda: run(ops="only")}
    for way in ways.values():  # warm-up: kernels, algorithm choice, allocator
        way()
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, fn in ways.items():
            times[way].append(timed(fn, device))
    median = {way: statistics.median(t) for way, t in times.items()}
    result = run(ops=True)
    table = result.table
    row: dict[str, Any] = {
        "case": name, "device": str(device), "repeats": repeats,
        "seconds": median, "ratio": {way: t / median["bare"] for way, t in median.items()},
        "module_sites": int((table["op"] == "").sum()), "op_sites": int((table["op"] != "").sum()),
        "stored_bytes": result.meta.stored_bytes,
    }
    if device.type == "cuda":
        bare_peak, _ = cuda_peak(lambda: bare_passes(model, x, case), device)
        peak, _ = cuda_peak(lambda: run(ops=True), device)
        row["extra_over_stored"] = (peak - bare_peak) / max(result.meta.stored_bytes, 1)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    use_seed_settings(device)
    rows = [measure(name, case, device, args.repeats)
            for name, case in CASES[device.type].items()]
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(f"environment: {env}")
    ways = list(rows[0]["ratio"])
    print("| case | sites (module + op) | bare (s) | " + " | ".join(ways[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(ways) - 1))
    for r in rows:
        ratios = " | ".join(f"{r['ratio'][w]:.2f}×" for w in ways[1:])
        print(f"| {r['case']} | {r['module_sites']} + {r['op_sites']} | "
              f"{r['seconds']['bare']:.4f} | {ratios} |")
        if "extra_over_stored" in r:
            print(f"  ops=True extra peak / stored rows: {r['extra_over_stored']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
