"""The independence test's premise inside a mixture-of-experts block: kernels are chosen
from shapes, and the shapes there follow values. Each expert is called on the tokens
routed to it, as many as the other samples send it, so a kernel chosen by that count may
round otherwise; the compared rows can move after the router gave the compared tokens
the same experts, with no dependence by design. Such a move, no larger than the rounding
budget of the site's precision, leaves the test inconclusive from there on (the precision
test decides); one beyond it (a statistic over an expert's tokens) stays batch mixing."""

from __future__ import annotations

from typing import Any

from divtrace.explain.context import Context
from divtrace.explain.rounding import own_budget
from divtrace.record.experts import Routers
from divtrace.words import sci

__all__ = ["routed_move", "routed_sentence"]


def routed_move(ctx: Context, tested: set[str], moved: dict[str, float], routers: Routers
                ) -> dict[str, Any] | None:
    """The first moved site (of the measured run's, in order), where it lies in a block of
    ``routers`` after a router whose chosen experts were ``tested`` and did not move, and
    moved (``moved``: how far, rel_l2) within its precision's budget: ``{"site",
    "block", "rel_l2"}``; None otherwise."""
    seen = _Routed(routers.names(ctx.model), routers.experts)
    for measured in ctx.meter.sites:
        key, module = measured.site.key, measured.site.module
        if key not in tested:
            continue
        if key not in moved:
            seen.see(key)
            continue
        far = moved[key]  # NaN where not measured: not known to be rounding
        if seen.after_router(module) and far <= own_budget(
                str(measured.dtype).removeprefix("torch.")):
            return {"site": key, "block": seen.block(module), "rel_l2": far}
        return None
    return None


def routed_sentence(routed: dict[str, Any]) -> str:
    """Why the test is inconclusive from ``routed`` (:func:`routed_move`) on."""
    return (f"inconclusive from '{routed['site']}' on — at the router of the "
            f"mixture-of-experts block '{routed['block']}' the compared tokens went to the "
            f"same experts in every pass, and the rows move after it by rel_l2 "
            f"{sci(routed['rel_l2'])}, no more than rounding can give: its experts are "
            f"called on as many tokens as the other samples send them, so a kernel chosen "
            f"by that count may round otherwise, and a dependence on the other samples "
            f"cannot be told from it.")


class _Routed:
    """Reads the sites in order: whether the first moved one lies in a mixture-of-experts
    block after its router, whose chosen experts were tested and did not move (the
    compared tokens went to the same experts). A router's block is the module that holds
    it (:meth:`~divtrace.record.experts.Routers.blocks`)."""

    def __init__(self, routers: tuple[str, ...], experts: str) -> None:
        self.routers = routers
        self.chosen = {f"{r}/{experts}": r for r in routers}
        self.unmoved: set[str] = set()  # routers whose chosen experts were tested, unmoved

    def block(self, module: str) -> str | None:
        """The innermost block that holds ``module`` (or is it)."""
        inside = [b for b in {r.rpartition(".")[0] for r in self.routers}
                  if module == b or module.startswith(f"{b}.")]
        return max(inside, key=len) if inside else None

    def see(self, key: str) -> None:
        """A tested site whose rows did not move."""
        if key in self.chosen:
            self.unmoved.add(self.chosen[key])

    def after_router(self, module: str) -> bool:
        """Whether ``module`` lies in a block, not in its router, after the chosen experts
        of one of its routers were seen unmoved."""
        block = self.block(module)
        if block is None or any(module == r or module.startswith(f"{r}.")
                                for r in self.routers):
            return False
        return any(r.rpartition(".")[0] == block for r in self.unmoved)
