"""Where the time of ``compare(..., ops=True)`` goes: cProfile of one comparison of a
pre-norm encoder (4 x 256, batch 32 x 128 tokens, per sample) on CUDA.

    python benchmarks/ops_profile.py
"""
import cProfile
import pstats
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import divtrace

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True, norm_first=True)
model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval().cuda()
x = torch.randn(32, 128, 256, device="cuda")
for ops in (False, "only", True, True):
    divtrace.compare(model, x, ops=ops, progress=False); torch.cuda.synchronize()
    t = time.perf_counter(); divtrace.compare(model, x, ops=ops, progress=False); torch.cuda.synchronize(); print(ops, time.perf_counter() - t)
pr = cProfile.Profile(); pr.enable(); divtrace.compare(model, x, ops=True, progress=False); torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
pstats.Stats(pr).sort_stats("cumtime").print_stats(25)
