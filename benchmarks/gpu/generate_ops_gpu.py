"""At the step where a prompt's tokens part in bf16, which op inside the model parts first?

The setting of ``generate_gpu.py`` (random-init Llama-like model, hidden 2048, 8 layers,
32 prompts of 8 to 200 tokens, left padding) in bf16, eager and SDPA attention; for the
prompts that part earliest, ``Generation.at(step, samples=[prompt])`` with op sites:
the first differing site of that prompt and the op-level sources of the step.

    python benchmarks/gpu/generate_ops_gpu.py --out docs/results/h200
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generate_gpu import SEED, build

import divtrace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--prompts-at", type=int, default=4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(8, 200, 32).round().int().tolist()
    prompts = [torch.randint(3, 32000, (n,), generator=generator).cuda() for n in lengths]
    found_all: dict = {}
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}", ""]
    with SEED.flags():
        for attention in ("eager", "sdpa"):
            model = build(torch.bfloat16, attention)
            found = divtrace.compare_generate(model, prompts, max_new_tokens=args.tokens,
                                              eos_token_id=None, progress=False, ops=True)
            parted = found.per_prompt.dropna(subset=["first_token_split"])
            parted = parted.sort_values("first_token_split").head(args.prompts_at)
            cases = []
            for row in parted.itertuples():
                prompt, step = int(row.prompt), int(row.first_token_split)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", divtrace.DivtraceWarning)
                    result = found.at(step, samples=[prompt])
                samples = result.per_sample
                hits = samples[samples["mismatch"] > 0]
                table = result.table
                sources = table[(table["role"] == "source") & (table["op"] != "")]
                first = hits.iloc[0]["site"] if len(hits) else None
                cases.append({"prompt": prompt, "step": step, "margin": row.margin_at_split,
                              "first_site": first,
                              "op_sources": [(r.site, r.op, float(r.rel_l2))
                                             for r in sources.head(6).itertuples()],
                              "verdict": result.verdict})
                lines.append(f"bf16 {attention}, prompt {prompt} parts at step {step} "
                             f"(margin {row.margin_at_split:.3g}): first differing site "
                             f"{first}; op-level sources: "
                             f"{', '.join(s for s, _, _ in cases[-1]['op_sources']) or 'none'}")
                table.to_csv(args.out / f"generate_ops_bf16_{attention}_p{prompt}_s{step}.csv",
                             index=False)
            found_all[attention] = cases
            del model, found
            torch.cuda.empty_cache()
    (args.out / "generate_ops_found.json").write_text(json.dumps(found_all, indent=1,
                                                                  default=str))
    (args.out / "generate_ops_summary.txt").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
