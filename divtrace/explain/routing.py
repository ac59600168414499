"""Routing flips in a mixture of experts (``"routing"``, on by default; it works only
where the model has mixture-of-experts blocks): at each block's router, the tokens whose
set of chosen experts differs between the runs, with each run's margin.

A router (Hugging Face's ``mlp.gate``: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) returns
its logits (path ``0``) and the chosen experts (path ``2``) per token; both are sites, read
per token (:mod:`divtrace.record.experts`). A router of one's own is named by a pattern,
with the paths of its output and what it ranks by: ``Routing("*.moe.router", logits="2",
experts="1", scores=lambda logits: logits.softmax(-1))``. Per flipped token, in each run:

* the **margin**: its k-th largest logit minus its (k+1)-th, the gap its choice stood on;
* whether the run chose **by its scores**: its chosen experts are the top k of its own
  logits (ties allowed);
* **Δ**: the largest difference between the runs' logits at that token, also in units of
  the logits' rounding (the spacing of their dtype at their size).

The scores are what the router ranks by, computed as it computes them: for a softmax
router, the softmax of the logits in float32; for DeepSeek-V3's, the sigmoid plus its bias
within the groups it kept; for a router divtrace does not know, what ``scores=`` gives,
else the logits (and whether a run chose by them is then not judged). When both runs chose by their
scores, the flip is a near tie that the runs' difference at that token tipped, and
whether that difference is rounding is what the verdict's tests judge at the router's
logits. A run that chose otherwise than the top k of its own scores (an expert at its
capacity, dropping) is said so, with the experts that turned tokens away: that flip is
not the scores' doing. The scoring and the figures per token: :mod:`.routers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.align.status import Status
from divtrace.errors import DivtraceValueError
from divtrace.explain.context import Context
from divtrace.explain.probe import Explained, Hooks, Judged, Probe, Spec
from divtrace.explain.routers import FIGURES, both_rows, figures, scorer
from divtrace.measure.host import Deferred, Host
from divtrace.measure.measured import Measured
from divtrace.record.experts import Routers
from divtrace.words import the

__all__ = ["Routing", "routed_calls", "routers_in"]

#: Flipped tokens kept in the note per router, for the sentences and the user.
KEPT = 64

#: The paths of the model's output read as its tokens' result.
_OUTPUT = ("logits", "")


class Routing(Probe):
    """``"routing"``: the routing flips at each mixture-of-experts block's router."""

    spec: ClassVar[Spec] = Spec(name="routing", default=True)

    def __init__(self, routers: str | type[nn.Module] | Routers | None = None, *,
                 logits: str = "0", weights: str | None = "1", experts: str = "2",
                 scores: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``routers``: a glob on the routers' qualified names or their type (None: each
        Hugging Face mixture-of-experts block's ``gate``); ``logits``, ``weights`` and
        ``experts``: where a router's output holds them (:class:`~divtrace.Routers`);
        ``scores``: what a router ranks its experts by, from its logits ``(tokens,
        experts)``, computed as it computes it (None: as divtrace knows the router's type;
        for one it does not know, the logits, and whether a run chose by them is not
        judged)."""
        self.routers = routers if isinstance(routers, Routers) else Routers(
            routers, logits, weights, experts)
        self.scores = scores
        self._routers: set[str] | None = None
        self._seen: dict[str, dict[str, str]] = {}  # router -> path -> status
        self._scorers: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {}
        self._held: dict[tuple[str, int], dict[str, list[tuple[int, int, Any, Any]]]] = {}
        self._found: dict[str, tuple[Deferred, list[tuple[int, int, int]], int]] = {}
        self._squares: tuple[Deferred, list[tuple[int, int, int]]] | None = None
        self._host = Host()
        self.found: dict[str, Any] | None = None

    def settings(self) -> dict[str, Any]:
        pattern = self.routers.pattern
        return {"routers": pattern if isinstance(pattern, str | None) else pattern.__name__,
                **self.routers.paths(),
                "scores": None if self.scores is None else getattr(
                    self.scores, "__qualname__", type(self.scores).__name__)}

    def check(self, model: nn.Module) -> bool:
        found = self.routers.names(model)  # left out of models without a router
        if not found and self.routers.pattern is not None:
            names = [name for name, _ in model.named_modules() if name][:6]
            raise DivtraceValueError(
                f"Routing(routers={self.routers.described()}) matches no module of "
                f"{type(model).__name__}; give a glob on qualified names as "
                f"model.named_modules() lists them (e.g. {', '.join(names) or '(none)'}) "
                f"or the routers' module type")
        return bool(found)

    def hooks(self) -> Hooks:
        return Hooks(site=self._site, after=self._after)

    def _site(self, ctx: Context, measured: Measured, tensor: torch.Tensor,
              rows: torch.Tensor) -> None:
        site = measured.site
        if self._routers is None:
            named = dict(ctx.model.named_modules())
            self._routers = set(self.routers.names(ctx.model))
            self._scorers = {name: self.scores or scorer(named[name]) for name in self._routers}
        if site.module == ROOT and site.call == 0 and site.path in _OUTPUT and not site.op and (
                self._routers and measured.status == Status.OK):
            self._output(ctx, site.key, tensor, rows)
            return
        if site.module not in self._routers or site.op:
            return
        self._seen.setdefault(site.module, {})[site.path] = str(measured.status)
        if site.path not in (self.routers.logits, self.routers.experts) or (
                measured.status != Status.OK):
            return
        pairs = both_rows(ctx, site.key, tensor, rows)
        if pairs is None:
            return
        held = self._held.setdefault((site.module, site.call), {})  # in either order
        held[site.path] = pairs
        if len(held) < 2:
            return
        del self._held[site.module, site.call]
        logits, pairs = held[self.routers.logits], held[self.routers.experts]
        if len(logits) != len(pairs):
            return
        found, spans = [], []
        for (sample, first, a_logits, b_logits), (_, _, a_chosen, b_chosen) in zip(
                logits, pairs, strict=True):
            if a_logits.shape[0] != a_chosen.shape[0] or a_chosen.dim() != 2:
                return
            found.append(figures(a_logits, b_logits, a_chosen, b_chosen,
                                 self._scorers.get(site.module)))
            spans.append((sample, first, a_chosen.shape[0]))
        key = site.module if site.call == 0 else f"{site.module}#{site.call}"
        self._found[key] = (self._host.add(torch.cat(found)), spans,
                            int(logits[0][2].shape[-1]))

    def _output(self, ctx: Context, key: str, tensor: torch.Tensor, rows: torch.Tensor) -> None:
        """The model's output: each compared token's squared difference between the runs,
        for the share of it on the flipped tokens."""
        pairs = both_rows(ctx, key, tensor, rows)
        if pairs is None:
            return
        squares = [(b.double() - a.to(b.device).double()).flatten(1).square().sum(1)
                   for _, _, a, b in pairs]
        self._squares = (self._host.add(torch.cat(squares)),
                         [(sample, first, a.shape[0]) for sample, first, a, _ in pairs])

    def _after(self, ctx: Context) -> None:
        blocks = list(self.routers.blocks(ctx.model))
        if not self._found:
            first = next(iter(self._seen), None)
            self.found = {"blocks": blocks, "routers": {}, "output": None,
                          "paths": self.routers.paths(), "unread": None if first is None
                          else {"router": first, "seen": self._seen[first]}}
            return
        self._host.fetch()
        routers: dict[str, Any] = {}
        flipped_tokens: set[tuple[int, int]] = set()
        for key, (deferred, spans, experts) in self._found.items():
            values = np.asarray(deferred.get(), dtype=float)
            where = [(sample, first + t) for sample, first, count in spans
                     for t in range(count)]
            flipped = np.flatnonzero(values[:, 0] > 0)
            flipped_tokens.update(where[i] for i in flipped)
            k = (values.shape[1] - len(FIGURES)) // 4
            sets = values[:, len(FIGURES):].astype(int)  # chosen a, b; best-scored a, b
            kept = [dict(zip(("sample", "token"), where[i], strict=True)) | {
                name: (_judged(values[i, j]) if name.startswith("by_") else _finite(values[i, j]))
                for j, name in enumerate(FIGURES) if name != "flipped"} | {
                "experts_a": sets[i, :k].tolist(), "experts_b": sets[i, k:2 * k].tolist()}
                for i in flipped[:KEPT]]
            # the experts a run scored within its top k but did not choose: they turned
            # the token away (full, or another rule)
            lost = [e for i in flipped for run in (0, 1) if values[i, 3 + run] == 0
                    for e in set(sets[i, (2 + run) * k:(3 + run) * k]) - set(
                        sets[i, run * k:(run + 1) * k])]
            routers[key] = {"tokens": len(where), "experts": experts,
                            "flips": int(flipped.size), "flipped": kept,
                            "not_by_scores": int(((values[flipped, 3] == 0)
                                                  | (values[flipped, 4] == 0)).sum()),
                            "experts_not_by_scores": sorted(
                                set(lost), key=lambda e: (-lost.count(e), e))}
        self.found = {"blocks": blocks, "routers": routers, "output": self._share(
            flipped_tokens), "paths": self.routers.paths(), "unread": None}

    def _share(self, flipped: set[tuple[int, int]]) -> dict[str, Any] | None:
        """At the output: the compared tokens, those flipped at some router, and the share
        of the runs' squared difference that those carry."""
        if self._squares is None:
            return None
        deferred, spans = self._squares
        squares = np.asarray(deferred.get(), dtype=float)
        where = [(sample, first + t) for sample, first, count in spans for t in range(count)]
        on = np.asarray([w in flipped for w in where], dtype=bool)
        total = float(squares.sum())
        return {"tokens": len(where), "flipped": int(on.sum()),
                "share": float(squares[on].sum()) / total if total > 0 else None}

    def note(self) -> Any:
        return self.found

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        found_all = result.meta.notes.get("routing") or {}
        found = found_all.get("routers")
        routed = _routed(result.table, result.meta.notes)
        if not found:
            return Explained((*_unread(found_all), *routed))
        names = result.meta.names
        flipped = {key: router for key, router in found.items() if router["flips"]}
        if not flipped:
            counts = sorted({router["tokens"] for router in found.values()})
            each = (f"each of its {counts[0]} compared tokens" if len(counts) == 1 else
                    "each compared token")
            return Explained((f"Routing: at each of the {len(found)} routers, {each} went "
                              f"to the same experts in both runs.", *routed))
        first_key = next(iter(flipped))
        first = flipped[first_key]["flipped"][0]
        per = ", ".join(f"'{key}' {router['flips']} of {router['tokens']}"
                        for key, router in flipped.items())
        total = sum(r["flips"] for r in flipped.values())
        said = [f"Routing flips: {total} token{'s' * (total != 1)} went to another set of "
                f"experts in {the(names[1])} than in {the(names[0])} ({per}); the first at "
                f"'{first_key}', sample {first['sample']}, token "
                f"{first['token']}: {_flip(first, names)}."]
        out = found_all.get("output")
        if out and out["flipped"] and out["share"] is not None:
            said.append(f"At the output the {out['flipped']} token{'s' * (out['flipped'] != 1)} "
                        f"flipped at some router ({out['flipped'] / out['tokens']:.1%} of the "
                        f"{out['tokens']} compared) carry {out['share']:.1%} of the runs' "
                        f"squared difference.")
        odd = {key: router for key, router in flipped.items() if router["not_by_scores"]}
        unjudged = [key for key, router in flipped.items()
                    if router["flipped"] and router["flipped"][0]["by_scores_a"] is None]
        for key, router in odd.items():
            count, away = router["not_by_scores"], router["experts_not_by_scores"][:4]
            experts = (f"expert{'s' * (len(away) != 1)} {', '.join(map(str, away))} "
                       f"turned away tokens {'their' if len(away) != 1 else 'its'} scores "
                       f"sent {'them' if len(away) != 1 else 'it'}")
            odd_tokens = [f for f in router["flipped"]
                          if f["by_scores_a"] is False or f["by_scores_b"] is False][:3]
            shown = ", ".join(f"sample {f['sample']} token {f['token']}" for f in odd_tokens)
            said.append(f"At '{key}' a run chose other experts than the top k of its own "
                        f"scores for {count} token{'s' * (count != 1)} ({shown}"
                        f"{', ...' if count > len(odd_tokens) else ''}): {experts}. Those "
                        f"flips are not the scores' doing (an expert's capacity, dropping or "
                        f"another rule chose).")
        if unjudged and not odd:
            said.append("How the router at " + ", ".join(f"'{k}'" for k in unjudged) +
                        " scores its experts is not known to divtrace: its margins are read "
                        "on its logits, and whether each run chose by them is not judged.")
        elif not odd:
            said.append("Every flip is a near tie: both runs chose the top k of their own "
                        "scores, so the runs' difference of the scores at that token tipped "
                        "the choice; whether that difference is rounding is what the "
                        "verdict's tests judge.")
        return Explained((*said, *routed))


def routers_in(probes: Any) -> Routers:
    """The routers of the routing probe among ``probes`` (``explain=`` entries or
    probes); Hugging Face's where none is given."""
    return next((p.routers for p in probes if isinstance(p, Routing)), Routers())


def _unread(found: dict[str, Any]) -> tuple[str, ...]:
    """Why no router's choice was compared, where the routers ran but were not read."""
    unread = found.get("unread")
    if not unread:
        return ()
    paths, seen = found["paths"], unread["seen"]
    shown = ", ".join(f"'{path}' ({status})" for path, status in list(seen.items())[:6])
    return (f"Routing was not compared: router '{unread['router']}' gave the sites {shown}, "
            f"and divtrace reads its logits at '{paths['logits']}' and its chosen experts "
            f"at '{paths['experts']}', both compared per token; name the paths of its "
            f"output: Routing(routers=..., logits=..., experts=...).",)


def routed_calls(table: Any, notes: Any) -> Any:
    """The rows of ``table`` for module calls that one run made and the other did not,
    inside the mixture-of-experts blocks the routing note (``notes["routing"]``) names:
    each pass calls the experts its own tokens chose, so these follow the routing."""
    return _inside(table[table["status"].isin(["missing_in_split", "missing_in_batched"])
                         & (table["op"] == "")], notes)


def _inside(rows: Any, notes: Any) -> Any:
    """Those of ``rows`` inside the mixture-of-experts blocks ``notes["routing"]`` names."""
    inside = tuple(f"{block}." for block in (notes.get("routing") or {}).get("blocks", ()))
    return rows[rows["module"].str.startswith(inside)] if inside else rows.iloc[:0]


def _routed(table: Any, notes: Any) -> tuple[str, ...]:
    """Sentences on :func:`routed_calls` and on the calls inside the blocks whose rows are
    the tokens routed to them, not every token (none: no such call)."""
    subsets = _inside(table[(table["status"] == "unbatched") & (table["op"] == "")], notes)
    said = [(routed_calls(table, notes), "ran in one run only ({first}): a pass calls the "
             "experts its own tokens chose, so these calls follow the routing, which is "
             "compared token by token at the routers; they are not taken for control flow "
             "that depends on the batch."),
            (subsets, "({first}) had rows that are not one per token, as an expert called "
             "on the tokens routed to it has; they are not compared row by row: the "
             "routing is compared token by token at the routers, and the block's output.")]
    return tuple(f"{len(rows)} call{'s' * (len(rows) != 1)} inside the mixture-of-experts "
                 f"blocks " + text.format(first=f"the first '{rows.iloc[0]['site']}'")
                 for rows, text in said if not rows.empty)


def _finite(value: float) -> float | None:
    """``value``, None where it is not finite (a margin with no (k+1)-th expert): the
    note stays JSON."""
    return float(value) if math.isfinite(value) else None


def _judged(value: float) -> bool | None:
    return None if math.isnan(value) else bool(value)


def _flip(flip: dict[str, Any], names: tuple[str, str]) -> str:
    """One flip's margins, in words."""
    units = flip["delta"] / (flip["ulp"] or 1.0)
    shown = [("none" if m is None else f"{m:.3g}") for m in (flip["margin_a"], flip["margin_b"])]
    return (f"margins {shown[0]} in {the(names[0])} and {shown[1]} "
            f"in {the(names[1])} "
            f"(k-th minus (k+1)-th score), the runs' logits there {flip['delta']:.3g} apart "
            f"({units:.3g} unit{'s' * (units != 1)} of their rounding), experts "
            f"{flip['experts_a']} against {flip['experts_b']}")
