"""The result of ``compare_generate()``: the token table, where each prompt's runs part,
and the layer-wise comparison of any step."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pandas as pd
from torch import nn

from divtrace.errors import DivtraceValueError, DivtraceWarning
from divtrace.generate.step import GenerationStep
from divtrace.plan.prompts import Prompts, ragged_input
from divtrace.report.result import Result, rows_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from divtrace.report.comparison import Comparison

__all__ = ["Generation"]


@dataclass(frozen=True)
class Generation(Result):
    """How greedy decoding of prompts in a batch and alone compares, step by step.

    Attributes:
        table: One row per (prompt, step) both runs took: ``prompt``, ``step``,
            ``token_batched``, ``token_split``, ``same_token``, ``same_prefix`` (every
            earlier token agreed: both runs saw the same input), ``logits_mismatch``,
            ``logits_rel_l2``, ``logits_max_abs``, ``margin`` (the split run's top-1 minus
            top-2 logit) and ``margin_batched``.
        prompts: The prompts, as padded for the batched run.
        settings: What ``generate()`` got besides the prompts (pad and end tokens).
    """

    table: pd.DataFrame
    prompts: Prompts
    settings: dict[str, Any]
    chunk: int
    samples: tuple[int, ...]
    new_tokens: int
    _model: nn.Module | None = field(repr=False)
    _options: dict[str, Any] = field(default_factory=dict, repr=False)
    document: ClassVar[str] = "generation"
    title: ClassVar[str] = "divtrace generation"

    def _fields(self) -> dict[str, Any]:
        """The token table, the prompts and the settings (the model is not saved, so
        ``at()`` needs a fresh run)."""
        from divtrace.report import saved

        prompts = self.prompts
        return {
            "table": saved.frame_to_json(self.table),
            "prompts": [p.tolist() for p in prompts.prompts],
            "padding_side": prompts.padding_side, "pad_token_id": prompts.pad_token_id,
            "settings": self.settings, "chunk": self.chunk, "samples": list(self.samples),
            "new_tokens": self.new_tokens}

    @classmethod
    def _restored(cls, doc: dict[str, Any],
                  comparison: Callable[[dict[str, Any]], Comparison]) -> Generation:
        import torch

        from divtrace.report import saved

        prompts = Prompts([torch.tensor(p) for p in doc["prompts"]],
                          padding_side=doc["padding_side"], pad_token_id=doc["pad_token_id"],
                          position_ids=False)
        return cls(saved.frame_from_json(doc["table"]), prompts, dict(doc["settings"]),
                   int(doc["chunk"]), tuple(doc["samples"]), int(doc["new_tokens"]), None)

    @property
    def sites(self) -> pd.DataFrame:
        """The compact view: :attr:`per_prompt`."""
        return self.per_prompt

    def rows(self) -> pd.DataFrame:
        """A row per (prompt, step), named ``prompt P, step S``: its logits' figures."""
        table = self.table
        return rows_of(table, "prompt {prompt}, step {step}", module_type="logits",
                       mismatch="logits_mismatch", rel_l2="logits_rel_l2")

    @property
    def first_divergence(self) -> pd.Series | None:
        """The first row of :attr:`table`, in generation order (step, then prompt), whose
        logits are not bit-identical (None if none); :attr:`per_prompt` says it for each
        prompt."""
        moved = self.table[self.table["logits_mismatch"] > 0]
        if moved.empty:
            return None
        return moved.sort_values(["step", "prompt"], kind="stable").iloc[0]

    @property
    def per_prompt(self) -> pd.DataFrame:
        """Per compared prompt: its length, the steps compared, the first step whose tokens
        differ (``<NA>``: none) with the margin there, and the first whose logits differ."""
        rows = []
        for prompt in self.samples:
            mine = self.table[self.table["prompt"] == prompt]
            flips = mine[~mine["same_token"]]
            moved = mine[mine["logits_mismatch"] > 0]
            rows.append({
                "prompt": prompt, "length": self.prompts.lengths[prompt], "steps": len(mine),
                "first_token_split": flips["step"].iloc[0] if len(flips) else pd.NA,
                "margin_at_split": flips["margin"].iloc[0] if len(flips) else math.nan,
                "logits_max_abs_at_split": (flips["logits_max_abs"].iloc[0] if len(flips)
                                            else math.nan),
                "first_logits_split": moved["step"].iloc[0] if len(moved) else pd.NA})
        frame = pd.DataFrame(rows)
        for column in ("first_token_split", "first_logits_split"):
            frame[column] = frame[column].astype("Int64")
        return frame

    def at(self, step: int, samples: Iterable[int] | None = None) -> Comparison:
        """The layer-wise :class:`~divtrace.Comparison` of generation step ``step`` (0: the
        prefill of the padded prompts against each prompt alone), observed inside the
        model's own ``generate()``, for the compared prompts (or ``samples`` of them).
        Only prompts whose runs generated the same tokens before ``step`` are compared
        (the others see different inputs: a warning names them)."""
        from divtrace.kinds.decode import DecodeStep
        from divtrace.pipeline import execute
        from divtrace.plan.make import make_plan
        from divtrace.plan.runs import Run

        if self._model is None:
            raise DivtraceValueError(
                "this Generation was loaded from a file, without its model; run "
                "compare_generate again to look inside a step")
        if not isinstance(step, int) or isinstance(step, bool) or not (
                0 <= step < self.new_tokens):
            raise DivtraceValueError(
                f"step must be an integer in 0..{self.new_tokens - 1}; got {step!r}")
        wanted = list(self.samples) if samples is None else [int(p) for p in samples]
        unknown = sorted(set(wanted) - set(self.samples))
        if unknown:
            raise DivtraceValueError(
                f"samples {unknown} were not compared; the compared prompts are "
                f"{list(self.samples)}")
        here = self.table[(self.table["step"] == step) & self.table["prompt"].isin(wanted)]
        same = [int(p) for p in here[here["same_prefix"]]["prompt"]]
        other = sorted(set(wanted) - set(same))
        if not same:
            raise DivtraceValueError(
                f"at step {step} no compared prompt has the same input in both runs (their "
                f"tokens parted earlier, or they had ended); pick an earlier step: "
                f"per_prompt says where each prompt parts")
        if other:
            warnings.warn(
                f"at step {step}, prompts {other} are left out: their runs generated "
                f"other tokens before it (or had ended), so they see different inputs",
                DivtraceWarning, stacklevel=2)
        driver = GenerationStep(step, self.settings)
        plan = make_plan(self._model, ragged_input(self.prompts), a=Run(chunk=self.chunk),
                         samples=same, explain=["-observer"], kind=DecodeStep(step, driver),
                         **self._options)
        result = execute(plan, self._model)
        self._check_repeated(driver, plan.a_chunks, same, step)
        return result

    def _check_repeated(self, driver: GenerationStep, chunks: Any, prompts: list[int],
                        step: int) -> None:
        """Warns when generate(), run again to reach ``step``, made other tokens before it
        than the first time (kernels that are not deterministic from run to run)."""
        if len(driver.generated) < len(chunks) + 1:
            return
        # the split run's passes, then the batched run's (probes' passes come after)
        split = {start + row: tokens for (start, _stop), rows in
                 zip(chunks, driver.generated[:len(chunks)], strict=True)
                 for row, tokens in enumerate(rows)}
        batched = driver.generated[len(chunks)]
        moved = []
        for prompt in prompts:
            mine = self.table[(self.table["prompt"] == prompt) & (self.table["step"] < step)]
            mine = mine.sort_values("step")
            if (list(mine["token_split"]) != split[prompt].tolist()
                    or list(mine["token_batched"]) != batched[prompt].tolist()):
                moved.append(prompt)
        if moved:
            warnings.warn(
                f"generate() did not repeat itself: run again to reach step {step}, it made "
                f"other tokens before it for prompts {moved} (the model's kernels are not "
                f"deterministic from run to run); the comparison describes the new run",
                DivtraceWarning, stacklevel=3)

    def summary(self) -> str:
        """A few plain sentences: which prompts generate other tokens in the batch than
        alone, from which step, and how close those calls were."""
        first = self.per_prompt
        count = len(first)
        split = first.dropna(subset=["first_token_split"])
        moved = first.dropna(subset=["first_logits_split"])
        chunking = "alone" if self.chunk == 1 else f"in chunks of {self.chunk}"
        lines = [f"Greedy decoding of {count} prompt(s) (lengths {min(first['length'])}.."
                 f"{max(first['length'])}) for up to {self.new_tokens} new tokens: the "
                 f"padded batch of {len(self.prompts)} vs each prompt {chunking}."]
        if split.empty:
            lines.append(f"Every compared prompt generated the same tokens in both runs "
                         f"({len(self.table)} steps compared).")
        else:
            earliest = split.sort_values("first_token_split").iloc[0]
            near = int((split["margin_at_split"] <= 2 * split["logits_max_abs_at_split"])
                       .sum())
            lines.append(
                f"{len(split)} of {count} prompts generated other tokens in the batch than "
                f"alone; the earliest at step {int(earliest['first_token_split'])} (prompt "
                f"{int(earliest['prompt'])}, where the split run's top two logits were "
                f"{earliest['margin_at_split']:.3g} apart and the runs' logits differed by up "
                f"to {earliest['logits_max_abs_at_split']:.3g}). {near} of the {len(split)} "
                f"flips were near ties: a top-two margin within twice the runs' largest "
                f"logit difference, which rounding alone can tip.")
        if moved.empty:
            lines.append("The logits were bit-identical at every compared step.")
        else:
            at_zero = int((moved["first_logits_split"] == 0).sum())
            lines.append(
                f"The logits differ for {len(moved)} prompt(s), from step 0 (the prefill) "
                f"for {at_zero}. Generation.at(step) shows, layer by layer, where a step "
                f"parts.")
        return "\n".join(lines)

    def grid(self, column: str = "logits_rel_l2") -> np.ndarray:
        """``column`` as a prompts × steps array (NaN where a prompt had ended)."""
        frame = self.table.pivot(index="prompt", columns="step", values=column)
        frame = frame.reindex(index=list(self.samples), columns=range(self.new_tokens))
        return frame.to_numpy(dtype=float)

    def plot(self, ax: Axes | None = None) -> Axes:
        """Prompts × steps: the logits' rel_l2 (log colour), token flips marked ×, steps
        after a prompt ended blank."""
        from divtrace.generate.plot import plot_generation

        return plot_generation(self, ax=ax)

    def __repr__(self) -> str:
        first = self.per_prompt
        flips = int(first["first_token_split"].notna().sum())
        return (f"<divtrace.Generation: {len(first)} prompts, {self.new_tokens} new tokens, "
                f"{flips} with a token flip>")

    def _parts(self) -> list[str]:
        """The plot and the token table."""
        from divtrace.report.html import drawn, section

        size = (min(14.0, 3 + 0.18 * self.new_tokens), min(10.0, 1.5 + 0.28 * len(self.samples)))
        return [drawn(self.plot, size), section("Every step", self.table)]
