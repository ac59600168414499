"""The ``divtrace`` command: compare a model from the shell, show or diff saved results,
print the environment.

Exit codes: 0 done (and no ``--fail-on`` condition met), 1 a ``--fail-on`` condition met
(or ``diff --fail-on-change`` found a change), 2 a usage error (bad arguments, a target
that cannot be loaded, a file that is not divtrace's), 3 the target or the model raised
(its traceback and divtrace's notes on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from divtrace.commands import add_command, compact
from divtrace.errors import DivtraceError
from divtrace.target import Raised, UsageError, load, named_kind, placed
from divtrace.version import __version__
from divtrace.words import readable

__all__ = ["main"]

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
    except DivtraceError as exc:
        raise UsageError(f"{flag}: {exc}") from exc


def _compare(args: argparse.Namespace) -> int:
    import divtrace

    model, x = placed(*load(args.target), args.device, args.dtype)
    samples = [int(s) for s in args.samples.split(",")] if args.samples else None
    ops: bool | str = "only" if args.ops == "only" else args.ops == "true"
    graphs: bool | str = "auto" if args.graphs == "auto" else args.graphs == "true"
    explain = [name for name in (args.explain or "").split(",") if name]
    modules = [name for name in args.modules.split(",") if name] if args.modules else None
    try:
        result = divtrace.compare(
            model, x, samples=samples, batch_dim=args.batch_dim, modules=modules, ops=ops,
            explain=explain, rtol=args.rtol, atol=args.atol, allow_train=args.allow_train,
            chunk=args.chunk, a=_run(args.a, "--a"), b=_run(args.b, "--b"),
            resources=divtrace.Resources(offload=args.offload, graphs=graphs),
            progress=not args.no_progress, kind=named_kind(args.kind))
    except (UsageError, DivtraceError):
        raise
    except Exception as exc:
        raise Raised(f"the model raised {type(exc).__name__}: {exc}") from exc
    for suffix, write in (("json", result.save), ("html", result.to_html),
                          ("csv", result.to_csv)):
        if getattr(args, suffix):
            write(getattr(args, suffix))
    print(result.summary())
    print()
    print(compact(result.table))
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
        print(compact(found.table))
    return 0


def _diff(args: argparse.Namespace) -> int:
    import divtrace

    a, b = _load(args.a), _load(args.b)
    if type(a) is not type(b):
        raise UsageError(f"diff takes two saved results of one sort (two comparisons, two "
                         f"backward comparisons, ...); got a {type(a).__name__} and a "
                         f"{type(b).__name__}")
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
        epilog="Exit codes: 0 done; 1 a --fail-on condition met; 2 a usage error; 3 the "
               "target or the model raised.")
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
    run.add_argument("--chunk", type=int, help="run a's batch size (default 1: per sample); "
                     "the same as --a chunk=N")
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
    run.add_argument("--kind", metavar="TARGET",
                     help="the kind of comparison: path/to/file.py:Name, a divtrace.Kind "
                          "class or a function that returns one (default: batched vs split)")
    run.set_defaults(handle=_compare)

    add_command(commands, "backward")
    add_command(commands, "compare-models")

    _saved_commands(commands)
    return top


def _saved_commands(commands: Any) -> None:
    """``show``, ``diff`` (of saved files) and ``env``."""
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


#: Options people reach for that divtrace spells another way.
_SPELT = {"--chunks": "--chunk N", "--chunk-size": "--chunk N",
          "--batch-size": "--chunk N (the batch itself is the x the target returns)",
          "--train": "--allow-train", "--local": "--explain local",
          "--fp64": "--explain fp64", "--out": "--json, --html or --csv"}


def _unrecognized(top: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exits 2 for arguments no command takes, saying how each known one is spelt."""
    hints = [f"{word} is spelt {_SPELT[word.partition('=')[0]]}" for word in extra
             if word.partition("=")[0] in _SPELT]
    top.error(f"unrecognized arguments: {' '.join(extra)}"
              + (f" ({'; '.join(hints)})" if hints else ""))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    top = parser()
    args, extra = top.parse_known_args(argv)
    if extra:
        _unrecognized(top, extra)
    try:
        code: int = args.handle(args)
        return code
    except (UsageError, DivtraceError) as exc:
        print(f"divtrace: error: {exc}", file=sys.stderr)
        return 2
    except Raised as exc:
        cause = exc.__cause__
        if cause is not None:
            traceback.print_exception(cause, file=sys.stderr)
        print(f"divtrace: error: {exc}", file=sys.stderr)
        return 3
    except BrokenPipeError:  # the reader (e.g. `| head`) stopped: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
