"""The fused Triton kernel gives the eager path's figures (run in Triton's interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = r"""
import math, torch
from divtrace.measure import fused as kernels
from divtrace.measure.stats import block_stats
for dtype in [torch.float32, torch.float16, torch.bfloat16, torch.float64]:
    g = torch.Generator().manual_seed(0)
    b = torch.randn(3, 5000, dtype=torch.float64, generator=g)
    r = b + torch.randn(3, 5000, dtype=torch.float64, generator=g) * 1e-3
    b[0, 0], r[0, 0] = 0.0, -0.0                  # signed zeros
    b[1, :10] = -r[1, :10]                        # opposite signs
    b[2, 5] = r[2, 5] = math.nan                  # NaN vs NaN
    b[2, 7] = r[2, 7] = math.inf                  # inf vs inf
    b[2, 9] = math.nan                            # NaN vs a number
    b, r = b.to(dtype), r.to(dtype)
    for rows in (b, b[:, 1000:3100]):             # contiguous and strided rows
        rr = r[:, :rows.shape[1]] if rows is b else r[:, 1000:3100]
        eager = block_stats(rows, rr, 1e-3, 1e-5)
        fused = kernels.fused_stats(rows, rr, 1e-3, 1e-5)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert fused[0, 0] > 0
    assert kernels.fused_stats(b, r, 0, 0)[2, 1] == 3  # NaN, inf and NaN-vs-number
print("fused == eager")
"""


def test_fused_kernel_matches_the_eager_statistics() -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fused == eager" in done.stdout
