"""One backward over the batch against gradient accumulation: ``compare_backward()``
against the bare passes it must make — the batched forward and backward, and each
chunk's forward and weighted backward — for a Llama-shaped model with a token-mean loss
over prompts of different lengths (right padded, the padding's labels ignored), each
chunk weighted by its tokens. Medians of interleaved repeats in one process, the first
call of each (cold) besides; ``compare_backward`` with the forward comparison (the
default) and without (``forward=False``), and the bare passes with the passes of the
verdict's tests (the floor of the default).

    python -m benchmarks backward [--device cuda] [--dtype bfloat16] [--repeats 5]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import divtrace
from benchmarks.common import environment, llama, timed, use_seed_settings

#: Per device: the Llama shape, the batch, its longest prompt, the chunk.
CASES: dict[str, dict[str, Any]] = {
    "cpu": {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "mlp": 704,
            "vocab": 8000, "batch": 16, "tokens": 64, "chunk": 4},
    "cuda": {"hidden": 2048, "layers": 16, "heads": 16, "kv_heads": 8, "mlp": 5632,
             "vocab": 32000, "batch": 16, "tokens": 512, "chunk": 4},
}


def batch_of(case: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Token ids of random lengths (an eighth of the longest up to it), right padded; the
    padding masked out and its labels ignored (-100)."""
    g = torch.Generator().manual_seed(1)
    size, longest = case["batch"], case["tokens"]
    ids = torch.randint(0, case["vocab"], (size, longest), generator=g)
    lengths = torch.randint(max(2, longest // 8), longest + 1, (size,), generator=g)
    keep = torch.arange(longest)[None, :] < lengths[:, None]
    labels = torch.where(keep, ids, torch.full_like(ids, -100))
    return {"input_ids": ids.to(device), "attention_mask": keep.long().to(device),
            "labels": labels.to(device)}


def model_loss(m: nn.Module, part: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss: the mean over the part's tokens (next-token labels)."""
    loss: torch.Tensor = m(**part).loss
    return loss


def tokens(part: dict[str, torch.Tensor]) -> int:
    """The tokens the loss averages over (its labels are shifted by one)."""
    return int((part["labels"][:, 1:] != -100).sum())


def by_tokens(batch: dict[str, torch.Tensor]) -> Any:
    """Each chunk's weight: its share of the batch's tokens."""
    total = tokens(batch)
    return lambda part: tokens(part) / total


def bare(model: nn.Module, batch: dict[str, torch.Tensor], chunk: int) -> None:
    """The passes ``compare_backward`` must make, without it."""
    weight = by_tokens(batch)
    size = len(batch["input_ids"])
    model_loss(model, batch).backward()
    for start in range(0, size, chunk):
        part = {k: v[start:start + chunk] for k, v in batch.items()}
        (weight(part) * model_loss(model, part)).backward()
    model.zero_grad(set_to_none=True)


def floor(model: nn.Module, batch: dict[str, torch.Tensor], chunk: int, tested: int) -> None:
    """The bare passes and the passes the verdict's tests make, without divtrace: the
    independence test's ``tested`` forward passes over the batch (one per group of the
    held samples, autograd on, as in the training passes) and the weights test's
    (autograd off; its loss's own backward is left out, so this is a lower bound)."""
    bare(model, batch, chunk)
    for _ in range(tested):
        with torch.enable_grad():
            model_loss(model, batch).detach()
    with torch.no_grad():
        model_loss(model, batch)


def measure(device: torch.device, dtype: torch.dtype, repeats: int,
            case: dict[str, Any] | None = None, old: Any = None) -> dict[str, Any]:
    """The bare passes, ``compare_backward`` and ``forward=False``, interleaved (and
    ``old``'s ``compare_backward``, an older checkout's, when given)."""
    case = case or CASES[device.type]
    built = time.perf_counter()
    model = llama(case, device, dtype)
    built = time.perf_counter() - built
    batch, chunk = batch_of(case, device), case["chunk"]
    weight = by_tokens(batch)
    bare(model, batch, chunk)  # the model's own first passes (as the image cases' first)
    first: list[Any] = []  # the first call, timed: its notes say the tests' passes
    first_s = timed(lambda: first.append(divtrace.compare_backward(
        model, batch, model_loss, chunk=chunk, weight=weight, progress=False)), device)
    forward = first[0].forward  # its forward comparison holds the tests' notes
    notes = {} if forward is None else forward.meta.notes.get("independence", {})
    tested = int(notes.get("passes", 0)) if notes.get("ran") else 0
    ways = {
        "bare passes": lambda: bare(model, batch, chunk),
        "bare and the tests' passes": lambda: floor(model, batch, chunk, tested),
        "compare_backward": lambda: divtrace.compare_backward(
            model, batch, model_loss, chunk=chunk, weight=weight, progress=False),
        "forward=False": lambda: divtrace.compare_backward(
            model, batch, model_loss, chunk=chunk, weight=weight, progress=False,
            forward=False)}
    if old is not None:
        ways["old: compare_backward"] = lambda: old.compare_backward(
            model, batch, model_loss, chunk=chunk, weight=weight, progress=False)
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(repeats + 1):  # the order rotates; round 0: the others' first calls
        order = list(ways)[round_ % len(ways):] + list(ways)[:round_ % len(ways)]
        for way in order:
            seconds[way].append(timed(ways[way], device))
    warm = {way: statistics.median(found[1:]) for way, found in seconds.items()}
    base = warm["bare passes"]
    cold = {way: found[0] for way, found in seconds.items()} | {"compare_backward": first_s}
    return {"case": case, "dtype": str(dtype).removeprefix("torch."), "built_s": built,
            "test_passes": tested, "seconds": warm, "cold": cold,
            "ratio": {way: s / base for way, s in warm.items()}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks backward", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    use_seed_settings(device)
    env = environment(device)
    print(f"environment: {env}")
    found = measure(device, dtype, args.repeats)
    print(f"case: {found['case']}, {found['dtype']}; model built in {found['built_s']:.2f} s")
    for way, seconds in found["seconds"].items():
        print(f"  {way}: {seconds:.3f} s (first call {found['cold'][way]:.3f} s), "
              f"{found['ratio'][way]:.2f}× the bare passes")
    if args.json:
        args.json.write_text(json.dumps({"environment": env, **found}, indent=1))
    return 0
