"""Op-level sites on a GPU: where inside attention a batch of prompts parts from each
prompt alone.

Random-init models built from configs (nothing downloaded), fp32, TF32 off, cuDNN
deterministic: a Llama-like model and a BERT, each with eager and SDPA attention, 16
sequences of 128 tokens, batched vs each alone and vs chunks of 8, ``ops=True``; and
``nn.TransformerEncoder`` in eval with a padding mask (the fused fast path), recorded
with ``ops="only"`` (no hook inside the model: does the fast path stay on?) and with
``ops=True`` (module hooks: it goes off). Writes one table per case and a summary into --out.

    python benchmarks/gpu/ops_gpu.py --out docs/results/h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace

SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)
COLUMNS = ["site", "op", "scope", "status", "shape", "mismatch", "rel_l2", "input_mismatch",
           "role"]


def hf_cases() -> dict[str, tuple[nn.Module, dict]]:
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    found = {}
    for attention in ("eager", "sdpa"):
        torch.manual_seed(0)
        llama = LlamaForCausalLM(LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
            attn_implementation=attention))
        torch.manual_seed(0)
        bert = BertModel(BertConfig(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=4,
            num_attention_heads=12, vocab_size=30522, attn_implementation=attention))
        found[f"llama_{attention}"] = (llama, {"vocab": 32000})
        found[f"bert_{attention}"] = (bert, {"vocab": 30522})
    return found


def describe(result: divtrace.Comparison) -> dict:
    table = result.table
    ops = table[table["op"] != ""]
    sources = ops[ops["role"] == "source"]
    first = result.first_divergence
    return {
        "verdict": result.verdict, "sites": len(table), "op_sites": len(ops),
        "first_divergence": None if first is None else {
            "site": first["site"], "op": first["op"], "rel_l2": float(first["rel_l2"])},
        "op_sources": [{"site": r.site, "op": r.op, "scope": r.scope,
                        "rel_l2": float(r.rel_l2), "mismatch": float(r.mismatch)}
                       for r in sources.itertuples()],
        "module_sources": list(table[(table["op"] == "") & (table["role"] == "source")]["site"]),
        "statuses": table["status"].value_counts().to_dict(),
        "output_rel_l2": float(result.output["rel_l2"]) if result.output is not None else None,
    }


def encoder_case(out: Path, lines: list[str], found: dict) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    model = nn.TransformerEncoder(layer, 4).eval().cuda()
    x = torch.randn(16, 128, 512, device="cuda")
    mask = torch.zeros(16, 128, dtype=torch.bool, device="cuda")
    mask[:, 100:] = True  # padding at the end of every sequence
    inputs = {"src": x, "src_key_padding_mask": mask}
    for ops in ("only", True):
        start = time.perf_counter()
        result = divtrace.compare(model, inputs, ops=ops, progress=False)
        seconds = time.perf_counter() - start
        table = result.table
        fused = table[table["op"].str.contains("_transformer_encoder_layer_fwd")]
        name = f"transformer_encoder_ops_{ops}"
        table[COLUMNS].to_csv(out / f"ops_{name}.csv", index=False)
        found[name] = describe(result) | {
            "fused_op_sites": len(fused), "seconds": seconds,
            "observer": result.meta.notes.get("observer")}
        lines += [f"## {name} ({seconds:.1f} s)", result.summary(), ""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    found: dict = {}
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}", ""]
    with SEED.flags():
        for name, (model, info) in hf_cases().items():
            model = model.eval().cuda()
            torch.manual_seed(1)
            ids = torch.randint(0, info["vocab"], (16, 128), device="cuda")
            eight = {"a": divtrace.Run(chunk=8), "samples": range(8)}
            for split, options in (("per sample", {}), ("chunks of 8", eight)):
                start = time.perf_counter()
                result = divtrace.compare(model, {"input_ids": ids}, ops=True,
                                          progress=False, **options)
                seconds = time.perf_counter() - start
                case = name + ("" if not options else "_chunk8")
                result.table[COLUMNS].to_csv(args.out / f"ops_{case}.csv", index=False)
                found[case] = describe(result) | {"seconds": seconds, "split": split}
                lines += [f"## {case}: batch of 16 vs {split} ({seconds:.1f} s)",
                          result.summary(), ""]
            del model
            torch.cuda.empty_cache()
        encoder_case(args.out, lines, found)
    (args.out / "ops_summary.txt").write_text("\n".join(lines))
    (args.out / "ops_found.json").write_text(json.dumps(found, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
