"""``compare_compiled()``: ``torch.compile``'d code module by module — compiled batched
against compiled split, or eager against compiled — with every compiled region (a decoder
layer, a ResNet stage) a site of its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import CodeType
from typing import Any

from torch import nn

from divtrace.compare import compare
from divtrace.compat import dropped, recompiles_allowed
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
    narrow: bool = False,
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
        narrow: Down to the module: when the runs first part at a region with modules
            inside, compile its children each on their own instead (its own code eager)
            and look inside the first that parts, down to the smallest module whose
            compiled code parts the runs (one quick comparison per step, without the
            verdict's tests); the summary names it.

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
    checked_regions(eager, chosen)
    if not chosen:
        raise DivtraceValueError(
            f"{type(eager).__name__} has no block to compile as a region (no "
            f"nn.ModuleList, no child with modules of its own): name them, regions=[...]")
    settings = Settings(against, chunk, dynamic, backend,
                        tuple(sorted((options or {}).items())))
    chain = _narrowed(eager, x, chosen, settings, samples, batch_dim) if narrow else []
    hidden = sum(1 for name, _ in eager.named_modules() if inside(name, chosen))
    probes = [*([] if explain is None else [explain] if isinstance(explain, str)
                else list(explain)), Regions(chosen, hidden, chain)]
    return _run(eager, x, chosen, settings, samples=samples, batch_dim=batch_dim,
                modules=_observed(eager, chosen, modules), explain=probes, rtol=rtol,
                atol=atol, resources=resources, progress=progress)


@dataclass(frozen=True)
class Settings:
    """How the regions are compiled and what they are compared against."""

    against: str
    chunk: int
    dynamic: bool | None
    backend: str
    options: tuple[tuple[str, Any], ...]


def _narrowed(eager: nn.Module, x: Any, chosen: tuple[str, ...], settings: Settings,
              samples: Any, batch_dim: int) -> list[list[str]]:
    """Down to the module: while the first site that parts is a region with modules
    inside, its children are compiled each on their own instead (its own code eager), and
    the first of them that parts is looked inside next. Returns ``[region, child]`` per
    step; a last ``[region, ""]`` when no child parts on its own (only the region compiled
    whole does)."""
    chain: list[list[str]] = []
    regions = chosen
    fast = ["-independence", "-precision"]  # only where the runs first part
    found = _run(eager, x, regions, settings, samples=samples, batch_dim=batch_dim,
                 modules=_observed(eager, regions, None), explain=fast, progress=False)
    first = found.first_divergence
    region = None if first is None else str(first["module"])
    modules = dict(eager.named_modules())
    while region in regions and region is not None:
        children = [f"{region}.{name}" if region else name
                    for name, _ in modules[region].named_children()]
        if not children:
            break
        regions = tuple(r for r in regions if r != region) + tuple(children)
        found = _run(eager, x, regions, settings, samples=samples, batch_dim=batch_dim,
                     modules=_observed(eager, regions, None), explain=fast, progress=False)
        first = found.first_divergence
        parted = "" if first is None else str(first["module"])
        if parted not in children:
            chain.append([region, ""])
            break
        chain.append([region, parted])
        region = parted
    return chain


def _run(eager: nn.Module, x: Any, chosen: tuple[str, ...], settings: Settings,
         **options: Any) -> Comparison:
    """One comparison of ``eager`` with ``chosen`` compiled as regions."""
    checked_regions(eager, chosen)
    against = settings.against
    copies: dict[int, nn.Module] = {}
    codes: list[CodeType] = []
    # the compilations asked for: one per shape of run a's passes (a prompt alone: its own
    # length) and run b's, per dtype (a copy compiled in float64 for the precision test
    # has code of its own)
    shapes = 2 * ((len(x) if isinstance(x, Prompts) else 2) + 1) + 2
    b = Compiled(regions=chosen, dynamic=settings.dynamic, backend=settings.backend,
                 options=settings.options, copies=copies, codes=codes, shapes=shapes,
                 name="compiled batched" if against == "split" else "compiled")
    a: Run = replace(b, chunk=settings.chunk, name="compiled split") if against == "split" else (
        Run(name="eager"))  # the model as given, its wrappers taken off
    kind = CompiledRegions.of(x, a, b)
    try:
        result = compare(eager, x, kind=kind, **options)
    finally:
        copies.clear()  # the compiled copy is not kept with the result
        most = dropped(codes)
        codes.clear()
    limit = recompiles_allowed(shapes)
    if limit and most >= limit:
        raise DivtraceValueError(
            f"a compiled region was compiled {most} times, the recompile limit in force "
            f"({limit}, for the shapes of this comparison's passes): past it its code runs "
            f"eager, so this would not compare compiled code. A region whose inputs change "
            f"from call to call (a KV cache handed to each decoder layer) recompiles at "
            f"every call: pass use_cache=False with the input (x={{'input_ids': ..., "
            f"'use_cache': False}}), or give regions=[...] that take tensors only")
    return result
