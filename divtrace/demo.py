"""The seed question, reproduced: does a batch of N agree with its first 2 samples alone?

Runs torchvision's ``vgg11().features`` (random weights, fixed seed), a single
``Conv2d(3, 64, 3, padding=1)`` and the whole ``vgg11()`` on the same input, each as a
batch of N versus the first 2 samples as their own batch, and writes the tables (CSV and
JSON), self-contained HTML reports and the overlaid snowball plot into a folder.

Usage::

    python -m divtrace.demo --out demo-output [--batch 32] [--size 128] [--device cpu]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import divtrace


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m divtrace.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("demo-output"),
                        help="folder for the tables, reports and plot (created)")
    parser.add_argument("--batch", type=int, default=32, help="N, the batch size (32)")
    parser.add_argument("--size", type=int, default=128, help="image height and width (128)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def models(seed: int) -> dict[str, nn.Module]:
    """The three models of the demo, with random weights (nothing is downloaded)."""
    from torchvision.models import vgg11

    torch.manual_seed(seed)
    full = vgg11(weights=None).eval()
    return {
        "vgg11_features": full.features,
        "conv2d_3_64": nn.Conv2d(3, 64, 3, padding=1).eval(),
        "vgg11": full,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from matplotlib.figure import Figure

    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(args.seed)
    x = torch.rand(args.batch, 3, args.size, args.size, generator=generator).to(device)
    results: dict[str, divtrace.Comparison] = {}
    for name, model in models(args.seed).items():
        model.to(device)
        result = divtrace.compare(model, x, samples=[0, 1], a=divtrace.Run(chunk=2))
        results[name] = result
        result.to_csv(args.out / f"{name}.csv")
        result.save(args.out / f"{name}.json")
        result.to_html(args.out / f"{name}.html", title=f"divtrace: {name} on {device}")
        print(f"== {name}: batch of {args.batch} vs its first 2 samples ({device}) ==")
        print(result.summary(), end="\n\n")
    figure = Figure(figsize=(10, 4.5))
    ax = divtrace.overlay(list(results.values()), list(results), ax=figure.subplots())
    ax.set_title(f"divtrace: batch of {args.batch} vs first 2, {device}")
    figure.savefig(args.out / "snowball.png", dpi=120, bbox_inches="tight")
    summary = "\n\n".join(f"== {n} ==\n{r.summary()}" for n, r in results.items())
    (args.out / "summary.txt").write_text(summary + "\n")
    print(f"Wrote {', '.join(sorted(p.name for p in args.out.iterdir()))} to {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
