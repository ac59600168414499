"""Routing flips on a GPU: a Qwen3-MoE of Qwen3-30B-A3B's layer shape (hidden 2048, 128
experts, 8 per token, expert width 768, 32 heads of 128, 4 key-value heads), random init
from its config, bfloat16, SDPA, fewer layers (``--layers``, 12 by default: with the
float64 copy the verdict's second test makes, about what one H200 holds).

16 prompts of 64–512 tokens, each alone against the padded batch, every module observed:
the flips per router, the first, the margins of the flipped tokens, the share of the
output's squared difference on the flipped tokens, the verdict; routing replayed (run a's
experts forced in run b); the same with the experts computed by each of transformers'
implementations (``grouped_mm``, the default where it runs; ``eager``, a loop with
``index_add_``; ``batched_mm``), each batched pass run twice to see whether it repeats
bit for bit. Each comparison's wall time against its bare passes (the batched forward
and each prompt's own), and the peak memory. ``--part remedies`` then adds the remedies
(float32 router, math attention, fixed batch, reduced precision off, deterministic;
float64 with ``--candidates``), each verified and costed. Writes ``moe_summary.txt`` and
``moe.json`` into --out.

    python benchmarks/gpu/moe_gpu.py --out docs/results/h200
    python benchmarks/gpu/moe_gpu.py --out docs/results/h200 --part remedies
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from divtrace.plan.prompts import Prompts, pad


def qwen3_moe(layers: int, device: str, tiny: bool) -> nn.Module:
    """Qwen3-30B-A3B's layer shape with ``layers`` layers (``tiny``: a shape for a check of
    this script on the CPU), random init, bfloat16, eval mode."""
    import transformers

    shape = ({"hidden_size": 64, "num_experts": 16, "num_experts_per_tok": 4,
              "moe_intermediate_size": 32, "num_attention_heads": 4, "head_dim": 16,
              "num_key_value_heads": 2, "vocab_size": 1000} if tiny else
             {"hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
              "moe_intermediate_size": 768, "num_attention_heads": 32, "head_dim": 128,
              "num_key_value_heads": 4, "vocab_size": 151936})
    config = transformers.Qwen3MoeConfig(num_hidden_layers=layers, intermediate_size=6144,
                                         attn_implementation="sdpa", **shape)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(work: Any) -> tuple[Any, float]:
    import time

    sync()
    start = time.perf_counter()
    out = work()
    sync()
    return out, time.perf_counter() - start


def settle() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def bare(model: nn.Module, prompts: Prompts) -> float:
    """The comparison's two runs without divtrace: the padded batch, then each prompt."""
    def passes() -> None:
        with torch.no_grad():
            model(**pad(prompts, 0, len(prompts))[0])
            for i in range(len(prompts)):
                model(**pad(prompts, i, i + 1)[0])
    passes()  # warm
    return timed(passes)[1]


def repeats(model: nn.Module, prompts: Prompts) -> bool:
    """Whether the padded batch's logits come out bit for bit the same twice."""
    inputs = pad(prompts, 0, len(prompts))[0]
    with torch.no_grad():
        one, two = model(**inputs).logits, model(**inputs).logits
    return bool(torch.equal(one, two))


def routing(result: divtrace.Comparison) -> dict[str, Any]:
    """The figures of the routing probe and the replay, as the JSON keeps them."""
    notes = result.meta.notes
    routers = notes["routing"]["routers"]
    flipped = [(key, f) for key, r in routers.items() for f in r["flipped"]]
    margins = [min(f["margin_a"], f["margin_b"]) for _, f in flipped
               if f["margin_a"] is not None and f["margin_b"] is not None]
    out = result.table[result.table["module"] == "(model)"].iloc[-1]
    replay = notes.get("replay") or {}
    first = result.first_divergence
    return {
        "verdict": result.verdict,
        "first_site": None if first is None else first["site"],
        "output_rel_l2": float(out["rel_l2"]),
        "replayed_output_rel_l2": (replay.get("rel_l2") or {}).get(out["site"]),
        "flips": {key: r["flips"] for key, r in routers.items()},
        "tokens": next(iter(routers.values()))["tokens"],
        "first_flip": next((key for key, r in routers.items() if r["flips"]), None),
        "not_by_scores": sum(r["not_by_scores"] for r in routers.values()),
        "kept_flips": len(flipped),
        "kept_exact_ties": sum(m == 0 for m in margins),
        "flip_margin_max": float(f"{max(margins):.3g}") if margins else None,
        "flip_margin_median": (float(f"{torch.tensor(margins).median():.3g}") if margins
                               else None),
        "output_share": notes["routing"]["output"],
        "summary": result.summary()}


def flips(model: nn.Module, prompts: Prompts, lines: list[str], report: dict[str, Any],
          save: Any) -> None:
    """Each prompt alone against the padded batch under each experts implementation, with
    routing replayed; ``save()`` after each."""
    for implementation in ("grouped_mm", "eager", "batched_mm"):
        try:
            model.set_experts_implementation(implementation)
        except (ValueError, ImportError) as error:
            lines.append(f"\n== experts '{implementation}': cannot run here ({error}) ==")
            continue
        try:
            seconds_bare = bare(model, prompts)
        except torch.OutOfMemoryError as error:
            lines.append(f"\n== experts '{implementation}': the bare passes run out of "
                         f"memory ({str(error).split('. GPU')[0]}) ==")
            report[implementation] = {"out_of_memory": str(error).split(". GPU")[0]}
            settle()
            continue
        again = repeats(model, prompts)
        settle()
        result, seconds = timed(lambda: divtrace.compare(
            model, prompts, explain=["replay"], progress=False))
        found = routing(result) | {
            "repeats_bit_for_bit": again, "seconds": seconds, "bare_seconds": seconds_bare,
            "against_bare": seconds / seconds_bare, "peak_gib": peak()}
        report[implementation] = found
        per = ", ".join(f"{key.removeprefix('model.layers.').removesuffix('.mlp.gate')}:"
                        f"{n}" for key, n in found["flips"].items())
        lines += [f"\n== experts '{implementation}': each prompt alone vs the padded batch ==",
                  result.summary(),
                  f"flips per layer (of {found['tokens']} tokens each): {per}",
                  f"first flip: {found['first_flip']}; of the flips kept (the first 64 per "
                  f"router, {found['kept_flips']}), the smaller of the two margins: median "
                  f"{found['flip_margin_median']}, largest {found['flip_margin_max']}, "
                  f"an exact tie in one run for {found['kept_exact_ties']}; flips a run did "
                  f"not choose by its scores: {found['not_by_scores']}",
                  f"output rel_l2 {found['output_rel_l2']:.3g}; routing replayed: "
                  f"{found['replayed_output_rel_l2']}",
                  f"the padded batch repeats bit for bit: {again}",
                  f"cost: {seconds:.1f} s against {seconds_bare:.2f} s of bare passes: "
                  f"{found['against_bare']:.1f}x (the replay's pass included); peak "
                  f"{found['peak_gib']:.1f} GiB"]
        print("\n".join(lines[-7:]), flush=True)
        del result
        save()
    model.set_experts_implementation("grouped_mm")


#: The remedies tried: the router in float32, the math attention backend, a fixed batch,
#: reduced precision off, deterministic algorithms (``--candidates`` adds others, e.g.
#: float64, whose widened copy of the model takes most of the time).
CANDIDATES = ["float32-router", "math-attention", "fixed-batch", "precision", "deterministic"]


def remedies(model: nn.Module, prompts: Prompts, candidates: list[str]
             ) -> tuple[list[str], dict[str, Any]]:
    settle()
    result, plain = timed(lambda: divtrace.compare(model, prompts, progress=False))
    found, seconds = timed(lambda: result.remedies(candidates=candidates, repeats=2,
                                                   progress=False))
    table = found.table
    report = {"seconds": seconds, "compare_seconds": plain, "summary": found.summary(),
              "table": table.drop(columns=["verdict"]).to_dict(orient="records"),
              "peak_gib": peak()}
    shown = table[["remedy", "identical", "output_rel_l2", "cost", "a_cost", "note"]]
    lines = ["\n== remedies of each prompt alone vs the padded batch (experts grouped_mm) ==",
             found.summary(), shown.to_string(index=False, max_colwidth=90),
             f"{seconds:.0f} s for the remedies; peak {report['peak_gib']:.1f} GiB; the "
             f"comparison without the replay {plain:.1f} s"]
    return lines, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny shape on the CPU: a check of this script")
    parser.add_argument("--part", choices=("flips", "remedies"), default="flips")
    parser.add_argument("--candidates", nargs="+", default=CANDIDATES,
                        help="the remedies tried by --part remedies")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.tiny else "cuda"
    import transformers

    model = qwen3_moe(args.layers, device, args.tiny)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(64, 512, args.prompts).round().int().tolist()
    prompts = Prompts([torch.randint(3, vocab, (n,), generator=generator).to(device)
                       for n in lengths])
    text, data = args.out / "moe_summary.txt", args.out / "moe.json"
    if args.part == "flips":
        params = sum(p.numel() for p in model.parameters()) / 1e9
        lines = [f"Qwen3-MoE, Qwen3-30B-A3B's layer shape with {args.layers} layers "
                 f"({params:.2f}B parameters), bfloat16, SDPA, random init; "
                 f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens; torch "
                 f"{torch.__version__}, transformers {transformers.__version__}, "
                 f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}"]
        report: dict[str, Any] = {"layers": args.layers, "parameters_b": params,
                                  "prompts": lengths, "experts": {}}
    else:
        lines = text.read_text().split("\n== remedies")[0].rstrip("\n").splitlines()
        report = json.loads(data.read_text())

    def save() -> None:
        text.write_text("\n".join(lines) + "\n")
        data.write_text(json.dumps(report, indent=1, default=str))

    if args.part == "flips":
        flips(model, prompts, lines, report["experts"], save)
    else:
        found, report["remedies"] = remedies(model, prompts, args.candidates)
        lines += found
        save()
        print("\n".join(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
