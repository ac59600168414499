"""Figures per token (``explain=["tokens"]``, on by default in ``compare_rollout``): at
each block of the model (a member of a module list: a decoder layer) each compared
token's error, and at the output the log-probability each run gives every next token —
the figure reinforcement-learning users watch between a rollout and a trainer."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from divtrace.align.sites import ROOT
from divtrace.align.status import Status
from divtrace.errors import DivtraceValueError
from divtrace.explain.context import Context
from divtrace.explain.probe import Explained, Hooks, Judged, Probe, Spec
from divtrace.explain.view import TableView
from divtrace.measure.host import Deferred, Host
from divtrace.measure.measured import Measured
from divtrace.words import the

__all__ = ["PerToken", "blocks"]

#: The output tensors whose last axis is read as logits over the vocabulary.
_LOGITS = ("logits", "")


def blocks(model: nn.Module) -> set[str]:
    """The qualified names of the model's blocks: the members of its module lists (a
    language model's decoder layers)."""
    return {f"{name}.{child}" if name else child
            for name, module in model.named_modules()
            if isinstance(module, nn.ModuleList) for child, _ in module.named_children()}


def _per_token(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Each token's rel_l2 of ``b`` against ``a`` (rows: tokens), in float64; a token
    that is zero in ``a`` and differs is infinitely far."""
    a64, b64 = a.to(b.device).double().flatten(1), b.double().flatten(1)
    diff = torch.linalg.vector_norm(b64 - a64, dim=1)
    ref = torch.linalg.vector_norm(a64, dim=1)
    return torch.where(diff == 0, torch.zeros_like(diff), diff / ref)


class PerToken(Probe):
    """``PerToken(tolerance)`` (``"tokens"``): each compared token's error at every block
    of the model, and at the output the log-probabilities of the next tokens in both
    runs (``tolerance``: the |Δlogprob| counted as too far)."""

    spec: ClassVar[Spec] = Spec(name="tokens", columns=("token_rel_l2_max",),
                                shown=("token_rel_l2_max",))

    def __init__(self, tolerance: float = 1e-3) -> None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not (
                tolerance > 0 and math.isfinite(tolerance)):
            raise DivtraceValueError(
                f"PerToken(tolerance) takes a positive |Δlogprob|, e.g. 1e-3; got "
                f"{tolerance!r}")
        self.tolerance = float(tolerance)
        self._blocks: set[str] | None = None
        self._sites: dict[str, tuple[Deferred, list[tuple[int, int, int]]]] = {}
        self._logits: tuple[Deferred, list[tuple[int, int, int]], Deferred] | None = None
        self.found: dict[str, Any] | None = None
        self._host = Host()  # its own transfer, after run b: the figures go to the meta

    def settings(self) -> dict[str, Any]:
        return {"tolerance": self.tolerance}

    def hooks(self) -> Hooks:
        return Hooks(site=self._site, after=self._after)

    def _site(self, ctx: Context, measured: Measured, tensor: torch.Tensor,
              rows: torch.Tensor) -> None:
        batch = ctx.plan.batch
        part_of = getattr(ctx.meter, "part_of", None)  # a meter of prompts' tokens
        if measured.status != Status.OK or part_of is None or (
                getattr(batch, "prompts", None) is None):
            return
        site = measured.site
        if self._blocks is None:
            self._blocks = blocks(ctx.model)
        logits = site.module == ROOT and site.call == 0 and site.path in _LOGITS and (
            not site.op)
        if not logits and not (site.module in self._blocks and site.path in ("", "0")
                               and not site.op):
            return
        stored = ctx.store.rows.get(site.key)
        if stored is None or stored.parts is None:
            return
        firsts = stored.firsts or [0] * len(stored.parts)
        spans, figures = [], []
        pairs = []
        for slot, sample in enumerate(ctx.store.samples):
            a = stored.parts[slot]
            if a is None or a.dim() == 0:
                return
            b = part_of(site.key, tensor, sample, tuple(a.shape))
            if b.shape != a.shape:
                return
            pairs.append((sample, firsts[slot], a, b))
        if logits:
            self._logprobs(batch, pairs)
            return
        for sample, first, a, b in pairs:
            spans.append((sample, first, a.shape[0]))
            figures.append(_per_token(b, a))
        self._sites[site.key] = (self._host.add(torch.cat(figures)), spans)

    def _logprobs(self, batch: Any, pairs: list[Any]) -> None:
        """Per compared token with a next token: its log-probability in each run (from
        float64 logits) and each run's most likely token."""
        starts = getattr(batch, "starts", None)
        figures, spans, targets = [], [], []
        for sample, first, a, b in pairs:
            tokens = batch.source.prompts[sample]
            low = first if starts is None else max(first, starts[sample] - 1)
            high = min(first + a.shape[0], tokens.numel() - 1)
            if high <= low or a.dim() != 2:
                continue
            target = tokens[low + 1:high + 1].to(b.device).unsqueeze(1)
            la = torch.log_softmax(a[low - first:high - first].to(b.device).double(), -1)
            lb = torch.log_softmax(b[low - first:high - first].double(), -1)
            figures.append(torch.cat([la.gather(1, target), lb.gather(1, target),
                                      la.argmax(1, keepdim=True).double(),
                                      lb.argmax(1, keepdim=True).double()], 1))
            spans.append((sample, low + 1, high - low))
            targets.append(target.squeeze(1))
        if figures:
            self._logits = (self._host.add(torch.cat(figures)), spans,
                            self._host.add(torch.cat(targets).double()))

    def _after(self, ctx: Context) -> None:
        """The figures fetched (one transfer of their own) and laid out per token."""
        if not self._sites and self._logits is None:
            return
        self._host.fetch()
        layers: dict[str, Any] = {}
        for key, (deferred, spans) in self._sites.items():
            values = np.asarray(deferred.get(), dtype=float)
            prompt, position = [], []
            for sample, first, count in spans:
                prompt += [sample] * count
                position += list(range(first, first + count))
            layers[key] = {"prompt": prompt, "position": position,
                           "rel_l2": values.tolist()}
        self.found = {"tolerance": self.tolerance, "layers": layers,
                      "logprobs": self._logprob_table()}

    def fill(self, rows: list[dict[str, Any]], view: TableView) -> None:
        layers = {} if self.found is None else self.found["layers"]
        for row in rows:
            found = layers.get(row["site"])
            row["token_rel_l2_max"] = (float(np.max(found["rel_l2"])) if found
                                       and found["rel_l2"] else math.nan)

    def _logprob_table(self) -> dict[str, list[Any]] | None:
        if self._logits is None:
            return None
        figures, spans, targets = self._logits
        values = np.asarray(figures.get(), dtype=float)
        prompt, position = [], []
        for sample, first, count in spans:
            prompt += [sample] * count
            position += list(range(first, first + count))
        return {"prompt": prompt, "position": position,
                "token": np.asarray(targets.get()).astype(int).tolist(),
                "logprob_a": values[:, 0].tolist(), "logprob_b": values[:, 1].tolist(),
                "argmax_a": values[:, 2].astype(int).tolist(),
                "argmax_b": values[:, 3].astype(int).tolist()}

    def note(self) -> Any:
        return self.found

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        found = result.meta.notes.get("tokens")
        if not found or not found.get("logprobs"):
            return Explained()
        table = found["logprobs"]
        a, b = np.asarray(table["logprob_a"]), np.asarray(table["logprob_b"])
        delta = np.abs(a - b)
        count = delta.size
        names = result.meta.names
        if not (delta > 0).any():
            said = (f"The log-probabilities of the {count} next tokens are identical in "
                    f"{the(names[1])} and {the(names[0])}.")
            return Explained((said,))
        worst = int(np.argmax(delta))
        over = int((delta > found["tolerance"]).sum())
        flips = int((np.asarray(table["argmax_a"]) != np.asarray(table["argmax_b"])).sum())
        said = (f"The log-probabilities of the {count} next tokens differ by at most "
                f"{delta[worst]:.3g} (prompt {table['prompt'][worst]}, position "
                f"{table['position'][worst]}), {delta.mean():.3g} on average; {over} of "
                f"{count} ({over / count:.1%}) beyond |Δlogprob| {found['tolerance']:g}; "
                f"{_flips(flips, count)}.")
        return Explained((said,))


def _flips(flips: int, count: int) -> str:
    if not flips:
        return "the most likely token is the same in both runs at every position"
    return (f"at {flips} of {count} positions the runs' most likely tokens differ "
            f"(argmax flips)")
