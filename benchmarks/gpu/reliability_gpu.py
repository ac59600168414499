"""Reliability on GPUs: a model sharded over two GPUs, and the observer check.

1. A random-init Llama (hidden 1024, 8 layers), batch 16 vs per sample, on one GPU and
   dispatched with accelerate (layers 0-3 on cuda:0, 4-7 on cuda:1, same weights): every
   figure of the sharded run must equal the one-GPU run's.
2. nn.TransformerEncoderLayer in eval mode: does observing it change its output?

Seed settings (fp32, TF32 off, cuDNN deterministic). Needs two CUDA devices, transformers
and accelerate.

    python benchmarks/gpu/reliability_gpu.py --out docs/results/h200x2
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace

SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)
FIGURES = ["site", "status", "mismatch", "rel_l2", "max_abs", "role"]


def sharded_llama(lines: list[str], out: Path) -> None:
    import accelerate
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=4096, max_position_embeddings=128)
    torch.manual_seed(0)
    one = transformers.LlamaForCausalLM(config).eval().to("cuda:0")
    two = copy.deepcopy(one)
    device_map: dict[str, int] = {"lm_head": 1}
    for name, _child in two.model.named_children():
        if name == "layers":
            device_map |= {f"model.layers.{i}": int(i >= 4) for i in range(8)}
        else:
            device_map[f"model.{name}"] = 0 if name == "embed_tokens" else 1
    two = accelerate.dispatch_model(two, device_map=device_map)
    ids = torch.randint(0, 4096, (16, 32), generator=torch.Generator().manual_seed(0))
    x = {"input_ids": ids.to("cuda:0"), "use_cache": False}
    tables = {}
    for name, model in (("one GPU", one), ("two GPUs", two)):
        result = divtrace.compare(model, x, progress=False)
        tables[name] = result.table
        result.to_csv(out / f"sharded_llama_{name.replace(' ', '_')}.csv")
    a, b = tables["one GPU"], tables["two GPUs"]
    on_second = [s for s in a["site"] if any(s.startswith(f"model.layers.{i}.")
                                             for i in range(4, 8))]
    ok = a["status"] == "ok"
    lines += [
        "## Llama (hidden 1024, 8 layers), batch 16 vs per sample: one GPU vs dispatched",
        f"sites: {len(a)}, compared: {int(ok.sum())}, of them on cuda:1: {len(on_second)}",
        f"every figure equal (site, status, mismatch, rel_l2, max_abs, role): "
        f"{a[FIGURES].equals(b[FIGURES])}",
        f"rel_l2 over the compared sites, one GPU: {a.loc[ok, 'rel_l2'].min():.3g} .. "
        f"{a.loc[ok, 'rel_l2'].max():.3g}; two GPUs: {b.loc[ok, 'rel_l2'].min():.3g} .. "
        f"{b.loc[ok, 'rel_l2'].max():.3g}",
        f"output rel_l2: one GPU {a.iloc[-1]['rel_l2']:.3g}, two GPUs "
        f"{b.iloc[-1]['rel_l2']:.3g}", ""]


def observer(lines: list[str]) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True).eval().cuda()
    x = torch.randn(32, 64, 256, device="cuda")
    result = divtrace.compare(layer, x, a=divtrace.Run(chunk=4), samples=[0, 1, 2, 3],
                              progress=False)
    note = result.info.notes["observer"]
    lines += ["## nn.TransformerEncoderLayer(256, 8, 1024), batch 32 vs chunks of 4, on cuda:0",
              f"observer check: {note}", result.summary(), ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"torch {torch.__version__}, {torch.cuda.device_count()} x "
             f"{torch.cuda.get_device_name(0)}", ""]
    with SEED.flags():
        sharded_llama(lines, args.out)
        observer(lines)
    text = "\n".join(lines)
    (args.out / "reliability.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
