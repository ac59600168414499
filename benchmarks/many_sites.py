"""Models with hundreds of small sites: ``compare()`` against the bare forward passes.

mobilenet_v3_small, efficientnet_b0 and resnet18 (random weights), batch 16 of 3×64×64,
per sample with samples [0, 1] (the split run's two passes, then the batched pass; with
``--chunk 2`` one split pass of both), in one process, interleaved, medians. With
``--old DIR`` an older checkout of divtrace is timed beside this one (imported as
``divtrace_old``). ``--floor`` also times the same passes with the least a recorder made
of module hooks must do: a forward hook on every module that does nothing with the
output ("hooks"), and one that copies the compared rows ("hooks + copies": the split passes'
rows, the batched pass's rows 0 and 1). ``--selections`` also times ``compare()``
observing fewer modules, and only the output (``modules=[]``: the cost of a call without
sites). With both, "least with every module hooked" is that call's ratio plus the hooks'
share: no ``compare()`` that hooks every module can cost less. ``--statistics`` also
times, inside the timed ``compare()`` calls, the calls that compute the sites' fields
(the queued sites' blocks and the sites measured alone; on CUDA the host's side of them,
their launches); added to the least above, it is the least a call that hooks every
module and computes the fields as they are computed now can cost. ``--traced`` also
times the passes traced with ``torch.fx``, copying every leaf call's compared rows (no
module hook; ``floors.py``), and the same with copies in the split passes only (the
batched pass's share of the copies is the difference); with ``--selections`` and
``--statistics``, "least with any recorder" is those passes plus the output-only call's
own share (less its statistics) plus the statistics: what a call that copies the rows
and computes the fields as they are computed now costs at least, whatever observes the
sites. "µs per site" is ``compare()``'s time beyond the bare passes over its sites. On
CUDA it also prints the extra peak memory over the bare passes' peak, per byte of the
stored rows.

    python benchmarks/many_sites.py [--device cuda] [--chunk 2] [--repeats 7] [--old DIR]
        [--floor] [--selections] [--statistics] [--traced] [--size 64] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from floors import copy_rows, hooked, observe, passes, traced
from overhead import calls_timed, cuda_peak, timed, use_seed_settings
from versions import load_old

import divtrace

MODELS = ("mobilenet_v3_small", "efficientnet_b0", "resnet18")
#: The modules ``--selections`` observes besides the model's output.
SELECTED = (torch.nn.Conv2d, torch.nn.Linear)


def main() -> int:
    import torchvision.models

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1, choices=[1, 2])
    parser.add_argument("--old", type=Path, help="an older checkout to time beside")
    parser.add_argument("--floor", action="store_true",
                        help="also time bare passes with hooks that do nothing or copy rows")
    parser.add_argument("--selections", action="store_true",
                        help="also time compare() observing fewer modules")
    parser.add_argument("--statistics", action="store_true",
                        help="also time the fields' computation inside compare()")
    parser.add_argument("--traced", action="store_true",
                        help="also time the passes traced with torch.fx, copying rows")
    parser.add_argument("--size", type=int, default=64, help="the input's height and width")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    use_seed_settings(device)
    old = load_old(args.old) if args.old else None
    rows: list[dict[str, Any]] = []
    for name in MODELS:
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)().eval().to(device)
        x = torch.rand(16, 3, args.size, args.size, device=device)

        bare = passes(model, x, args.chunk)

        def run(package: Any, model: torch.nn.Module = model, x: torch.Tensor = x,
                **options: Any) -> Callable[[], object]:
            return lambda: package.compare(model, x, samples=[0, 1],
                                           a=divtrace.Run(chunk=args.chunk),
                                           progress=False, **options)

        ways: dict[str, Callable[[], object]] = {"bare": bare, "new": run(divtrace)}
        if old is not None:
            ways["old"] = run(old)
        if args.floor:
            ways["hooks"] = hooked(model, bare, copy=False)
            ways["hooks + copies"] = hooked(model, bare, copy=True)
        if args.traced:
            copying = traced(model, copy_rows)[0]
            ways["traced + copies"] = passes(copying, x, args.chunk)
            ways["traced, split copies"] = passes(copying, x, args.chunk,
                                                  batched=traced(model, observe)[0])
        if args.selections:
            ways["conv + linear"] = run(divtrace, modules=list(SELECTED))
            ways["output only"] = run(divtrace, modules=[])
        for fn in ways.values():
            fn()
        times: dict[str, list[float]] = {way: [] for way in ways}
        stats_time: dict[str, list[float]] = {"new": [], "output only": []}
        for _ in range(args.repeats):
            for way, fn in ways.items():
                spent: list[float] = []
                watched = fields_calls() if args.statistics and way in stats_time else ()
                with calls_timed(watched, collector(spent)):
                    times[way].append(timed(fn, device))
                if watched:
                    stats_time[way].append(sum(spent))
        median = {way: statistics.median(t) for way, t in times.items()}
        sites = len(divtrace.compare(model, x, samples=[0, 1], progress=False).table)
        row: dict[str, Any] = {"model": name, "sites": sites, "bare_s": median["bare"],
                               "ratio": median["new"] / median["bare"],
                               "per_site_us": (median["new"] - median["bare"]) / sites * 1e6}
        if old is not None:
            row["ratio_old"] = median["old"] / median["bare"]
        if args.floor:
            row["ratio_hooks"] = median["hooks"] / median["bare"]
            row["ratio_hooks_copies"] = median["hooks + copies"] / median["bare"]
        selected_text = ""
        if args.selections:
            row["sites_selected"] = len(divtrace.compare(
                model, x, samples=[0, 1], progress=False, modules=list(SELECTED)).table)
            row["ratio_selected"] = median["conv + linear"] / median["bare"]
            row["ratio_output"] = median["output only"] / median["bare"]
            selected_text = (f"; conv + linear ({row['sites_selected']} sites) "
                             f"{row['ratio_selected']:.2f}×, output only "
                             f"{row['ratio_output']:.2f}×")
            if args.floor:  # a call that observes every module costs at least both
                row["ratio_least"] = row["ratio_output"] + row["ratio_hooks"] - 1
                selected_text += f"; least with every module hooked {row['ratio_least']:.2f}×"
        if args.statistics:
            row["ratio_statistics"] = statistics.median(stats_time["new"]) / median["bare"]
            selected_text += f"; statistics {row['ratio_statistics']:.2f}×"
            if "ratio_least" in row:
                row["ratio_least_statistics"] = row["ratio_least"] + row["ratio_statistics"]
                selected_text += (f"; least with these statistics "
                                  f"{row['ratio_least_statistics']:.2f}×")
        if args.traced:
            row["ratio_traced_copies"] = median["traced + copies"] / median["bare"]
            row["ratio_traced_split_copies"] = median["traced, split copies"] / median["bare"]
            selected_text += (f"; traced + copies {row['ratio_traced_copies']:.2f}× (in the "
                              f"split passes only {row['ratio_traced_split_copies']:.2f}×)")
            if args.selections and args.statistics:  # the output-only call's own share,
                # less the statistics of its one site (counted in the statistics)
                own = (median["output only"] - statistics.median(stats_time["output only"])
                       ) / median["bare"] - 1
                row["ratio_least_any"] = (row["ratio_traced_copies"] + own
                                          + row["ratio_statistics"])
                selected_text += (f"; least with any recorder "
                                  f"{row['ratio_least_any']:.2f}×")
        memory_text = ""
        if device.type == "cuda":  # the extra peak over the bare passes, per stored byte
            bare_peak, _ = cuda_peak(bare, device)
            for way in ("new", "old") if old is not None else ("new",):
                peak, result = cuda_peak(ways[way], device)
                stored = result.meta.stored_bytes  # type: ignore[attr-defined]
                row[f"extra_over_stored_{way}"] = (peak - bare_peak) / stored
            memory_text = f"; extra peak / stored {row['extra_over_stored_new']:.2f}" + (
                f" (older {row['extra_over_stored_old']:.2f})" if old is not None else "")
        rows.append(row)
        old_text = f", older {row['ratio_old']:.2f}×" if old is not None else ""
        floor_text = (f"; hooks alone {row['ratio_hooks']:.2f}×, hooks + copies "
                      f"{row['ratio_hooks_copies']:.2f}×" if args.floor else "")
        print(f"{name}: {sites} sites, bare {median['bare'] * 1e3:.1f} ms, compare "
              f"{row['ratio']:.2f}× ({row['per_site_us']:.0f} µs per site)"
              f"{old_text}{floor_text}{selected_text}{memory_text}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "device": str(device),
                                         "threads": args.threads, "chunk": args.chunk,
                                         "results": rows}, indent=1))
    return 0


def collector(spent: list[float]) -> Callable[[str, float], None]:
    """A record for ``calls_timed`` that adds each call's seconds to ``spent``."""

    def record(_label: str, seconds: float) -> None:
        spent.append(seconds)

    return record


def fields_calls() -> tuple[tuple[Any, str, str], ...]:
    """The calls that compute sites' fields: the queues' blocks, the sites measured alone."""
    from divtrace.measure.meter import Meter
    from divtrace.measure.queue import FusedQueue, StatsQueue

    return ((StatsQueue, "_measure", "fields"), (FusedQueue, "_measure", "fields"),
            (Meter, "stats", "fields"))


if __name__ == "__main__":
    raise SystemExit(main())
