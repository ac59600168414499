"""Where the time of ``compare(..., ops=True)`` goes: cProfile of one comparison of the
small transformer of ``benchmarks/ops.py`` (4 blocks of width 256, batch 32 x 128 tokens,
per sample) on CUDA.

    python benchmarks/ops_profile.py
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ops import Block

import divtrace


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)]).eval().cuda()
    x = torch.randn(32, 128, 256, device="cuda")

    def run(ops: bool | str) -> None:
        divtrace.compare(model, x, ops=ops, progress=False)
        torch.cuda.synchronize()

    for ops in (False, "only", True, True):
        run(ops)  # warm-up
        start = time.perf_counter()
        run(ops)
        print(ops, time.perf_counter() - start)
    profile = cProfile.Profile()
    profile.enable()
    run(True)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    pstats.Stats(profile).sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    main()
