"""One step of ``generate()`` as a pass: the model generates up to the step, and only that
step's forward call is observed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from divtrace.record.recorder import Gate, Sink, Tracker

__all__ = ["GenerationStep", "generate"]


def generate(model: nn.Module, inputs: dict[str, torch.Tensor], new_tokens: int,
             settings: dict[str, Any]) -> Any:
    """The model's own greedy ``generate()``, with the raw logits of every step."""
    run = model.generate
    return run(**inputs, max_new_tokens=new_tokens, do_sample=False,  # type: ignore[operator]
               return_dict_in_generate=True, output_logits=True, **settings)


@dataclass
class GenerationStep:
    """Runs ``generate()`` for ``step + 1`` tokens and observes the forward call of step
    ``step`` (0: the prefill) only; ``settings`` go to ``generate()``."""

    step: int
    settings: dict[str, Any] = field(default_factory=dict)
    #: per pass, in order: the tokens each row generated before the observed step
    generated: list[torch.Tensor] = field(default_factory=list)
    _gates: list[Gate] = field(default_factory=list)

    def observed(self, sink: Sink) -> Sink:
        gate = Gate(sink)
        self._gates.append(gate)
        return gate

    def run(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            tracker: Tracker) -> Any:
        gate = self._gates[-1]
        calls = 0
        rows = tracker.rows

        def begin(_module: nn.Module, _args: Any, _kwargs: Any) -> None:
            nonlocal calls
            gate.active = calls == self.step
            if gate.active:  # the step's sites are named as those of a forward call
                tracker.reset(rows)
            calls += 1

        handle = model.register_forward_pre_hook(begin, with_kwargs=True, prepend=True)
        try:
            out = generate(model, kwargs, self.step + 1, self.settings)
        finally:
            handle.remove()
            gate.active = False
        length = kwargs["input_ids"].shape[1]
        self.generated.append(out.sequences[:, length:length + self.step].cpu())
        return out.logits[self.step] if len(out.logits) > self.step else None
