"""``compare_generate()`` against the bare ``generate()`` calls it must make (the padded
batch, and each prompt alone), in one process, medians of several repeats.

A random-init Llama-like model built from a config; prompts of different lengths; greedy
decoding without end-of-sequence. ``at(step)`` is timed too, against the bare
``generate()`` calls of ``step + 1`` tokens it makes.

    python benchmarks/generation.py [--device cuda] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import timed

import divtrace
from divtrace.plan.prompts import pad

#: Per device: model size, prompts, new tokens, the step ``at()`` looks at.
CASES: dict[str, dict[str, Any]] = {
    "cpu": {"hidden": 256, "layers": 4, "prompts": 8, "longest": 48, "tokens": 16, "at": 4},
    "cuda": {"hidden": 1024, "layers": 8, "prompts": 16, "longest": 128, "tokens": 32,
             "at": 8},
}


def main() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    case = CASES[device.type]
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=case["hidden"], intermediate_size=case["hidden"] * 11 // 4,
                         num_hidden_layers=case["layers"], num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=8000)
    model = LlamaForCausalLM(config).eval().to(device)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(4, case["longest"], case["prompts"]).round().int().tolist()
    prompts = [torch.randint(3, 8000, (n,), generator=generator).to(device) for n in lengths]
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
    for _ in range(args.repeats):
        for way, fn in ways.items():
            times[way].append(timed(fn, device))
    median = {way: statistics.median(t) for way, t in times.items()}
    ratios = {"compare_generate": median["compare_generate"] / median["bare generate()"],
              f"at({case['at']})": median[f"at({case['at']})"]
              / median["bare generate() to the step"]}
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(f"environment: {env}; case: {case}")
    for way, seconds in median.items():
        print(f"{way}: {seconds:.3f} s")
    for way, ratio in ratios.items():
        print(f"{way} / its bare generate() calls: {ratio:.2f}×")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "case": case, "seconds": median,
                                         "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
