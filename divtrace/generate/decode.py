"""The token table: greedy decoding of the padded batch and of each prompt alone (or in
chunks), through the model's own ``generate()``, compared step by step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from divtrace.generate.step import generate
from divtrace.measure.fields import INDEX
from divtrace.measure.figures import rel_l2
from divtrace.measure.pair import pair_fields
from divtrace.measure.stats import tolerances
from divtrace.plan.prompts import Prompts, pad

__all__ = ["TOKEN_COLUMNS", "Decoded", "decode", "ended", "token_table"]

#: The columns of :attr:`Generation.table`, one row per (prompt, step).
TOKEN_COLUMNS = ("prompt", "step", "token_batched", "token_split", "same_token",
                 "same_prefix", "logits_mismatch", "logits_rel_l2", "logits_max_abs",
                 "margin", "margin_batched")


@dataclass
class Decoded:
    """One run's greedy decoding of its prompts: per prompt the new tokens and the raw
    logits of each step it took (a prompt stops after its end-of-sequence token)."""

    tokens: dict[int, torch.Tensor]  # per prompt: [steps]
    logits: dict[int, torch.Tensor]  # per prompt: [steps, vocabulary]


def ended(tokens: torch.Tensor, eos: set[int]) -> int:
    """How many of ``tokens`` a prompt generated: up to its first end-of-sequence token."""
    for step, token in enumerate(tokens.tolist()):
        if token in eos:
            return step + 1
    return len(tokens)


def decode(model: nn.Module, prompts: Prompts, chunks: list[tuple[int, int]],
           new_tokens: int, settings: dict[str, Any], eos: set[int],
           advance: Any = None) -> Decoded:
    """Runs ``generate()`` over each chunk of prompts (one chunk: the padded batch)."""
    tokens: dict[int, torch.Tensor] = {}
    logits: dict[int, torch.Tensor] = {}
    for start, stop in chunks:
        inputs, layout = pad(prompts, start, stop)
        try:
            out = generate(model, inputs, new_tokens, settings)
        except Exception as exc:
            run = "batched run" if (start, stop) == (0, len(prompts)) else "split run"
            exc.add_note(f"divtrace: raised in generate() of the {run}, prompts "
                         f"{start}:{stop}")
            raise
        new = out.sequences[:, layout.length:]
        steps = torch.stack(out.logits, 1)  # [rows, steps, vocabulary]
        for row in range(stop - start):
            taken = ended(new[row], eos)
            tokens[start + row] = new[row, :taken]
            logits[start + row] = steps[row, :taken]
        if advance is not None:
            advance()
    return Decoded(tokens, logits)


def _top2(logits: torch.Tensor) -> torch.Tensor:
    top = logits.float().topk(2, dim=-1).values if logits.shape[-1] > 1 else (
        torch.cat([logits.float(), logits.float()], -1))
    return top[..., 0] - top[..., 1]


def _step_figures(b: torch.Tensor, s: torch.Tensor) -> np.ndarray:
    """Per step (a row of logits): mismatch, rel_l2 and max_abs of the batched run's
    logits against the split run's, as every site's are measured (the measure layer's
    fields: NaN against NaN is no mismatch), then each run's margin."""
    rtol, atol = tolerances(b.dtype, None, None)
    width = max(1, b.shape[-1])
    fields = pair_fields(b, s, rtol, atol, width).cpu().numpy()
    mismatch = fields[:, INDEX["mismatch"]] / width
    rel = rel_l2(np.sqrt(fields[:, INDEX["sq_diff"]]), np.sqrt(fields[:, INDEX["sq_ref"]]))
    margins = torch.stack([_top2(s.double()), _top2(b.double())]).cpu().numpy()
    return np.vstack([mismatch, np.asarray(rel), fields[:, INDEX["max_abs"]], margins])


def token_table(batched: Decoded, split: Decoded, samples: list[int]) -> pd.DataFrame:
    """One row per (compared prompt, step both runs took): tokens, whether they and all
    earlier ones agree, and how the step's logits compare (``margin``: the split run's
    top-1 minus top-2 logit; a flip at a small margin is a near tie)."""
    rows: list[dict[str, Any]] = []
    for prompt in samples:
        b_tokens, s_tokens = batched.tokens[prompt], split.tokens[prompt]
        steps = min(len(b_tokens), len(s_tokens))
        b, s = batched.logits[prompt][:steps], split.logits[prompt][:steps]
        if not steps:
            continue
        figures = _step_figures(b, s.to(b.device))
        same = (b_tokens[:steps].cpu() == s_tokens[:steps].cpu()).numpy()
        prefix = np.concatenate([[True], np.cumprod(same)[:-1].astype(bool)])
        for step in range(steps):
            rows.append({
                "prompt": prompt, "step": step, "token_batched": int(b_tokens[step]),
                "token_split": int(s_tokens[step]), "same_token": bool(same[step]),
                "same_prefix": bool(prefix[step]),
                "logits_mismatch": float(figures[0, step]),
                "logits_rel_l2": float(figures[1, step]),
                "logits_max_abs": float(figures[2, step]), "margin": float(figures[3, step]),
                "margin_batched": float(figures[4, step])})
    return pd.DataFrame(rows, columns=list(TOKEN_COLUMNS))
