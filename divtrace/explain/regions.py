"""What ran compiled code (``compare_compiled``): the regions, whose outputs are sites, and
the modules inside them, which run compiled code and have none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from divtrace.compat import compiling
from divtrace.explain.probe import Explained, Judged, Probe, Spec

__all__ = ["Regions"]


class Regions(Probe):
    """``"regions"`` (given by ``compare_compiled``): the compiled regions and how many
    modules inside them were not observed."""

    spec: ClassVar[Spec] = Spec(name="regions")

    def __init__(self, regions: Sequence[str] = (), hidden: int = 0,
                 narrowed: Sequence[Sequence[str]] = ()) -> None:
        self.regions = list(regions)
        self.hidden = int(hidden)
        self.narrowed = [list(step) for step in narrowed]
        self._since = compiling()  # what was compiled before the comparison

    def settings(self) -> dict[str, Any]:
        return {"regions": self.regions, "hidden": self.hidden, "narrowed": self.narrowed}

    def note(self) -> Any:
        graphs, seconds = compiling()
        return self.settings() | {"graphs": graphs - self._since[0],
                                  "compile_seconds": seconds - self._since[1]}

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        found = result.meta.notes.get("regions")
        if not found or not found["regions"]:
            return Explained()
        regions, hidden = found["regions"], found["hidden"]
        shown = ", ".join(f"'{r}'" for r in regions[:3]) + (
            f" and {len(regions) - 3} more" if len(regions) > 3 else "")
        inside = (f"; the {hidden} module{'s' * (hidden != 1)} inside "
                  f"{'them' if len(regions) > 1 else 'it'} ran compiled code, which has no "
                  f"sites: they were not observed") if hidden else ""
        each = f"{shown} ran" if len(regions) == 1 else f"{shown} ({len(regions)} in all) each ran"
        said = [f"Compiled region by region: {each} torch.compile'd code, its output a "
                f"site{inside}.{_compiled(found)}"]
        steps = found.get("narrowed") or []
        if steps:
            said.append(_narrowed(steps))
        return Explained(tuple(said))


def _compiled(found: dict[str, Any]) -> str:
    """`` It compiled 4 graphs in 3.2 s …``: what the comparison compiled, where known."""
    graphs, seconds = found.get("graphs"), found.get("compile_seconds")
    if not graphs:
        return ""
    took = f" in {seconds:.3g} s" if seconds else ""
    return (f" It compiled {graphs} graph{'s' * (graphs != 1)}{took} (one per region "
            f"class, batch shape and dtype, reused by every pass of that shape).")


def _narrowed(steps: list[list[str]]) -> str:
    """Where narrowing down to the module ended, in words."""
    looked = len(steps)
    tail = f" ({looked} more comparison{'s' * (looked > 1)}, children compiled each alone)"
    region, child = steps[-1]
    if child:
        return (f"Down to the module: '{child}', compiled on its own (the rest of "
                f"'{steps[0][0]}' eager), parts the runs; it is the smallest compiled "
                f"module found that does{tail}.")
    found = f"'{region}'" if looked == 1 else f"'{region}' (inside '{steps[0][0]}')"
    return (f"Down to the module: {found} parts the runs only when compiled whole: "
            f"compiled child by child, none of its children does, so it is the code "
            f"that compiles them together (a fusion across them, or its own code "
            f"between them){tail}.")
