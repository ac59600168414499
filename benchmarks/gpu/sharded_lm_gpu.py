"""Language-model comparisons of a model placed over two GPUs with accelerate: the same
figures as on one GPU?

A random-init Llama (hidden 1024, 8 layers; nothing downloaded), fp32, TF32 off: once on
cuda:0, once dispatched by ``accelerate.dispatch_model`` (layers 0-3 and the embedding on
cuda:0, layers 4-7, the norm and the head on cuda:1; the same weights). For both:
``compare(model, Prompts(...))`` over 12 prompts of 5 to 60 tokens, ``compare_generate``
with 24 new tokens, and ``Generation.at(3)``. Writes the tables and a summary into --out.

    python benchmarks/gpu/sharded_lm_gpu.py --out docs/results/h200x2
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace

SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)
FIGURES = ["site", "status", "numel", "mismatch", "rel_l2", "max_abs", "role"]


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    import accelerate
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256)
    torch.manual_seed(0)
    one = transformers.LlamaForCausalLM(config).eval().to("cuda:0")
    two = copy.deepcopy(one)
    device_map: dict[str, int] = {"lm_head": 1, "model.embed_tokens": 0,
                                  "model.norm": 1, "model.rotary_emb": 0}
    device_map |= {f"model.layers.{i}": int(i >= 4) for i in range(8)}
    return one, accelerate.dispatch_model(two, device_map=device_map)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(5, 60, 12).round().int().tolist()
    prompts = [torch.randint(3, 4096, (n,), generator=generator).to("cuda:0")
               for n in lengths]
    lines = [f"torch {torch.__version__}, {torch.cuda.device_count()} x "
             f"{torch.cuda.get_device_name()}", ""]
    found = {}
    with SEED.flags():
        for name, model in zip(("one GPU", "two GPUs"), models(), strict=True):
            forward = divtrace.compare(model, divtrace.Prompts(prompts), progress=False)
            generation = divtrace.compare_generate(model, prompts, max_new_tokens=24,
                                                   eos_token_id=None, progress=False)
            step = generation.at(3)
            found[name] = (forward.table, generation.table, step.table)
            tag = name.replace(" ", "_")
            forward.to_csv(args.out / f"sharded_prompts_{tag}.csv")
            generation.table.to_csv(args.out / f"sharded_generate_{tag}.csv", index=False)
            step.to_csv(args.out / f"sharded_step3_{tag}.csv")
            devices = sorted({str(p.device) for p in model.parameters()})
            lines += [f"## {name} ({', '.join(devices)})", forward.summary().splitlines()[0],
                      generation.summary(), step.summary().splitlines()[0], ""]
    (a_fwd, a_gen, a_step), (b_fwd, b_gen, b_step) = found["one GPU"], found["two GPUs"]
    on_second = [s for s in a_fwd["site"] if any(s.startswith(f"model.layers.{i}.")
                                                 for i in range(4, 8))]
    lines += [
        "## one GPU vs two GPUs",
        f"compare(Prompts): {len(a_fwd)} sites ({len(on_second)} on cuda:1), every figure "
        f"equal: {a_fwd[FIGURES].equals(b_fwd[FIGURES])}",
        f"compare_generate: {len(a_gen)} (prompt, step) rows, tables equal: "
        f"{a_gen.equals(b_gen)}",
        f"at(3): {len(a_step)} sites, every figure equal: "
        f"{a_step[FIGURES].equals(b_step[FIGURES])}"]
    (args.out / "sharded_lm_summary.txt").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
