"""Greedy generation on a GPU: where does a prompt served in a batch part from the same
prompt served alone?

A random-init Llama-like model built from a config (nothing downloaded; hidden 2048, 8
layers, 16 heads, 4 key-value heads), 32 prompts of 8 to 200 tokens, 64 new tokens, left
padding, TF32 off; fp32 and bf16, eager and SDPA attention. For each setting: per prompt
the first step whose tokens part, the top-two margin there, and the first layer whose
output differs at that step (``Generation.at(step, samples=[prompt])``); and the time of
``compare_generate`` against the bare ``generate()`` calls it makes. Writes a table per
setting, a JSON summary, a text summary and a plot into --out.

    python benchmarks/gpu/generate_gpu.py --out docs/results/h200 [--prompts 32 --tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from divtrace.plan.prompts import pad

SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)


def build(dtype: torch.dtype, attention: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).to(dtype).eval().cuda()


def bare_seconds(model: torch.nn.Module, found: divtrace.Generation) -> float:
    """The generate() calls compare_generate makes, without divtrace."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    size = len(found.prompts)
    for lo, hi in [(0, size), *[(i, i + 1) for i in range(size)]]:
        inputs, _ = pad(found.prompts, lo, hi)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=found.new_tokens, do_sample=False,
                           **found.settings)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def first_layer(found: divtrace.Generation, prompt: int, step: int) -> dict:
    """The first site whose output differs for ``prompt`` at ``step``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", divtrace.DivtraceWarning)
        result = found.at(step, samples=[prompt])
    samples = result.per_sample
    hits = samples[(samples["sample"] == prompt) & (samples["mismatch"] > 0)]
    if hits.empty:
        return {"site": None}
    row = hits.iloc[0]
    return {"site": row["site"], "rel_l2": float(row["rel_l2"]),
            "verdict": result.verdict}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers-for", type=int, default=8,
                        help="look up the first diverging layer for this many prompts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(8, 200, args.prompts).round().int().tolist()
    prompts = [torch.randint(3, 32000, (n,), generator=generator).cuda() for n in lengths]
    summary: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                     "lengths": lengths, "new_tokens": args.tokens, "settings": {}}
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}", ""]
    with SEED.flags():
        for dtype in (torch.float32, torch.bfloat16):
            for attention in ("eager", "sdpa"):
                name = f"{str(dtype).removeprefix('torch.')}_{attention}"
                model = build(dtype, attention)
                found = divtrace.compare_generate(model, prompts, max_new_tokens=args.tokens,
                                                  eos_token_id=None, progress=False)
                bare = bare_seconds(model, found)  # after a first run: kernels warm
                torch.cuda.synchronize()
                start = time.perf_counter()
                again = divtrace.compare_generate(model, prompts, max_new_tokens=args.tokens,
                                                  eos_token_id=None, progress=False)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                same = again.table.equals(found.table)
                first = found.per_prompt
                found.table.to_csv(args.out / f"generate_{name}.csv", index=False)
                parted = first.dropna(subset=["first_token_split"]).sort_values(
                    "first_token_split")
                layers = {int(r.prompt): first_layer(found, int(r.prompt),
                                                     int(r.first_token_split))
                          for r in parted.head(args.layers_for).itertuples()}
                summary["settings"][name] = {
                    "seconds": seconds, "bare_generate_seconds": bare,
                    "ratio": seconds / bare, "second_run_same_table": same,
                    "first_divergence": first.astype(object).where(first.notna(), None)
                    .to_dict("records"),
                    "first_layer_at_split": layers}
                lines += [f"## {name}: compare_generate {seconds:.1f} s, the bare generate() "
                          f"calls {bare:.1f} s ({seconds / bare:.2f}×)", found.summary()]
                at_step = parted.set_index("prompt")["first_token_split"]
                lines += [f"prompt {p} parts at step {int(at_step.loc[p])}: first differing "
                          f"site there {info.get('site')} (rel_l2 "
                          f"{info.get('rel_l2', float('nan')):.2g})"
                          for p, info in layers.items()] + [""]
                if name == "bfloat16_sdpa":
                    import matplotlib

                    matplotlib.use("Agg")
                    ax = found.plot()
                    ax.figure.savefig(args.out / "generate_bf16_sdpa.png", dpi=110,
                                      bbox_inches="tight")
                del model, found, again
                torch.cuda.empty_cache()
    (args.out / "generate_summary.txt").write_text("\n".join(lines))
    (args.out / "generate_found.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
