"""One backward over the batch against gradient accumulation on a GPU: the accumulation
bug reproduced and named, the fix confirmed, where the gradients part, and the cost.

A Llama-shaped model (random weights built from a config on the GPU: hidden 2048, 16
layers, GQA 16/8 heads, MLP 5632, vocab 32000, SDPA attention), in float32 (TF32 off)
and in bfloat16; 16 prompts of 64 to 512 tokens, right padded, the model's own loss (the
mean over the batch's tokens); 4 micro-batches of 4. Each dtype is compared twice: with
each chunk weighted by its rows (the bug: a token mean accumulated with row weights) and
by its tokens (Hugging Face's ``num_items_in_batch``, the fix). Then the cost of the fixed
comparison against its bare passes (``python -m benchmarks backward`` on this device).
Writes one text file with the summaries, the weights tests, the first parts and the
costs; ``--plots`` writes the pictures there too.

    python benchmarks/gpu/backward_gpu.py --out docs/results/h200 [--small] [--plots DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from benchmarks.backward import CASES, batch_of, by_tokens, measure, model_loss
from benchmarks.common import environment, llama
from divtrace.words import sci


def _named(row: Any) -> str:
    return "none" if row is None else f"{row['site']} (rel_l2 {sci(row['rel_l2'])})"


def _part_line(found: Any) -> str:
    fwd = found.forward.first_divergence if found.forward is not None else None
    params = found.of("param")
    worst = params.loc[params["rel_l2"].fillna(0).idxmax()]
    return (f"first output gradient apart, in backward order: "
            f"{_named(found.first_divergence)}; first forward site apart: {_named(fwd)}; "
            f"parameters apart: {int((params['mismatch'] > 0).sum())} of {len(params)}, "
            f"the largest rel_l2 {sci(worst['rel_l2'])} ({worst['site']})")


def run(dtype: torch.dtype, case: dict[str, Any], plots: Path | None) -> list[str]:
    device = torch.device("cuda")
    model = llama(case, device, dtype)
    batch = batch_of(case, device)
    lines = [f"## {str(dtype).removeprefix('torch.')}", ""]
    for label, weight in (("rows (the bug)", None), ("tokens (the fix)", by_tokens(batch))):
        start = time.perf_counter()
        found = divtrace.compare_backward(model, batch, model_loss, chunk=case["chunk"],
                                          weight=weight, progress=False)
        seconds = time.perf_counter() - start
        lines += [f"### each chunk weighted by its {label}: {found.verdict.kind} "
                  f"({seconds:.2f} s)", "", found.summary(), "",
                  found.weights.table.to_string(index=False), "", _part_line(found), ""]
        if plots is not None:
            import matplotlib.pyplot as plt

            name = f"backward_{str(dtype).removeprefix('torch.')}_{label.split()[0]}"
            for kind in ("grad", "param"):
                figure, ax = plt.subplots(figsize=(12, 4))
                found.plot(ax, kind)
                figure.savefig(plots / f"{name}_{kind}.png", dpi=90, bbox_inches="tight")
                plt.close(figure)
    del model
    torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="a small model, for a check")
    parser.add_argument("--plots", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    case = dict(CASES["cuda"])
    if args.small:
        case.update(hidden=256, layers=2, heads=8, kv_heads=4, mlp=704, vocab=1000, tokens=64)
    lines = ["# One backward over the batch vs gradient accumulation, on one GPU", "",
             f"environment: {environment(torch.device('cuda'))}", f"case: {case}", ""]
    for dtype in (torch.float32, torch.bfloat16):
        lines += run(dtype, case, args.plots)
    lines += ["## cost (the fixed comparison, interleaved, medians)", ""]
    for dtype in (torch.bfloat16, torch.float32):
        found = measure(torch.device("cuda"), dtype, args.repeats, case)
        lines.append(f"{found['dtype']}: " + "; ".join(
            f"{way} {s:.3f} s (first call {found['cold'][way]:.3f} s, "
            f"{found['ratio'][way]:.2f}×)" for way, s in found["seconds"].items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backward_h200.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
