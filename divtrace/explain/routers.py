"""How a mixture of experts' router scores its experts, and the figures per token of two
runs' choices (:func:`figures`): the margins, whether each run chose its own top k, the
logits' difference in units of their rounding; and a router site's rows of both runs per
compared sample (:func:`both_rows`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from divtrace.explain.context import Context

__all__ = ["FIGURES", "both_rows", "figures", "grouped_sigmoid_scores", "scorer",
           "softmax_scores"]

#: The figures per token, in order (then each run's chosen experts and each run's k
#: best-scored ones).
FIGURES = ("flipped", "margin_a", "margin_b", "by_scores_a", "by_scores_b", "delta", "ulp")


def _margin(logits: torch.Tensor, chosen: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the k-th largest score minus the (k+1)-th, and whether ``chosen`` (k
    experts per token) are the top k of the scores ``logits`` (float64 values of
    ``dtype`` ones), ties and two units of ``dtype``'s rounding allowed (the scores are
    recomputed, by kernels that may round otherwise than the router's)."""
    k = chosen.shape[-1]
    ranked = logits.sort(-1, descending=True).values
    margin = ranked[:, k - 1] - ranked[:, k] if logits.shape[-1] > k else (
        torch.full_like(ranked[:, 0], math.inf))
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, chosen, True)
    low = torch.where(mask, logits, torch.full_like(logits, math.inf)).amin(-1)
    high = torch.where(mask, torch.full_like(logits, -math.inf), logits).amax(-1)
    slack = 2 * _spacing(high.abs().nan_to_num(0.0, 0.0, 0.0), dtype)
    return margin, low >= high - slack


def softmax_scores(logits: torch.Tensor) -> torch.Tensor:
    """The scores a softmax router ranks experts by (Mixtral's, Qwen2-MoE's and
    Qwen3-MoE's ``TopKRouter``: a softmax of the logits in float32), as it computes them."""
    return torch.softmax(logits.float(), -1)


def grouped_sigmoid_scores(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The scores DeepSeek-V3's router (``DeepseekV3TopkRouter``) ranks experts by, as it
    computes them: the sigmoid of the float32 logits plus its bias, every expert outside
    the ``topk_group`` groups of the best two-expert sums set to minus infinity."""
    found: dict[str, Any] = {name: getattr(module, name) for name in (
        "num_group", "topk_group", "num_experts", "e_score_correction_bias")}
    groups, chosen, experts = (int(found[n]) for n in ("num_group", "topk_group",
                                                       "num_experts"))
    bias: torch.Tensor = found["e_score_correction_bias"]

    def scores(logits: torch.Tensor) -> torch.Tensor:
        found = logits.float().sigmoid() + bias.float().to(logits.device)
        per_group = found.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(-1)
        best = per_group.topk(chosen, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(per_group).scatter_(1, best, 1).bool()
        kept = kept.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
        return found.masked_fill(~kept, -math.inf)
    return scores


def scorer(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How ``module``, a router, scores its experts from its logits; None where divtrace
    does not know it (its margins are then read on the logits)."""
    name = type(module).__name__.lower()
    if name.startswith("deepseek") and all(hasattr(module, a) for a in (
            "e_score_correction_bias", "num_group", "topk_group", "num_experts")):
        return grouped_sigmoid_scores(module)
    if name.endswith("topkrouter") and not name.startswith("deepseek"):
        return softmax_scores
    return None


def figures(a_logits: torch.Tensor, b_logits: torch.Tensor, a_chosen: torch.Tensor,
            b_chosen: torch.Tensor,
            scores: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Per token (rows), float64: :data:`FIGURES`, then each run's chosen experts and
    then each run's k best-scored ones, in order of index (k each); the logits
    ``(tokens, experts)``, the chosen experts ``(tokens, k)``, each run's; ``scores``: what
    the router ranks by (None: its logits, and whether a run chose by them is not judged:
    NaN)."""
    b_logits = b_logits.to(a_logits.device)
    raw_a, raw_b = a_logits.double(), b_logits.double()
    delta = (raw_a - raw_b).abs().amax(-1)  # the logits', in units of their dtype's rounding
    ulp = _spacing(torch.maximum(raw_a.abs().amax(-1), raw_b.abs().amax(-1)), a_logits.dtype)
    if scores is not None:
        a_logits, b_logits = scores(a_logits), scores(b_logits)
    a64, b64 = a_logits.double(), b_logits.double()
    a_set = a_chosen.sort(-1).values
    b_set = b_chosen.to(a_chosen.device).sort(-1).values
    flipped = (a_set != b_set).any(-1)
    margin_a, scores_a = _margin(a64, a_chosen.long(), a_logits.dtype)
    margin_b, scores_b = _margin(b64, b_chosen.to(a_chosen.device).long(), a_logits.dtype)
    judged = (lambda by: by.double()) if scores is not None else (
        lambda by: torch.full_like(delta, math.nan))
    return torch.cat([torch.stack([flipped.double(), margin_a, margin_b, judged(scores_a),
                                   judged(scores_b), delta, ulp], 1),
                      a_set.double(), b_set.double(), _top(a64, a_set.shape[-1]),
                      _top(b64, b_set.shape[-1])], 1)


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's k best-scored experts, in order of index."""
    return scores.topk(k, -1).indices.sort(-1).values.double()


def _spacing(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring numbers of ``dtype`` at ``value`` (a unit of its
    rounding there)."""
    if not dtype.is_floating_point:
        return torch.ones_like(value)
    info = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(value.clamp_min(info.tiny)))
    return torch.exp2(exponent) * info.eps


def both_rows(ctx: Context, key: str, tensor: torch.Tensor, rows: torch.Tensor
           ) -> list[tuple[int, int, torch.Tensor, torch.Tensor]] | None:
    """Per compared sample: (sample, its first token, run a's rows, run b's rows), each
    ``(tokens, ...)``; None where the site is not laid out so."""
    part_of = getattr(ctx.meter, "part_of", None)  # a meter of prompts' tokens
    stored = ctx.store.rows.get(key)
    if part_of is not None and stored is not None and stored.parts is not None:
        batch = ctx.plan.batch
        step = int(getattr(batch, "step", 0) or 0)
        found = []
        for slot, sample in enumerate(ctx.store.samples):
            a = stored.parts[slot]
            if a is None or a.dim() < 2:
                return None
            b = part_of(key, tensor, sample, tuple(a.shape))
            if b.shape != a.shape:
                return None
            if stored.firsts is not None:
                first = stored.firsts[slot]
            else:  # a generation step's call: its tokens end at the step's last position
                source = getattr(batch, "source", None)
                length = int(source.prompts[sample].numel()) if step and source else a.shape[0]
                first = max(length + step - a.shape[0], 0)
            found.append((sample, first, a, b))
        return found
    b = ctx.pick(tensor)
    if b.shape != rows.shape or rows.dim() < 3:
        return None
    return [(sample, 0, rows[slot], b[slot]) for slot, sample in enumerate(ctx.store.samples)]
