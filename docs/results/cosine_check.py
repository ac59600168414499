"""The `cosine` column where two runs differ by rounding: 1 − cos beside an exact value.

Two float32 rows a step or two apart in their last bits: 1 − cos from exact rational sums
(the tests' reference),
and from divtrace's fields (the CPU's eager path; on CUDA the eager path and the fused
kernel). Then mobilenet_v3_small, batch 16 of 3×64×64, chunk 2, samples [0, 1]: for every
divergent site, 1 − cosine over 1 − cos of the kept rows summed in float64 with
``math.fsum``.

    python docs/results/cosine_check.py [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from divtrace.measure import fused
from divtrace.measure.figures import site_figures
from divtrace.measure.stats import block_stats
from tests.test_metrics import _exact_one_minus_cosine as exact_one_minus_cosine


def one_minus_cosine(fields: torch.Tensor, numel: int) -> float:
    return 1 - site_figures(fields.cpu().numpy(), numel)["cosine"]


def main() -> int:
    import torchvision.models

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    generator = torch.Generator().manual_seed(0)
    for n in (4096, 30000):
        r = torch.randn(n, generator=generator)
        b = r.clone()
        for _ in range(2):  # a step or two in the last bit, up or down at random
            away = torch.where(torch.rand(n, generator=generator) < 0.5, -math.inf, math.inf)
            b = torch.nextafter(b, away)
        line = (f"{n} elements: exact 1 − cos {exact_one_minus_cosine(b, r):.3e}; CPU "
                f"{one_minus_cosine(block_stats(b[None], r[None], 0, 0), n):.3e}")
        if device.type == "cuda":
            bc, rc = b.to(device)[None], r.to(device)[None]
            line += (f"; CUDA eager {one_minus_cosine(block_stats(bc, rc, 0, 0), n):.3e}"
                     f"; CUDA fused kernel "
                     f"{one_minus_cosine(fused.fused_stats(bc, rc, 0, 0), n):.3e}")
        print(line)
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small().eval().to(device)
    x = torch.rand(16, 3, 64, 64, device=device)
    result = divtrace.compare(model, x, samples=[0, 1], a=divtrace.Run(chunk=2),
                              resources=divtrace.Resources(keep=True), progress=False)
    table = result.table
    ratios, zero, sites = [], 0, 0
    for _, row in table[table["mismatch"] > 0].iterrows():
        batched, split = result.pair(row["site"])
        b = batched.reshape(-1).double().cpu().numpy()
        s = split.reshape(-1).double().cpu().numpy()
        reference = 1 - math.fsum(b * s) / math.sqrt(math.fsum(b * b) * math.fsum(s * s))
        got = 1 - row["cosine"]
        sites += 1
        zero += got == 0
        if reference > 1e-15:
            ratios.append(got / reference)
    found = np.array(ratios)
    print(f"mobilenet_v3_small on {device}, chunk 2: {sites} divergent sites; 1 − cosine "
          f"exactly 0 in {zero}; over the {len(found)} whose reference exceeds 1e-15, "
          f"1 − cosine / reference: 10th percentile {np.percentile(found, 10):.3f}, median "
          f"{np.median(found):.3f}, 90th {np.percentile(found, 90):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
