"""Remedies on a GPU: which settings make batched and split runs bit-identical, and at
what cost — for the seed cases with the seed settings and a bfloat16 Llama-like model.

vgg11().features (batch 128 vs chunks of 2), AlexNet (batch 100 vs per sample) and
efficientnet_v2_s (batch 64 vs chunks of 2), random weights, fp32, TF32 off, cuDNN
deterministic, no benchmark mode; a 4-layer Llama-like model in bfloat16 (SDPA
attention) on 16 prompts of 8 to 96 tokens. For each: ``compare()``, then
``remedies()``; every remedy the table calls identical is applied again by hand in a
plain loop (``with remedy.applied(model)``: the batched call and the split calls) and the
outputs checked bit for bit. Writes a summary, the tables as JSON and one figure.

    python benchmarks/gpu/remedies_gpu.py --out docs/results/h200 [--small]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from divtrace.plan.prompts import ragged_input

#: The seed reports' settings: fp32 without TF32, cuDNN deterministic, no benchmark mode.
SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)


def image_cases(small: bool, device: str) -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    from torchvision.models import alexnet, efficientnet_v2_s, vgg11

    torch.manual_seed(0)
    side, batch = (64, 8) if small else (None, None)
    return {
        "vgg11_features": (vgg11().features.eval().to(device),
                           torch.rand(batch or 128, 3, side or 128, side or 128, device=device),
                           {"a": divtrace.Run(chunk=2), "samples": [0, 1]}),
        "alexnet": (alexnet().eval().to(device),
                    torch.rand(batch or 100, 3, side or 224, side or 224, device=device), {}),
        "efficientnet_v2_s": (efficientnet_v2_s().eval().to(device),
                              torch.rand(batch or 64, 3, side or 224, side or 224,
                                         device=device),
                              {"a": divtrace.Run(chunk=2), "samples": [0, 1]}),
    }


def llama_case(small: bool, device: str) -> tuple[Any, Any, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    width = 64 if small else 1024
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=2 if small
        else 4, num_attention_heads=4 if small else 16, num_key_value_heads=2 if small else 4,
        vocab_size=1000 if small else 32000, attn_implementation="sdpa"))
    model = model.eval().to(device=device, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.linspace(8, 24 if small else 96, 16).round().int().tolist()
    prompts = [torch.randint(1, 1000, (n,), generator=generator).to(device) for n in lengths]
    return model, divtrace.Prompts(prompts), {}


def plain_loop(model: Any, x: Any, remedy: Any, options: dict[str, Any]) -> bool:
    """The remedy applied by hand: the batched call and the split calls, in a loop."""
    with torch.no_grad(), remedy.applied(model):
        if isinstance(x, divtrace.Prompts):
            batch = ragged_input(x)
            size = batch.batch_size
            whole = model(**batch.rows(0, size)[1]).logits
            layout = batch.layout(0, size)
            return all(torch.equal(layout.tokens(whole, i),
                                   model(**batch.rows(i, i + 1)[1]).logits[0])
                       for i in range(size))
        chunk = options.get("a", divtrace.Run(chunk=1)).chunk
        samples = options.get("samples") or range(len(x))
        whole = model(x)
        starts = sorted({s - s % chunk for s in samples})
        split = {s: model(x[s:s + chunk]) for s in starts}
        return all(torch.equal(whole[s], split[s - s % chunk][s % chunk]) for s in samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="small inputs (a quick check)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    with SEED.flags():
        return run(args, device)


def run(args: argparse.Namespace, device: str) -> int:
    from matplotlib.figure import Figure

    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    lines, found = [json.dumps(env), ""], {}
    cases = {**image_cases(args.small, device), "llama_bf16_prompts":
             llama_case(args.small, device)}
    for name, (model, x, options) in cases.items():
        start = time.perf_counter()
        result = divtrace.compare(model, x, progress=False, **options)
        compared = time.perf_counter() - start
        start = time.perf_counter()
        remedies = result.remedies(progress=False)
        took = time.perf_counter() - start
        by_hand = {c.name: plain_loop(model, x, c, options) for c, row in
                   zip(remedies.candidates, remedies.table.itertuples(), strict=True)
                   if row.identical is True or str(row.identical) == "True"}
        lines += [f"== {name}: {result.verdict}, output rel_l2 {remedies.before:.3g}; "
                  f"compare() {compared:.1f} s, remedies() {took:.1f} s", remedies.summary(),
                  "identical when applied by hand in a plain loop: " + (", ".join(
                      f"{k}: {v}" for k, v in by_hand.items()) or "none to check"), ""]
        found[name] = {"verdict": result.verdict, "compare_s": compared, "remedies_s": took,
                       "best": None if remedies.best is None else remedies.best.name,
                       "by_hand": by_hand,
                       "table": json.loads(remedies.table.to_json(orient="records"))}
        if name == "vgg11_features":
            figure = Figure(figsize=(8, 4), layout="constrained")
            remedies.plot(ax=figure.subplots())
            figure.savefig(args.out / "remedies_vgg11_features.png", dpi=110)
        print("\n".join(lines[-4:]), flush=True)
    (args.out / "remedies_summary.txt").write_text("\n".join(lines))
    (args.out / "remedies.json").write_text(json.dumps({"environment": env, "cases": found},
                                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
