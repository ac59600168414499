"""``compare_compiled()``: ``torch.compile``'d code module by module — compiled batched
against compiled split, or eager against compiled — with every compiled region (a decoder
layer, a ResNet stage) a site of its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from divtrace.compare import compare
from divtrace.compat import compiled_code_kept
from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.explain.regions import Regions
from divtrace.explain.registry import Explain
from divtrace.kinds.compiled import CompiledRegions
from divtrace.plan.compiled import Compiled, checked_regions, inside, plain, regions_of, wrapped
from divtrace.plan.prompts import Prompts
from divtrace.plan.runs import Resources, Run
from divtrace.report.comparison import Comparison

__all__ = ["compare_compiled"]

#: What ``against=`` takes: run a compiled in chunks, or run a eager.
AGAINST = ("split", "eager")


def _observed(model: nn.Module, regions: Sequence[str], given: Any) -> list[str]:
    """The sites: each region, and every leaf module outside the regions (or the given
    modules, none of them inside a region)."""
    if given is None:
        leaves = [name for name, module in model.named_modules()
                  if name and next(module.children(), None) is None
                  and not inside(name, regions) and name not in regions]
        return list(regions) + leaves
    names = [given] if isinstance(given, str) else list(given)
    hidden = [n for n in names if isinstance(n, str) and inside(n, regions)]
    if hidden:
        raise DivtraceValueError(
            f"'{hidden[0]}' lies inside a compiled region, whose code has no sites: "
            f"observe the region itself, or leave it eager (regions=[...] without it)")
    return names


def compare_compiled(
    model: nn.Module,
    x: Any,
    *,
    against: str = "split",
    regions: Sequence[str] | None = None,
    chunk: int = 1,
    dynamic: bool | None = False,
    backend: str = "inductor",
    options: Mapping[str, Any] | None = None,
    samples: Iterable[int] | None = None,
    modules: Any = None,
    batch_dim: int = 0,
    explain: Explain = None,
    rtol: float | None = None,
    atol: float | None = None,
    resources: Resources | None = None,
    progress: bool = True,
) -> Comparison:
    """Compiled code module by module: the model compiled region by region (each block its
    own ``torch.compile``'d region, the code between them eager), every region's output a
    site.

    ``against="split"``: compiled batched (run b, the whole batch) against compiled split
    (run a, passes of ``chunk`` rows) — which region's compiled code depends on the batch
    shape. ``against="eager"``: the eager model (run a) against the compiled one (run b),
    on the same batch — which region's compiled code gives other numbers than eager. The
    independence test and the precision test (both runs again in float64, compiled as
    they ran) judge it as any comparison. The user's model is not changed: the runs use
    copies (``torch.compile``'s wrappers taken off, a model compiled whole included).

    Args:
        model: The model, eager or compiled (``torch.compile(model)``, or compiled
            children).
        x: The input, as for :func:`divtrace.compare` (a tensor, or
            :class:`~divtrace.Prompts`).
        against: ``"split"`` or ``"eager"``.
        regions: The modules compiled, each on its own (default: the entries of each
            ``nn.ModuleList``, e.g. the decoder layers; without one, the children that
            hold modules: a ResNet's stages), plus every module ``torch.compile`` had
            wrapped.
        chunk: Run a's batch size (``against="split"``).
        dynamic, backend, options: As for ``torch.compile``; ``dynamic=False`` (the
            default here) compiles each batch shape on its own.
        samples, modules, batch_dim, explain, rtol, atol, resources, progress: As for
            :func:`divtrace.compare` (``modules`` may not name a module inside a region).

    Returns:
        A :class:`~divtrace.Comparison` (``meta.kind == "compiled"``).
    """
    if not isinstance(model, nn.Module):
        raise DivtraceTypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if against not in AGAINST:
        raise DivtraceValueError(f"against= takes 'split' or 'eager'; got {against!r}")
    eager = plain(model)
    chosen = regions_of(eager) if regions is None else tuple(
        [regions] if isinstance(regions, str) else regions)
    chosen = tuple(dict.fromkeys([*chosen, *(w for w in wrapped(model) if w)]))
    found = checked_regions(eager, chosen)
    if not chosen:
        raise DivtraceValueError(
            f"{type(eager).__name__} has no block to compile as a region (no "
            f"nn.ModuleList, no child with modules of its own): name them, regions=[...]")
    copies: dict[int, nn.Module] = {}
    b = Compiled(regions=chosen, dynamic=dynamic, backend=backend,
                 options=tuple(sorted((options or {}).items())), copies=copies,
                 name="compiled batched" if against == "split" else "compiled")
    a: Run = replace(b, chunk=chunk, name="compiled split") if against == "split" else (
        Run(name="eager"))  # the model as given, its wrappers taken off
    kind = CompiledRegions.of(x, a, b)
    codes = [type(found[r]).forward.__code__ for r in chosen if r in found]
    # the compilations asked for: per dtype (the precision test's float64 too), one per
    # shape of run a's passes (a prompt alone: its own length) and run b's
    shapes = 2 * ((len(x) if isinstance(x, Prompts) else 2) + 1) + 2
    hidden = sum(1 for name, _ in eager.named_modules() if inside(name, chosen))
    probes = [*([] if explain is None else [explain] if isinstance(explain, str)
                else list(explain)), Regions(chosen, hidden)]
    with compiled_code_kept(codes, shapes) as entries:
        result = compare(eager, x, kind=kind, samples=samples, batch_dim=batch_dim,
                         modules=_observed(eager, chosen, modules), explain=probes,
                         rtol=rtol, atol=atol, resources=resources, progress=progress)
    most, limit = entries
    if limit and most >= limit:
        raise DivtraceValueError(
            f"a compiled region was compiled {most} times, the recompile limit in force "
            f"({limit}, for the shapes of this comparison's passes): past it its code runs "
            f"eager, so this would not compare compiled code. A region whose inputs change "
            f"from call to call (a KV cache handed to each decoder layer) recompiles at "
            f"every call: pass use_cache=False with the input (x={{'input_ids': ..., "
            f"'use_cache': False}}), or give regions=[...] that take tensors only")
    return result
