"""torch.compile module by module on a GPU (``compare_compiled``).

1. A softmax over 14336 columns in float32, compiled statically, at batch 2–512, rows 0-3
   against each alone: the first site that parts, the verdict, and the same with
   ``dynamic=True``; eager compared alike; the compiled kernels' rows by hand. At batch
   512, four rows: the Triton kernels each run launched at the region (``"kernels"``),
   the remedies for compiled code, and each remedy the table calls identical applied by
   hand in a plain loop (compiled so, the batch, then each row alone).
2. The 8B-shaped Llama (random init, bfloat16, SDPA, each decoder layer its own compiled
   region) on ``--prompts`` prompts of 64–512 tokens: compiled batched against compiled
   split, then eager against compiled: the first parting layer, the verdict, the wall
   time (the first call in a process that has compiled nothing pays every compilation;
   the second, whose compilations inductor's cache serves; the seconds dynamo says it
   spent) against the bare compiled passes (the same regions compiled by hand, once with
   their compilations, inductor's cache serving them, then warm), and the peak memory.

Each part updates its own entry of ``compiled.json`` in --out; ``compiled_summary.txt``
is every part's text, written again from it.

    python benchmarks/gpu/compiled_gpu.py --out docs/results/h200 --part softmax
    python benchmarks/gpu/compiled_gpu.py --out docs/results/h200 --part llama --prompts 16
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from benchmarks.common import cuda_timed as timed
from benchmarks.common import llama_8b
from divtrace.plan.prompts import pad


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1)


class Blocks(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def first(result: divtrace.Comparison) -> str | None:
    found = result.first_divergence
    return None if found is None else str(found["site"])


def softmax_case(lines: list[str]) -> dict[str, Any]:
    model = Blocks(nn.Identity(), Softmax()).eval().cuda()
    x = torch.randn(512, 14336, generator=torch.Generator().manual_seed(0)).mul(4).cuda()
    found: dict[str, Any] = {}
    lines.append("== softmax over 14336 columns, float32, rows 0-3 at batch B against each "
                 "alone ==")
    for batch in (2, 8, 64, 512):
        part, rows = x[:batch], list(range(min(batch, 4)))
        torch._dynamo.reset_code(Softmax.forward.__code__)  # compiled afresh, here
        static = torch.compile(Softmax(), dynamic=False)
        with torch.no_grad():
            whole = static(part)
            apart = [i for i in rows if not torch.equal(whole[i:i + 1], static(part[i:i + 1]))]
        eager = divtrace.compare(model, part, samples=rows, progress=False)
        compiled = divtrace.compare_compiled(model, part, samples=rows, progress=False)
        dynamic = divtrace.compare_compiled(model, part, samples=rows, dynamic=True,
                                            progress=False)
        found[str(batch)] = {"by_hand_apart": apart, "eager": eager.verdict,
                             "static": compiled.verdict, "static_first": first(compiled),
                             "static_apart": sorted(set(compiled.per_sample.loc[
                                 compiled.per_sample["mismatch"] > 0, "sample"].tolist())),
                             "dynamic": dynamic.verdict}
        lines.append(f"B={batch}: by hand the static kernels give rows {apart} other bits "
                     f"than alone; eager {eager.verdict}; compiled statically "
                     f"{compiled.verdict} (first at {first(compiled)}, rows "
                     f"{found[str(batch)]['static_apart']} apart); dynamic=True "
                     f"{dynamic.verdict}")
        print(lines[-1], flush=True)
    lines.append(compiled.summary())
    found["remedies"] = remedies_case(lines, model, x)
    return found


def by_hand(kind: str, settings: dict[str, Any], x: torch.Tensor, rows: list[int]
            ) -> tuple[bool, list[str]]:
    """A remedy applied by hand in a plain loop: the softmax compiled as it says (or left
    eager), the whole batch, then each row alone; whether every row is bit-identical, and
    the kernels a row alone launched (the setting seen to take effect)."""
    from torch._inductor import config
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset_code(Softmax.forward.__code__)  # compiled afresh, here
    with config.patch(settings), torch.no_grad():
        run = Softmax() if kind == "eager-region" else torch.compile(
            Softmax(), dynamic=kind == "dynamic")
        whole = run(x)
        same = all(torch.equal(whole[i:i + 1], run(x[i:i + 1])) for i in rows)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(x[:1])
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return same, list(dict.fromkeys(names))


def remedies_case(lines: list[str], model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    rows = [0, 1, 2, 3]
    found: dict[str, Any] = {"kernels": {}, "rows": []}
    for batch in (64, 512):
        result = divtrace.compare_compiled(model, x[:batch], samples=rows,
                                           explain=["kernels"], progress=False)
        table = result.table.set_index("site")
        kernels = {w: str(table.loc["layers.1", f"kernels_{w}"]) for w in ("a", "b")}
        found["kernels"][str(batch)] = kernels
        lines += [f"\n== B={batch}, rows 0-3: the kernels at 'layers.1' ==",
                  f"run a (compiled split) launched: {kernels['a']}",
                  f"run b (compiled batched) launched: {kernels['b']}",
                  f"verdict {result.verdict}"]
        lines += [line for line in result.summary().splitlines() if "launched" in line]
    found["verdict"] = result.verdict
    lines.append("\n== B=512, rows 0-3: remedies ==")
    if result.verdict == "identical":
        return found
    remedies = result.remedies(candidates=["inductor", "dynamic", "eager-region"],
                               repeats=3, progress=False)
    lines.append(remedies.table[["remedy", "identical", "output_rel_l2", "cost",
                                 "note"]].to_string())
    for row, remedy in zip(remedies.table.itertuples(), remedies.candidates, strict=True):
        hand, alone = by_hand(row.kind, getattr(remedy, "settings", {}), x, rows)
        found["rows"].append({"remedy": row.remedy, "identical": row.identical,
                              "cost": row.cost, "by_hand_identical": hand,
                              "alone_kernels": alone})
        lines.append(f"{row.remedy}: the table says {'' if row.identical else 'not '}"
                     f"identical; by hand in a plain loop, rows 0-3 are "
                     f"{'' if hand else 'not '}bit-identical; a row alone launched "
                     f"{'; '.join(alone)}")
    print("\n".join(lines[-8:]), flush=True)
    return found


def bare(model: nn.Module, prompts: divtrace.Prompts) -> tuple[float, float]:
    """The bare passes of both runs on the regions compiled by hand (each decoder layer's
    class forward compiled once, static): (first passes with their compilations, then
    the same passes again)."""
    mine = copy.deepcopy(model)
    mine.config.use_cache = False
    compiled = torch.compile(type(mine.model.layers[0]).forward, dynamic=False)
    for layer in mine.model.layers:
        layer.forward = functools.partial(compiled, layer)

    def passes() -> None:  # one compilation per shape: 17 are more than dynamo's default
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
            for start, stop in [(0, len(prompts)), *((i, i + 1) for i in range(len(prompts)))
                                ]:
                inputs, _ = pad(prompts, start, stop)
                mine(**inputs)
    _, cold = timed(passes)
    _, warm = timed(passes)
    return cold, warm


def llama_case(lines: list[str], count: int) -> dict[str, Any]:
    model = llama_8b()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(64, 512, count).round().int().tolist()
    prompts = divtrace.Prompts([torch.randint(3, 128256, (n,), generator=generator).cuda()
                                for n in lengths])
    blocks = [f"model.layers.{i}" for i in range(32)] + ["model.norm", "lm_head"]
    found: dict[str, Any] = {"prompts": lengths}
    lines.append(f"\n== 8B-shaped Llama, bfloat16, {count} prompts of {min(lengths)}-"
                 f"{max(lengths)} tokens, each decoder layer a compiled region ==")
    # the comparison first, in a process that has compiled nothing: its first call pays
    # every compilation; it clears the dynamo caches it filled, so the bare passes after it
    # compile again (inductor's cache serving them, as it serves the comparison's second
    # call)
    for against, call in (("split", "first"), ("split", "second"), ("eager", "first")):
        if call == "second":
            cold, warm = bare(model, prompts)
            found |= {"bare_cold_seconds": cold, "bare_seconds": warm}
            lines.append(f"bare compiled passes (the batch, then each prompt alone): "
                         f"{cold:.1f} s with their compilations (inductor's cache serving "
                         f"them), {warm:.2f} s warm")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        result, seconds = timed(lambda against=against: divtrace.compare_compiled(
            model, prompts, against=against, modules=blocks, progress=False))
        note = result.meta.notes["regions"]
        key = against if call == "first" else f"{against}_{call}"
        found[key] = {"verdict": result.verdict, "first_site": first(result),
                      "seconds": seconds, "graphs": note.get("graphs"),
                      "compile_seconds": note.get("compile_seconds"),
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "summary": result.summary()}
        lines += [f"\n-- against={against!r}, {call} call --", result.summary(),
                  f"{seconds:.1f} s, of which dynamo compiling {note.get('compile_seconds')} s "
                  f"({note.get('graphs')} graphs); peak {found[key]['peak_gib']:.1f} GiB"]
        print(lines[-1], flush=True)
        del result
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--part", choices=("softmax", "llama"), required=True)
    parser.add_argument("--prompts", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}"]
    found = softmax_case(lines) if args.part == "softmax" else llama_case(lines, args.prompts)
    path = args.out / "compiled.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report = {part: report[part] for part in ("softmax", "llama") if "lines" in report.get(
        part, {})}  # a part written before its text was kept is written again
    report[args.part] = found | {"lines": lines}
    path.write_text(json.dumps(report, indent=1, default=str))
    (args.out / "compiled_summary.txt").write_text("\n\n".join(
        "\n".join(report[part]["lines"]) for part in ("softmax", "llama") if part in report
    ) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
