"""Language-model scale: op sites and generation, against the bare passes they must run.

``ops``: for each case, in one process, interleaved, medians: ``bare`` (run a's passes
and the batched pass, no hook), ``bare + mode`` (the same under a TorchDispatchMode that
only calls each op: the floor of seeing every op from Python), ``compare``, ``compare
ops=True`` and ``compare ops='only'``; ratios to ``bare``, and on CUDA the extra peak
over the stored rows. ``generation``: ``compare_generate()`` against the bare
``generate()`` calls it must make (the padded batch, each prompt alone) for a
random-init Llama-like model, and ``at(step)`` against the ``generate()`` calls of
``step + 1`` tokens it makes. ``prompts``: ``compare(model, Prompts(...))`` of a
Llama-shaped model (on CUDA the 8B shape, built on the GPU with random weights) with every
prompt compared, and with two, against the bare passes it must make (each prompt alone,
the padded batch) and against the floor: those plus the independence test's batched
passes and, where the precision test ran, the bare passes of a float64 copy; the
first call of each (cold) besides the medians (warm), and on CUDA the extra peak over the
stored rows.

    python -m benchmarks lm [ops] [generation] [prompts] [--device cuda] [--repeats 5]
        [--old CHECKOUT] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import divtrace
from benchmarks.common import (
    bare_passes,
    environment,
    llama,
    load_old,
    peak,
    timed,
    use_seed_settings,
)
from divtrace.plan.prompts import pad

#: Per device: the op-site cases (the transformer per sample over the whole batch, as a
#: per-prompt check of a language model is).
OP_CASES: dict[str, dict[str, dict[str, Any]]] = {
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
#: Per device: model size (or the prompts' Llama shape), prompts, new tokens, the step
#: ``at()`` looks at.
GENERATION: dict[str, dict[str, Any]] = {
    "cpu": {"hidden": 256, "layers": 4, "prompts": 8, "longest": 48, "tokens": 16, "at": 4},
    "cuda": {"shape": "cuda", "prompts": 8, "shortest": 64, "longest": 512, "tokens": 16,
             "at": 4},
}


#: Per device: the Llama shape of ``prompts``, its dtype, and the prompts' lengths.
PROMPTS: dict[str, dict[str, Any]] = {
    "cpu": {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "mlp": 704,
            "vocab": 8000, "dtype": "float32", "prompts": 8, "shortest": 17, "longest": 90},
    "cuda": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "mlp": 14336,
             "vocab": 128256, "dtype": "bfloat16", "prompts": 8, "shortest": 64,
             "longest": 512},
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


def _op_model(case: dict[str, Any], device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if case["model"] == "vgg11_features":
        from torchvision.models import vgg11

        model: nn.Module = vgg11().features
        x = torch.rand(case["batch"], 3, case["size"], case["size"])
    else:  # a small transformer: four pre-norm blocks of width 256
        model = nn.Sequential(*[Block() for _ in range(4)])
        x = torch.randn(case["batch"], case["seq"], 256)
    return model.eval().to(device), x.to(device)


def ops(name: str, case: dict[str, Any], device: torch.device, repeats: int
        ) -> dict[str, Any]:
    model, x = _op_model(case, device)

    def run(**options: Any) -> Any:
        return divtrace.compare(model, x, a=divtrace.Run(chunk=case["chunk"]),
                                samples=case["samples"], progress=False, **options)

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
        "case": name, "device": str(device), "repeats": repeats, "seconds": median,
        "ratio": {way: t / median["bare"] for way, t in median.items()},
        "module_sites": int((table["op"] == "").sum()),
        "op_sites": int((table["op"] != "").sum()), "stored_bytes": result.meta.stored_bytes}
    if device.type == "cuda":
        bare_peak, _ = peak(lambda: bare_passes(model, x, case), device)
        used, _ = peak(lambda: run(ops=True), device)
        row["extra_over_stored"] = (used - bare_peak) / max(result.meta.stored_bytes, 1)
    return row


def generation(device: torch.device, repeats: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    case = GENERATION[device.type]
    torch.manual_seed(0)
    if "shape" in case:  # the prompts' Llama shape (on CUDA the 8B one)
        model: nn.Module = _llama(PROMPTS[case["shape"]], device)
        vocab = PROMPTS[case["shape"]]["vocab"]
    else:
        config = LlamaConfig(hidden_size=case["hidden"],
                             intermediate_size=case["hidden"] * 11 // 4,
                             num_hidden_layers=case["layers"], num_attention_heads=8,
                             num_key_value_heads=4, vocab_size=8000)
        model, vocab = LlamaForCausalLM(config).eval().to(device), 8000
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(case.get("shortest", 4), case["longest"],
                             case["prompts"]).round().int().tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=generator).to(device) for n in lengths]
    found = divtrace.compare_generate(model, prompts, max_new_tokens=case["tokens"],
                                      eos_token_id=None, progress=False)

    def bare(tokens: int) -> None:
        size = len(found.prompts)
        for lo, hi in [(0, size), *[(i, i + 1) for i in range(size)]]:
            with torch.no_grad():
                model.generate(**pad(found.prompts, lo, hi)[0], max_new_tokens=tokens,
                               do_sample=False, **found.settings)

    ways = {
        "bare generate()": lambda: bare(case["tokens"]),
        "compare_generate": lambda: divtrace.compare_generate(
            model, prompts, max_new_tokens=case["tokens"], eos_token_id=None, progress=False),
        "bare generate() to the step": lambda: bare(case["at"] + 1),
        f"at({case['at']})": lambda: found.at(case["at"]),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    for fn in ways.values():
        fn()  # warm-up
    for _ in range(repeats):
        for way, fn in ways.items():
            times[way].append(timed(fn, device))
    median = {way: statistics.median(t) for way, t in times.items()}
    ratios = {"compare_generate": median["compare_generate"] / median["bare generate()"],
              f"at({case['at']})": median[f"at({case['at']})"]
              / median["bare generate() to the step"]}
    return {"case": case, "seconds": median, "ratios": ratios}


def _llama(case: dict[str, Any], device: torch.device) -> nn.Module:
    """A Llama of ``case``'s shape with random weights, made on ``device`` in its dtype."""
    return llama(case, device, getattr(torch, case["dtype"]))  # made in it, never float32


def given_prompts(case: dict[str, Any], device: torch.device) -> divtrace.Prompts:
    """``case``'s prompts: random token ids, lengths evenly from its shortest to its
    longest, left-padded."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(case["shortest"], case["longest"], case["prompts"]).round()
    return divtrace.Prompts([torch.randint(3, case["vocab"], (int(n),), generator=generator)
                             .to(device) for n in lengths.tolist()], padding_side="left")


def prompt_passes(model: nn.Module, given: divtrace.Prompts, split: bool = True,
                  batched: bool = True) -> None:
    """The bare passes of ``given`` through ``model``: each prompt alone (``split``),
    then all of them padded to one batch (``batched``)."""
    count = len(given.prompts)
    with torch.no_grad():
        for i in range(count if split else 0):
            model(**pad(given, i, i + 1)[0])
        if batched:
            model(**pad(given, 0, count)[0])


def prompts(device: torch.device, repeats: int, old: Any = None) -> dict[str, Any]:
    case = PROMPTS[device.type]
    built: dict[str, nn.Module] = {}
    made = timed(lambda: built.setdefault("model", _llama(case, device)), device)
    model = built["model"]
    given = given_prompts(case, device)

    def bare(on: nn.Module | None = None) -> None:
        prompt_passes(model if on is None else on, given)

    def batched() -> None:
        prompt_passes(model, given, split=False)

    ways = {"bare passes": bare, "bare batched pass": batched,
            "compare, every prompt": lambda: divtrace.compare(model, given, progress=False),
            "compare, samples=[0, 1]": lambda: divtrace.compare(model, given, samples=[0, 1],
                                                                 progress=False)}
    if old is not None:  # an older checkout's call, in the same rotation
        theirs = old.Prompts(list(given.prompts), padding_side="left")
        ways["old: compare, every prompt"] = lambda: old.compare(model, theirs,
                                                                 progress=False)
    cold = {way: timed(fn, device) for way, fn in ways.items()}  # the first call of each
    notes = divtrace.compare(model, given, progress=False).meta.notes
    if notes.get("precision", {}).get("ran"):  # the precision test's passes, without it

        import copy

        ways["float64 bare passes"] = lambda: bare(copy.deepcopy(model).double())
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, fn in ways.items():
            times[way].append(timed(fn, device))
    median = {way: statistics.median(t) for way, t in times.items()}
    result = divtrace.compare(model, given, progress=False)
    tested = int(result.meta.notes.get("independence", {}).get("passes", 0))
    floor = (median["bare passes"] + tested * median["bare batched pass"]
             + median.get("float64 bare passes", 0.0))
    row: dict[str, Any] = {
        "case": case, "built_s": made, "sites": len(result.table), "test_passes": tested,
        "cold": cold, "seconds": median, "floor_s": floor,
        "stored_bytes": result.meta.stored_bytes,
        "ratio": {"every prompt / bare passes": median["compare, every prompt"]
                  / median["bare passes"],
                  "every prompt / the floor": median["compare, every prompt"] / floor,
                  "cold / warm (every prompt)": cold["compare, every prompt"]
                  / median["compare, every prompt"]}}
    if old is not None:
        row["ratio"]["this / old (every prompt)"] = (median["compare, every prompt"]
                                                     / median["old: compare, every prompt"])
    if device.type == "cuda":
        bare_peak, _ = peak(bare, device)
        used, _ = peak(lambda: divtrace.compare(model, given, progress=False), device)
        row["extra_over_stored"] = (used - bare_peak) / max(result.meta.stored_bytes, 1)
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="{ops,generation,prompts}",
                        help="what to measure (default: all three)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--old", type=Path, help="prompts: also time an older checkout")
    args = parser.parse_args(argv)
    parts = args.parts or ["ops", "generation", "prompts"]
    unknown = sorted(set(parts) - {"ops", "generation", "prompts"})
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from ops, generation, prompts")
    device = torch.device(args.device)
    use_seed_settings(device)
    env = environment(device)
    print(f"environment: {env}")
    found: dict[str, Any] = {"environment": env}
    if "ops" in parts:
        rows = [ops(name, case, device, args.repeats)
                for name, case in OP_CASES[device.type].items()]
        ways = list(rows[0]["ratio"])
        print("| case | sites (module + op) | bare (s) | " + " | ".join(ways[1:]) + " |")
        print("|---|---|---|" + "---|" * (len(ways) - 1))
        for r in rows:
            ratios = " | ".join(f"{r['ratio'][w]:.2f}×" for w in ways[1:])
            print(f"| {r['case']} | {r['module_sites']} + {r['op_sites']} | "
                  f"{r['seconds']['bare']:.4f} | {ratios} |")
            if "extra_over_stored" in r:
                print(f"  ops=True extra peak / stored rows: {r['extra_over_stored']:.3f}")
        found["ops"] = rows
    if "generation" in parts:
        made = found["generation"] = generation(device, args.repeats)
        print(f"generation case: {made['case']}")
        for way, seconds in made["seconds"].items():
            print(f"  {way}: {seconds:.3f} s")
        for way, ratio in made["ratios"].items():
            print(f"  {way} / its bare generate() calls: {ratio:.2f}×")
    if "prompts" in parts:
        made = found["prompts"] = prompts(device, args.repeats,
                                          load_old(args.old) if args.old else None)
        print(f"prompts case: {made['case']}; {made['sites']} sites; model built in "
              f"{made['built_s']:.2f} s; the independence test ran {made['test_passes']} "
              f"batched passes")
        for way, seconds in made["seconds"].items():
            print(f"  {way}: {seconds:.3f} s (first call {made['cold'][way]:.3f} s)")
        for way, ratio in made["ratio"].items():
            print(f"  {way}: {ratio:.2f}×")
        if "extra_over_stored" in made:
            print(f"  extra peak / stored rows: {made['extra_over_stored']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return 0
