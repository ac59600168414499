"""Commands of ``divtrace`` beyond one comparison of a model: ``backward`` (one
backward over the batch against gradient accumulation) and ``compare-models`` (two
models on one input); the compact table every command prints."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pandas as pd

from divtrace.errors import DivtraceError
from divtrace.target import Raised, UsageError, called, load, placed, training
from divtrace.words import readable

__all__ = ["COMPACT", "add_command", "compact"]

COMPACT = ["site", "module_type", "status", "mismatch", "rel_l2", "role"]


def compact(table: pd.DataFrame, limit: int = 15) -> str:
    """The divergent sites of ``table``, at most ``limit`` of them, as text."""
    diverged = table[(table["status"] == "ok") & (table["mismatch"] > 0)]
    if diverged.empty:
        return "(no divergent site)"
    shown = diverged[[c for c in COMPACT if c in diverged]].head(limit)
    more = "" if len(diverged) <= limit else f"\n... and {len(diverged) - limit} more"
    return readable(shown).to_string(index=False) + more


def _reported(args: argparse.Namespace, who: str, make: Callable[[], Any]) -> Any:
    """``make()``'s result, saved as the arguments ask and its summary printed; what the
    user's code raised is exit code 3."""
    try:
        result = make()
    except (UsageError, DivtraceError):
        raise
    except Exception as exc:
        raise Raised(f"{who} raised {type(exc).__name__}: {exc}") from exc
    for suffix, write in (("json", result.save), ("html", result.to_html)):
        if getattr(args, suffix):
            write(getattr(args, suffix))
    print(result.summary())
    print()
    return result


def _backward(args: argparse.Namespace) -> int:
    import divtrace

    model, batch, loss, weight = training(args.target)
    model, batch = placed(model, batch, args.device, args.dtype)
    samples = [int(s) for s in args.samples.split(",")] if args.samples else None
    result = _reported(args, "the model or the loss", lambda: divtrace.compare_backward(
        model, batch, loss, chunk=args.chunk, samples=samples, weight=weight,
        batch_dim=args.batch_dim, forward=not args.no_forward, rtol=args.rtol,
        atol=args.atol, allow_train=args.allow_train, progress=not args.no_progress))
    print(result.sites.to_string(index=False))
    kind = result.verdict.kind
    failed = (args.fail_on == "divergence" and kind != "identical") or (
        args.fail_on == "not-rounding" and kind == "not rounding")
    return 1 if failed else 0


def _models(args: argparse.Namespace) -> int:
    import torch

    import divtrace

    a, x = placed(*load(args.a), args.device, args.dtype)
    b = called(args.b)
    if isinstance(b, tuple) and b and isinstance(b[0], torch.nn.Module):
        b = b[0]  # (model, x): its own x is not used
    if not isinstance(b, torch.nn.Module):
        raise UsageError(f"{args.b} must return a model (or (model, x)); got "
                         f"{type(b).__name__}")
    b, _ = placed(b, x, args.device, args.dtype)
    explain = [name for name in (args.explain or "").split(",") if name] or None
    result = _reported(args, "a model", lambda: divtrace.compare_models(
        a, b, x, explain=explain, rtol=args.rtol, atol=args.atol,
        progress=not args.no_progress))
    print(compact(result.table))
    failed = (args.fail_on == "divergence" and result.verdict != "identical") or (
        args.fail_on == "not-rounding" and result.verdict == "not rounding")
    return 1 if failed else 0


def add_command(commands: Any, name: str) -> None:
    """Adds the command ``name`` (``backward`` or ``compare-models``) to ``commands``."""
    if name == "compare-models":
        back = commands.add_parser(
            "compare-models", help="two models on one input, site by site",
            description="Compare model B with model A on A's input, as "
                        "divtrace.compare_models does. A is path/to/file.py:function (or "
                        "package.module:function) returning (model, x); B returns a model.")
        back.add_argument("a", metavar="A")
        back.add_argument("b", metavar="B")
        back.add_argument("--explain", help="comma-separated probes (local: the error each "
                          "layer of B adds on A's inputs; independence)")
        _shared(back, _models)
        return
    back = commands.add_parser(
        "backward", help="one backward over the batch against gradient accumulation",
        description="Compare one backward over the batch with gradient accumulation over "
                    "chunks, as divtrace.compare_backward does. TARGET is "
                    "path/to/file.py:function or package.module:function; the function "
                    "returns (model, batch, loss) or (model, batch, loss, weight).")
    back.add_argument("target", metavar="TARGET")
    back.add_argument("--chunk", type=int, required=True, help="rows per micro-batch")
    back.add_argument("--samples", help="comma-separated rows whose output gradients are "
                      "compared (default: all)")
    back.add_argument("--batch-dim", type=int, default=0, help="the batch dimension")
    back.add_argument("--no-forward", action="store_true",
                      help="leave the forward sites out (fewer passes)")
    back.add_argument("--allow-train", action="store_true",
                      help="compare although the model draws random numbers")
    _shared(back, _backward)




def _shared(command: Any, handle: Any) -> None:
    command.add_argument("--rtol", type=float, help="relative tolerance of the exceed column")
    command.add_argument("--atol", type=float, help="absolute tolerance of the exceed column")
    command.add_argument("--device", help="move the model(s) and the input there first")
    command.add_argument("--dtype", help="cast the model(s) and floating inputs first")
    command.add_argument("--json", help="save the result as JSON (divtrace show, diff, "
                         "divtrace.load)")
    command.add_argument("--html", help="write a self-contained HTML report")
    command.add_argument("--fail-on", choices=["divergence", "not-rounding"],
                         help="exit 1 when the runs are not bit-identical (divergence) or "
                              "when the verdict is not rounding")
    command.add_argument("--no-progress", action="store_true",
                         help="no progress bar on stderr")
    command.set_defaults(handle=handle)
