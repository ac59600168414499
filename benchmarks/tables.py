"""No figure changes: every table of this version equals an older checkout's, figure for
figure (the per-site table and the per-sample table, compared with ``DataFrame.equals``).

The seed case (vgg11().features, the batch against its first two samples in chunks of
2); four image models (many small sites and a few large ones) per sample, with partial
samples, chunk 2 and each probe; op sites; prompts of different lengths through a tiny
Llama-like model; two models (a model against a copy with nudged weights, a batch and
prompts); one backward over the batch against accumulation (its table and its forward
sites); and generation (its token table and one step's comparison). Columns
renamed since the older version are matched by their new names. ``--except`` leaves
columns out (a change meant to change them) and says in how many rows each differs. A
case whose table differs from the older one's is run again with each version: when one
differs from itself, the case is named and left out.

    python -m benchmarks tables --old CHECKOUT [--device cuda] [--except cosine]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import divtrace
from benchmarks.common import arguments, load_old

#: Old column name -> new one (the runs' columns are named after runs a and b).
RENAMED = {"batched_err_fp64": "b_err_fp64", "split_err_fp64": "a_err_fp64",
           "kernels_batched": "kernels_b", "kernels_split": "kernels_a"}
#: (samples, run a's chunk, option) for each image model.
IMAGE_CASES: tuple[tuple[list[int] | None, int, str], ...] = (
    ([0, 1], 1, "default"), (None, 1, "default"), ([0, 1, 5], 2, "default"),
    ([0, 1], 1, "local"), ([3], 1, "fp64"), ([0, 1], 1, "keep"), ([0, 1], 1, "repeat=1"),
    ([0], 1, "independence=off"))
_Case = tuple[str, Callable[[Any], Any]]


def image_cases(device: torch.device) -> Iterator[_Case]:
    import torchvision.models

    torch.manual_seed(0)  # the seed case: vgg11().features, the batch vs its first 2
    seed = torchvision.models.vgg11().features.eval().to(device)
    batch, side = (128, 128) if device.type == "cuda" else (16, 64)
    xs = torch.rand(batch, 3, side, side, device=device)
    for option in ("default", "local", "fp64"):
        yield (f"vgg11_features seed (batch {batch} vs 2, chunk 2) {option}",
               lambda package, o=option: package.compare(
                   seed, xs, **arguments(package, 2, [0, 1], o)))

    for name in ("mobilenet_v3_small", "efficientnet_b0", "resnet18", "alexnet"):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)().eval().to(device)
        side = 96 if name == "alexnet" else 64
        x = torch.rand(20, 3, side, side, device=device)
        for samples, chunk, option in IMAGE_CASES:
            yield (f"{name} samples={samples} chunk={chunk} {option}",
                   lambda package, m=model, x=x, s=samples, c=chunk, o=option:
                   package.compare(m, x, **arguments(package, c, s, o)))
        if name == "alexnet":  # no BatchNorm: older versions raised on its ops' empty outputs
            yield (f"{name} ops=True",
                   lambda package, m=model, x=x: package.compare(
                       m, x, ops=True, **arguments(package, 1, [0, 1])))
        if name == "resnet18":  # two models: the model against a copy with nudged weights
            other = _nudged(model)
            yield (f"{name} against a nudged copy (compare_models)",
                   lambda package, m=model, o=other, x=x: package.compare_models(
                       m, o, x, samples=[0, 1], progress=False))
        if device.type == "cuda":
            half, xh = model.half(), x.half()
            yield (f"{name} fp16", lambda package, m=half, x=xh: package.compare(
                m, x, **arguments(package, 1, [0, 1])))


def _nudged(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose floating weights are moved by one part in a million."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1 + 1e-6)
    return other


def language_cases(device: torch.device) -> Iterator[_Case]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=200)
    model = LlamaForCausalLM(config).eval().to(device)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=generator).to(device)
               for n in (3, 9, 5, 12)]
    yield ("llama Prompts", lambda package: package.compare(
        model, package.Prompts(prompts, pad_token_id=0), progress=False))
    yield ("llama Prompts ops=True", lambda package: package.compare(
        model, package.Prompts(prompts, pad_token_id=0), ops=True, progress=False))
    other = _nudged(model)
    yield ("llama Prompts against a nudged copy (compare_models)",
           lambda package: package.compare_models(
               model, other, package.Prompts(prompts, pad_token_id=0), progress=False))
    yield ("llama generation", lambda package: package.compare_generate(
        model, prompts, max_new_tokens=6, pad_token_id=0, eos_token_id=None,
        progress=False))
    yield ("llama generation at(2)", lambda package: package.compare_generate(
        model, prompts, max_new_tokens=6, pad_token_id=0, eos_token_id=None,
        progress=False).at(2))


def backward_cases(device: torch.device) -> Iterator[_Case]:
    """One backward over the batch against accumulation in chunks of 2: its own table
    (loss, output gradients, parameters) and its forward sites."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                              torch.nn.Linear(32, 4)).to(device)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)

    def mse(model: Any, part: Any) -> Any:
        return torch.nn.functional.mse_loss(model(part[0]), part[1])

    yield ("MLP backward, chunks of 2", lambda package: package.compare_backward(
        net, (x, y), mse, chunk=2, progress=False))
    yield ("MLP backward, chunks of 2: forward sites", lambda package: package.compare_backward(
        net, (x, y), mse, chunk=2, progress=False).forward)


def tables(result: Any) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """A result's table (old columns renamed) and its per-sample table (if it has one)."""
    per_sample = getattr(result, "per_sample", None)
    if per_sample is None and isinstance(getattr(result, "samples", None), pd.DataFrame):
        per_sample = result.samples
    return result.table.rename(columns=RENAMED), per_sample


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tables", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--except", dest="left_out", nargs="*", default=[],
                        help="columns left out of the comparison")
    args = parser.parse_args(argv)
    old = load_old(args.old)
    device = torch.device(args.device)
    checked, different = 0, []
    for label, run in itertools.chain(image_cases(device), backward_cases(device),
                                      language_cases(device)):
        (new_table, new_rows), (old_table, old_rows) = tables(run(divtrace)), tables(run(old))
        same_columns = set(new_table.columns) == set(old_table.columns)
        old_table = old_table[list(new_table.columns)] if same_columns else old_table
        same = same_columns and new_table.drop(columns=args.left_out).equals(
            old_table.drop(columns=args.left_out)) and (
            new_rows is None or new_rows.equals(old_rows))
        differ = "".join(
            f"; {column} differs in {_differing(new_table[column], old_table[column])}"
            f" of {len(new_table)} rows" for column in args.left_out if column in new_table)
        if not same and same_columns:  # does either version differ from itself?
            unsteady = next(((name, moved) for name, package, table in (
                ("this version", divtrace, new_table), ("the older version", old, old_table))
                if (moved := _moved(run(package), table))), None)
            if unsteady is not None:
                print(f"{label}: {unsteady[0]} differs from itself on a second run: "
                      f"{unsteady[1]}; left out", flush=True)
                continue
        print(f"{label}: {'equal' if same else 'DIFFERENT'}{differ}", flush=True)
        if not same:
            if not same_columns:
                print(f"  columns: only new {sorted(set(new_table) - set(old_table))}, "
                      f"only old {sorted(set(old_table) - set(new_table))}")
            else:
                print(f"  {_where(new_table, old_table)}")
            different.append(label)
            continue
        checked += 1
    left_out = f" ({', '.join(args.left_out)} left out)" if args.left_out else ""
    print(f"equal tables in {checked} comparisons{left_out}"
          + (f"; DIFFERENT in {len(different)}: {', '.join(different)}" if different else ""))
    return 1 if different else 0


def _moved(result: Any, table: pd.DataFrame) -> str | None:
    """Where a second run's table differs from ``table`` (None: it does not)."""
    again = tables(result)[0]
    again = again[list(table.columns)] if set(again.columns) == set(table.columns) else again
    return None if again.equals(table) else _where(table, again)


def _where(one: pd.DataFrame, other: pd.DataFrame) -> str:
    """Which columns differ, and at how many rows (the first one named: its site, or for
    a token table its prompt and step), with the largest relative change of a number."""
    found = []
    for column in one.columns:
        rows = ~((one[column] == other[column]) | (one[column].isna() & other[column].isna()))
        if rows.any():
            first = one[rows].iloc[0]
            at = (f"'{first['site']}'" if "site" in one else
                  f"prompt {first['prompt']} step {first['step']}")
            size = ""
            if pd.api.types.is_float_dtype(one[column]):
                a, b = one[column][rows].astype(float), other[column][rows].astype(float)
                size = f", by at most {float(((a - b).abs() / b.abs()).max()):.3g} of the older"
            found.append(f"{column} at {int(rows.sum())} rows from {at}{size}")
    return "; ".join(found) or "the per-sample table"


def _differing(new: Any, old: Any) -> int:
    """Rows where two columns differ (missing in both counts as the same)."""
    return int((~((new == old) | (new.isna() & old.isna()))).sum())
