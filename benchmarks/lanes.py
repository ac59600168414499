"""The graphed split run's lanes and copies, swept: compare() per sample with 1, 2, 4 and 8
lanes (passes side by side in one CUDA graph), each site's copy as ``index_copy_`` (what
divtrace does) or as a Triton kernel reading each row's slot once (what it did before);
ratios to the bare passes, and the capture's parts: the Python of the captured passes,
``capture_end`` (the graph's instantiation), and the whole of ``capture_s`` (with the
warm-up pass and the check).

    python benchmarks/lanes.py [--cases ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graphs import CASES, build
from overhead import bare_passes, timed, use_seed_settings

import divtrace
import divtrace.record.cudagraph as cudagraph
import divtrace.record.graphs as graphs
import divtrace.record.rows as rows


@triton.jit
def _copy_rows(src_ptr, dst_ptr, slots_ptr, n_cols, src_stride, dst_stride,
               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    slot = tl.load(slots_ptr + row).to(tl.int64)
    words = tl.load(src_ptr + row * src_stride + cols, mask=inside)
    tl.store(dst_ptr + slot * dst_stride + cols, words, mask=inside)


def triton_copy(target: torch.Tensor, slots: torch.Tensor, source: torch.Tensor) -> None:
    """The copy as one Triton kernel (rows as 4-byte words where they divide, else
    ``index_copy_``)."""
    n = len(source)
    if (not source.is_contiguous() or not target.is_contiguous()
            or (source[0].numel() * source.element_size()) % 4):
        target.index_copy_(0, slots, source)
        return
    src = source.reshape(n, -1).view(torch.int32)
    dst = target.view(len(target), -1).view(torch.int32)
    with torch.cuda.device(src.device):
        _copy_rows[(n, triton.cdiv(src.shape[1], 4096))](
            src, dst, slots, src.shape[1], src.stride(0), dst.stride(0), BLOCK=4096)


PARTS: dict[str, float] = {}


def _timed_capture(original: Callable[..., int]) -> Callable[..., int]:
    def capture(self: Any, run: Callable[[], None]) -> int:
        end = self.graph.capture_end

        def timed_end() -> None:
            began = time.perf_counter()
            end()
            PARTS["capture_end"] = time.perf_counter() - began

        def timed_run() -> None:
            began = time.perf_counter()
            run()
            PARTS["python"] = time.perf_counter() - began

        self.graph.capture_end = timed_end
        return original(self, timed_run)
    return capture


def sweep(name: str, repeats: int) -> list[str]:
    case, device = CASES[name], torch.device("cuda")
    model, x = build(case, device)
    bare = statistics.median(timed(lambda: bare_passes(model, x, case), device)
                             for _ in range(repeats))
    lines = [f"{name}: bare passes {bare * 1e3:.1f} ms"]
    for copy in ("index_copy_", "triton"):
        rows.slot_copy = cudagraph.slot_copy if copy == "index_copy_" else triton_copy
        for lanes in (1, 2, 4, 8):
            graphs.MAX_LANES = lanes

            def run() -> divtrace.Comparison:
                return divtrace.compare(model, x, a=divtrace.Run(chunk=case["chunk"]),
                                        samples=case["samples"], progress=False)
            run()  # warm-up
            ratio = statistics.median(timed(run, device) for _ in range(repeats)) / bare
            outcome = run().meta.graphed["a"]
            lines.append(
                f"  {copy:11} lanes {outcome['lanes']}: {ratio:.2f}x the bare passes; "
                f"capture {outcome['capture_s'] * 1e3:.0f} ms (Python of the captured "
                f"passes {PARTS['python'] * 1e3:.0f}, capture_end "
                f"{PARTS['capture_end'] * 1e3:.0f})")
    rows.slot_copy = cudagraph.slot_copy
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    per_sample = [name for name, case in CASES.items() if case["chunk"] == 1
                  and case["samples"] is None]
    parser.add_argument("--cases", nargs="*", default=["alexnet_b100_per_sample",
                                                       "resnet50_b64_per_sample"],
                        choices=per_sample)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    use_seed_settings(torch.device("cuda"))
    cudagraph.CudaGraph.capture = _timed_capture(cudagraph.CudaGraph.capture)
    for name in args.cases:
        print("\n".join(sweep(name, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
