"""Token layouts on a GPU: a reinforcement-learning rollout against its trainer, and packed
against padded, on an 8B-shaped Llama (random init from a config, bfloat16, SDPA).

16 prompts of 64–512 tokens, 64 new tokens (greedy, no end-of-sequence token). For each
trainer layout (right-padded, packed): ``compare_rollout`` observed at every decoder
layer, the final norm and the LM head — the figures RL users watch (max and mean
|Δlogprob|, the share beyond 1e-3, argmax flips), the first site that parts, the verdict
— then ``compare_layouts(packed vs right-padded)`` over the finished sequences, and a
rollout of 4 prompts observed at every module (the first module that parts); a trainer
in micro-batches of 4. Each comparison's wall time against its bare passes (the
rollout's ``generate()`` and the trainer's forward calls, or the two layouts' forward
calls), timed right before it, and the peak memory. ``--part remedies`` then adds the
rollout's remedies (against the right-padded trainer), each verified per token and
costed over both runs' own passes. Writes ``layouts_summary.txt``, ``layouts.json`` and
``layouts_tokens.png`` into --out.

    python benchmarks/gpu/layouts_gpu.py --out docs/results/h200
    python benchmarks/gpu/layouts_gpu.py --out docs/results/h200 --part remedies
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from benchmarks.common import cuda_timed as timed
from benchmarks.common import llama_8b
from divtrace.plan.prompts import Prompts, pad
from divtrace.plan.tokens import Layout, token_input


def bare_rollout(model: nn.Module, prompts: list[torch.Tensor], new: int) -> list[torch.Tensor]:
    """generate() as compare_rollout runs it: the finished sequences."""
    inputs, layout = pad(Prompts(prompts, padding_side="left"), 0, len(prompts))
    inputs.pop("position_ids")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return [torch.cat([p, s[layout.length:]]) for p, s in zip(prompts, out.sequences,
                                                                strict=True)]


def bare_pass(model: nn.Module, sequences: list[torch.Tensor], layout: str) -> None:
    """The forward calls of ``sequences`` in ``layout`` (padded or packed: one call, or one
    per micro-batch)."""
    tokens = token_input(Prompts(sequences, padding_side="right"))
    laid = Layout.of(layout)
    step = laid.size or len(sequences)
    with torch.no_grad():
        for low in range(0, len(sequences), step):
            inputs, _ = tokens.one_pass(laid.whole, low, min(low + step, len(sequences)))
            model(**inputs)


def settle() -> None:
    """What a case left behind freed before the next one's peak is read."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def figures_of(result: divtrace.Comparison) -> dict[str, Any]:
    first = result.first_divergence
    found: dict[str, Any] = {
        "verdict": result.verdict, "first_site": None if first is None else first["site"],
        "first_rel_l2": None if first is None else float(first["rel_l2"]),
        "sites": int((result.table["status"] == "ok").sum())}
    if "tokens" in result.meta.notes:
        figures = divtrace.token_figures(result)
        delta = figures.logprobs["delta"]
        found |= {"tokens": len(delta), "max_dlogprob": float(delta.max()),
                  "mean_dlogprob": float(delta.mean()),
                  "share_over_1e-3": float((delta > 1e-3).mean()),
                  "argmax_flips": int(figures.logprobs["flip"].sum()),
                  "token_summary": figures.summary()}
    return found


def cases(model: nn.Module, prompts: list[torch.Tensor], lengths: list[int], new: int,
          blocks: list[str], out: Path) -> tuple[list[str], dict[str, Any]]:
    """The rollout against each trainer, packed against padded, a micro-batched trainer,
    and a rollout of 4 prompts observed at every module."""
    lines: list[str] = []
    report: dict[str, Any] = {}
    figures = None
    for trainer in ("padded:right", "packed", "padded:right:4"):
        finished, rollout = timed(partial(bare_rollout, model, prompts, new))
        _, forward = timed(partial(bare_pass, model, finished, trainer))
        settle()
        result, seconds = timed(partial(
            divtrace.compare_rollout, model, prompts, max_new_tokens=new,
            trainer=trainer, eos_token_id=None, pad_token_id=0, modules=blocks,
            progress=False))
        found = figures_of(result) | {
            "seconds": seconds, "bare_seconds": rollout + forward,
            "against_bare": seconds / (rollout + forward),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "summary": result.summary()}
        report[f"rollout vs {trainer} trainer"] = found
        lines += [f"\n== rollout (KV-cache decode) vs trainer ({trainer}) ==",
                  result.summary(), found["token_summary"],
                  f"cost: {seconds:.1f} s against {rollout + forward:.2f} s of bare passes "
                  f"(generate {rollout:.2f} s + trainer forward {forward:.2f} s): "
                  f"{found['against_bare']:.1f}×; peak {found['peak_gib']:.1f} GiB"]
        print(lines[-1], flush=True)
        if figures is None:
            figures = divtrace.token_figures(result)
            figures.plot(out / "layouts_tokens.png")
        del result
    _, packed = timed(lambda: bare_pass(model, finished, "packed"))
    _, padded = timed(lambda: bare_pass(model, finished, "padded:right"))
    settle()
    result, seconds = timed(lambda: divtrace.compare_layouts(
        model, finished, a="packed", b="padded:right", modules=blocks, progress=False))
    found = figures_of(result) | {"seconds": seconds, "bare_seconds": packed + padded,
                                  "against_bare": seconds / (packed + padded),
                                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                                  "summary": result.summary()}
    report["packed vs right-padded"] = found
    lines += ["\n== packed vs right-padded (the finished sequences) ==", result.summary(),
              f"cost: {seconds:.1f} s against {packed + padded:.2f} s of bare passes: "
              f"{found['against_bare']:.1f}×; peak {found['peak_gib']:.1f} GiB"]
    print(lines[-1], flush=True)
    del result
    few = prompts[:4]
    settle()
    result, seconds = timed(lambda: divtrace.compare_rollout(
        model, few, max_new_tokens=16, eos_token_id=None, pad_token_id=0, progress=False))
    found = figures_of(result) | {"seconds": seconds, "summary": result.summary(),
                                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    report["rollout of 4 prompts, every module"] = found
    lines += ["\n== rollout vs right-padded trainer, 4 prompts, 16 new tokens, every module "
              "==", result.summary(), found["token_summary"],
              f"{seconds:.1f} s; peak {found['peak_gib']:.1f} GiB"]
    return lines, report


#: The remedies tried on the rollout: divtrace's own, less float64 in the sources (widened
#: one layer at a time, it would take 32 rounds), which is tried at once in every decoder
#: layer and the LM head instead.
CANDIDATES: list[Any] = [
    "float32-head", "math-attention", "precision", "deterministic", "fixed-batch",
    divtrace.remedies.Float64([f"model.layers.{i}" for i in range(32)] + ["lm_head"])]


def remedies(model: nn.Module, prompts: list[torch.Tensor], new: int, blocks: list[str]
             ) -> tuple[list[str], dict[str, Any]]:
    """The rollout against its right-padded trainer, then its remedies: each verified per
    token (the log-probabilities under it) and costed over both runs' own passes."""
    settle()
    result = divtrace.compare_rollout(model, prompts, max_new_tokens=new,
                                      trainer="padded:right", eos_token_id=None,
                                      pad_token_id=0, modules=blocks, progress=False)
    found, seconds = timed(lambda: result.remedies(candidates=CANDIDATES, repeats=2,
                                                   progress=False))
    table = found.table
    report = {"seconds": seconds, "summary": found.summary(),
              "table": table.drop(columns=["verdict"]).to_dict(orient="records"),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    shown = table[["remedy", "identical", "output_rel_l2", "cost", "a_cost", "note"]]
    lines = ["\n== remedies of the rollout vs its right-padded trainer ==",
             divtrace.token_figures(result).summary(), found.summary(),
             shown.to_string(index=False, max_colwidth=90),
             f"{seconds:.0f} s for the remedies; peak {report['peak_gib']:.1f} GiB"]
    return lines, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--part", choices=("cases", "remedies"), default="cases",
                        help="the comparisons (writing the files anew), or the remedies "
                             "(added to them)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = llama_8b()
    blocks = [f"model.layers.{i}" for i in range(32)] + ["model.norm", "lm_head"]
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(64, 512, args.prompts).round().int().tolist()
    prompts = [torch.randint(3, 128256, (n,), generator=generator).cuda() for n in lengths]
    bare_rollout(model, prompts[:2], 2)  # warm-up
    text, data = args.out / "layouts_summary.txt", args.out / "layouts.json"
    if args.part == "cases":
        lines = [f"8B-shaped Llama (hidden 4096, 32 layers, SDPA), bfloat16, random init; "
                 f"{args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, "
                 f"{args.tokens} new tokens (greedy); torch {torch.__version__}, "
                 f"{torch.cuda.get_device_name()}"]
        found, cases_report = cases(model, prompts, lengths, args.tokens, blocks, args.out)
        lines += found
        report: dict[str, Any] = {"prompts": lengths, "new_tokens": args.tokens,
                                  "cases": cases_report}
    else:
        lines = text.read_text().split("\n== remedies")[0].rstrip("\n").splitlines()
        report = json.loads(data.read_text())
        found, report["remedies"] = remedies(model, prompts, args.tokens, blocks)
        lines += found
    text.write_text("\n".join(lines) + "\n")
    data.write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
