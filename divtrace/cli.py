"""The ``divtrace`` command: compare a model from the shell, show or diff saved results,
print the environment.

Exit codes: 0 done (and no ``--fail-on`` condition met), 1 a ``--fail-on`` condition met
(or ``diff --fail-on-change`` found a change), 2 a usage error (bad arguments, a target
that cannot be loaded, a file that is not divtrace's).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from divtrace.compat import pytree
from divtrace.errors import DivtraceError
from divtrace.version import __version__
from divtrace.words import readable

__all__ = ["main"]

_COMPACT = ["site", "module_type", "status", "mismatch", "rel_l2", "role"]


class UsageError(Exception):
    """Something the user gave cannot be used: exit code 2, with the message."""


def _target(spec: str) -> tuple[torch.nn.Module, Any]:
    """Calls ``path/to/file.py:function`` or ``package.module:function`` for ``(model, x)``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise UsageError(f"TARGET must be path/to/file.py:function or package.module:function;"
                         f" got {spec!r}")
    try:
        if where.endswith(".py") or "/" in where:
            path = Path(where)
            if not path.is_file():
                raise UsageError(f"no such file: {path}")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            if loader is None or loader.loader is None:
                raise UsageError(f"cannot load {path} as Python")
            module = importlib.util.module_from_spec(loader)
            sys.path.insert(0, str(path.resolve().parent))
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as exc:
        raise UsageError(f"cannot import {where}: {exc}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"{where} has no function {name!r}")
    made = function()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise UsageError(f"{spec} must return (model, x); got {type(made).__name__}")
    return made[0], made[1]


#: How ``--dtype`` may name the floating dtypes (torch's names, and the usual short ones).
DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float64": torch.float64, "double": torch.float64, "fp64": torch.float64}


def _device(name: str) -> torch.device:
    """``--device``, checked: a malformed name, or a device this machine does not have,
    is a usage error."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, "
                         f"mps, ...): {exc}") from exc
    if device.type == "cuda" and (not torch.cuda.is_available() or (
            device.index is not None and device.index >= torch.cuda.device_count())):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise UsageError(f"--device {name}: this machine has {found} CUDA device"
                         f"{'' if found == 1 else 's'} (torch.cuda.is_available() is "
                         f"{torch.cuda.is_available()}); leave --device out to run where "
                         f"the target put the model")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available on this machine")
    return device


def _placed(model: torch.nn.Module, x: Any, device: str | None, dtype: str | None
            ) -> tuple[torch.nn.Module, Any]:
    """The model and input moved to ``device`` and floating tensors cast to ``dtype``."""
    if device is None and dtype is None:
        return model, x
    cast = None
    if dtype is not None:
        cast = DTYPES.get(dtype.removeprefix("torch."))
        if cast is None:
            raise UsageError(f"--dtype must name a floating dtype ({', '.join(DTYPES)}); "
                             f"got {dtype!r}")
    where = _device(device) if device is not None else None

    def move(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to(where) if where is not None else value
        return value.to(cast) if cast is not None and value.is_floating_point() else value

    model = model.to(where) if where is not None else model
    model = model.to(cast) if cast is not None else model
    return model, pytree.tree_map(move, x)


def _compact(table: pd.DataFrame, limit: int = 15) -> str:
    diverged = table[(table["status"] == "ok") & (table["mismatch"] > 0)]
    if diverged.empty:
        return "(no divergent site)"
    shown = diverged[[c for c in _COMPACT if c in diverged]].head(limit)
    more = "" if len(diverged) <= limit else f"\n... and {len(diverged) - limit} more"
    return readable(shown).to_string(index=False) + more


def _value(text: str) -> Any:
    """A value of ``--a``/``--b``: a number, true/false/none, a torch dtype, or text."""
    lowered = text.lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    dtype = getattr(torch, text, None)
    return dtype if isinstance(dtype, torch.dtype) else text


def _run(spec: str | None, flag: str) -> Any:
    """``--a chunk=4,dtype=bfloat16`` as ``divtrace.Run(chunk=4, dtype=torch.bfloat16)``."""
    import divtrace

    if spec is None:
        return None
    fields: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        name, sep, value = part.partition("=")
        if not sep:
            raise UsageError(f"{flag} takes Run fields as name=value, comma-separated "
                             f"(e.g. chunk=4,dtype=bfloat16); got {part!r}")
        fields[name.strip()] = _value(value.strip())
    try:
        return divtrace.Run(**fields)
    except TypeError as exc:
        raise UsageError(f"{flag}: {exc}") from exc


def _compare(args: argparse.Namespace) -> int:
    import divtrace

    model, x = _placed(*_target(args.target), args.device, args.dtype)
    samples = [int(s) for s in args.samples.split(",")] if args.samples else None
    ops: bool | str = "only" if args.ops == "only" else args.ops == "true"
    graphs: bool | str = "auto" if args.graphs == "auto" else args.graphs == "true"
    explain = [name for name in (args.explain or "").split(",") if name]
    modules = [name for name in args.modules.split(",") if name] if args.modules else None
    result = divtrace.compare(
        model, x, samples=samples, batch_dim=args.batch_dim, modules=modules, ops=ops,
        explain=explain, rtol=args.rtol, atol=args.atol, allow_train=args.allow_train,
        a=_run(args.a, "--a"), b=_run(args.b, "--b"),
        resources=divtrace.Resources(offload=args.offload, graphs=graphs),
        progress=not args.no_progress)
    for suffix, write in (("json", result.save), ("html", result.to_html),
                          ("csv", result.to_csv)):
        if getattr(args, suffix):
            write(getattr(args, suffix))
    print(result.summary())
    print()
    print(_compact(result.table))
    if args.remedies:
        _remedies(result, not args.no_progress)
    failed = (args.fail_on == "divergence" and result.verdict != "identical") or (
        args.fail_on == "not-rounding" and result.verdict == "not rounding")
    return 1 if failed else 0


def _remedies(result: Any, progress: bool) -> None:
    """Prints the remedies of ``result``: what they say, their table, the best."""
    found = result.remedies(progress=progress)
    print()
    print(found.summary())
    if not found.table.empty:
        columns = ["remedy", "identical", "identical_sites", "sites", "output_rel_l2",
                   "cost", "a_cost", "output_change"]
        print()
        print(readable(found.table[columns]).to_string(index=False))
    best = found.best
    print()
    print(f"best: {best.name if best is not None else 'none'}")


def _load(path: str) -> Any:
    import divtrace

    return divtrace.load(path)


def _show(args: argparse.Namespace) -> int:
    found = _load(args.file)
    print(found.summary() if hasattr(found, "summary") else found.table.to_string(index=False))
    if hasattr(found, "table") and "mismatch" in found.table and "site" in found.table:
        print()
        print(_compact(found.table))
    return 0


def _diff(args: argparse.Namespace) -> int:
    import divtrace

    a, b = _load(args.a), _load(args.b)
    if not isinstance(a, divtrace.Comparison) or not isinstance(b, divtrace.Comparison):
        raise UsageError("diff takes two saved comparisons (Comparison.save)")
    found = divtrace.diff(a, b)
    print(found.summary())
    changed = found.changed
    if not changed.empty:
        shown = changed if args.all else changed.head(20)
        print()
        print(readable(shown[["site", "status_a", "status_b", "rel_l2_a", "rel_l2_b",
                              "change"]]).to_string(index=False))
        if len(shown) < len(changed):
            print(f"({len(shown)} of the {len(changed)} changed sites shown; --all shows "
                  f"every one)")
    return 1 if args.fail_on_change and not changed.empty else 0


def _env(args: argparse.Namespace) -> int:
    from divtrace.report.environment import environment

    print(json.dumps(environment(), indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    top = argparse.ArgumentParser(
        prog="divtrace",
        description=("Trace, layer by layer, where a batched run and a split run of a model "
                     "start to differ."),
        epilog="Exit codes: 0 done; 1 a --fail-on condition met; 2 a usage error.")
    top.add_argument("--version", action="version", version=f"divtrace {__version__}")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "compare", help="compare a model batched and split (or any two runs)",
        description="Compare two runs of a model: by default split (a) and batched (b), "
                    "as divtrace.compare does. TARGET is path/to/file.py:function or "
                    "package.module:function; the function returns (model, x).")
    run.add_argument("target", metavar="TARGET")
    run.add_argument("--samples", help="comma-separated rows to compare (default: all)")
    run.add_argument("--batch-dim", type=int, default=0, help="the batch dimension")
    run.add_argument("--modules", help="comma-separated glob patterns of modules to observe")
    run.add_argument("--ops", choices=["none", "true", "only"], default="none",
                     help="op-level sites (true: besides modules; only: no module hooks)")
    run.add_argument("--explain", help="comma-separated probes: local, fp64, repeat, "
                     "kernels, observer; --explain=-independence turns a default off")
    run.add_argument("--rtol", type=float, help="relative tolerance of the exceed column")
    run.add_argument("--atol", type=float, help="absolute tolerance of the exceed column")
    run.add_argument("--allow-train", action="store_true",
                     help="compare although train-mode modules mix samples")
    run.add_argument("--a", metavar="FIELDS", help="run a as Run fields, e.g. chunk=4 "
                     "(default chunk=1: per sample)")
    run.add_argument("--b", metavar="FIELDS", help="run b as Run fields, e.g. "
                     "dtype=bfloat16 (default: the whole batch in one pass)")
    run.add_argument("--offload", action="store_true",
                     help="keep run a's rows in CPU memory")
    run.add_argument("--graphs", choices=["auto", "true", "false"], default="auto",
                     help="on CUDA, replay run a from a CUDA graph (auto: where it can; "
                          "true: or fail; false: eager)")
    run.add_argument("--device", help="move the model and x there first (cuda, cpu, ...)")
    run.add_argument("--dtype", help="cast the model and floating inputs first (bfloat16)")
    run.add_argument("--json", help="save the comparison as JSON (the settings, summary and "
                     "tables), for `divtrace show` / `diff` and divtrace.load")
    run.add_argument("--html", help="write a self-contained HTML report")
    run.add_argument("--csv", help="write the table as CSV")
    run.add_argument("--fail-on", choices=["divergence", "not-rounding"],
                     help="exit 1 when the runs are not bit-identical (divergence) or when "
                          "the verdict is not rounding")
    run.add_argument("--remedies", action="store_true",
                     help="also try remedies (each verified by comparing again under it) "
                          "and print their table, their costs and the best")
    run.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    run.set_defaults(handle=_compare)

    show = commands.add_parser("show", help="summary and divergent sites of a saved file")
    show.add_argument("file", metavar="FILE")
    show.set_defaults(handle=_show)

    differ = commands.add_parser("diff", help="how two saved comparisons differ")
    differ.add_argument("a", metavar="A")
    differ.add_argument("b", metavar="B")
    differ.add_argument("--fail-on-change", action="store_true",
                        help="exit 1 when any site changed")
    differ.add_argument("--all", action="store_true",
                        help="list every changed site (default: the first 20)")
    differ.set_defaults(handle=_diff)

    env = commands.add_parser("env", help="the environment block: versions and devices")
    env.set_defaults(handle=_env)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    args = parser().parse_args(argv)
    try:
        code: int = args.handle(args)
        return code
    except (UsageError, DivtraceError) as exc:
        print(f"divtrace: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader (e.g. `| head`) stopped: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
