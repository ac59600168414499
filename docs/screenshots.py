"""Screenshots of divtrace's reports in a real browser, and of every kind of plot.

Runs the demo (``python -m divtrace.demo``) into a folder, renders its HTML reports with a
headless Chromium (Debian's ``chromium`` package), and draws each plot of divtrace on the
demo's comparisons. Writes PNG files into ``--out``.

    python docs/screenshots.py --out docs/screenshots [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import divtrace
from divtrace import demo

#: Flags for a headless Chromium on a machine with no network and no display.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-quic"]


def browser_shot(chromium: str, page: Path, png: Path, size: str) -> None:
    """``page`` as ``png``, rendered by Chromium at ``size`` (``width,height``)."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                        f"--window-size={size}", f"--screenshot={png}", page.as_uri()],
                       check=True, capture_output=True, timeout=120)


def plots(out: Path, results: dict[str, divtrace.Comparison], x: torch.Tensor) -> None:
    """Each kind of plot, drawn on the demo's comparisons."""
    from matplotlib.figure import Figure

    def save(name: str, size: tuple[float, float], draw: object) -> None:
        figure = Figure(figsize=size)
        draw(figure.subplots())  # type: ignore[operator]
        figure.savefig(out / f"plot_{name}.png", dpi=100, bbox_inches="tight")

    whole, features = results["vgg11"], results["vgg11_features"]
    save("snowball", (11, 4.5), lambda ax: whole.plot(ax=ax))
    save("overlay", (11, 4.5), lambda ax: divtrace.overlay(list(results.values()),
                                                           list(results), ax=ax))
    save("samples", (11, 2.2), lambda ax: whole.plot_samples(ax=ax))
    explained = divtrace.compare(demo.models(0)["vgg11"], x[:8], explain=["local", "kernels"],
                                 a=divtrace.Run(chunk=2), samples=[0, 1], progress=False)
    save("sources", (9, 3), lambda ax: explained.plot_sources(ax=ax))
    head = torch.nn.Sequential(*list(demo.models(0)["vgg11"].classifier)[:2]).eval()
    flat = torch.randn(16, 25088)
    found = divtrace.sweep(head, flat, {"dtype": [None, torch.float64, torch.bfloat16]},
                           chunk=2, samples=[0, 1], progress=False)
    save("sweep", (8, 2.5), lambda ax: found.plot(ax=ax))
    sizes = divtrace.sweep_batch(head, flat, samples=[0, 1], progress=False)
    save("batch_sweep", (7, 2.5), lambda ax: sizes.plot(ax=ax))
    del features


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        reports = Path(folder)
        demo.main(["--out", str(reports), "--batch", "16", "--size", "64", "--device", "cpu"])
        for name, size in (("vgg11", "1280,3200"), ("vgg11_features", "1280,2400")):
            browser_shot(args.chromium, reports / f"{name}.html",
                         args.out / f"report_{name}.png", size)
        x = torch.rand(16, 3, 64, 64, generator=torch.Generator().manual_seed(0))
        results = {name: divtrace.compare(model, x, a=divtrace.Run(chunk=2), samples=[0, 1],
                                          progress=False)
                   for name, model in demo.models(0).items()}
        plots(args.out, results, x)
    print(f"wrote {sorted(p.name for p in args.out.glob('*.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
