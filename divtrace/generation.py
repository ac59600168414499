"""``compare_generate()``: greedy decoding of prompts in a batch and alone, step by step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.generate.decode import decode, token_table
from divtrace.generate.result import Generation
from divtrace.plan.checks import whole_number
from divtrace.plan.prompts import Prompts
from divtrace.plan.samples import check_chunk, chunks_for, prepare_samples
from divtrace.plan.selection import ModuleSpec
from divtrace.plan.walk import Walk
from divtrace.progress import Progress
from divtrace.record.guard import cuda_devices, untouched

__all__ = ["compare_generate", "end_tokens", "generator"]


def end_tokens(model: nn.Module, eos_token_id: int | Sequence[int] | str | None
                ) -> list[int]:
    if eos_token_id == "model":
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int | torch.Tensor):
        return [int(eos_token_id)]
    if isinstance(eos_token_id, str):
        raise DivtraceValueError(
            f"eos_token_id must be 'model', None, an id or a list of ids; got "
            f"{eos_token_id!r}")
    return [int(t) for t in eos_token_id]


def generator(model: nn.Module, face: str, other: str = "") -> None:
    """Refuses a model ``face`` cannot generate with: no Hugging Face ``generate()``, or
    in train mode (``other``: what the message adds)."""
    if not isinstance(model, nn.Module) or not callable(getattr(model, "generate", None)):
        raise DivtraceTypeError(
            f"{face} needs a model with a Hugging Face generate() (a causal language "
            f"model); got {type(model).__name__}{other}")
    if model.training:
        raise DivtraceValueError(
            "the model is in train mode (dropout would draw random numbers in every "
            "step); call model.eval() first")


def compare_generate(
    model: nn.Module,
    prompts: Sequence[torch.Tensor] | Prompts,
    *,
    max_new_tokens: int = 16,
    pad_token_id: int | None = None,
    eos_token_id: int | Sequence[int] | str | None = "model",
    padding_side: str = "left",
    chunk: int = 1,
    samples: Iterable[int] | None = None,
    progress: bool = True,
    ops: bool | str = False,
    modules: ModuleSpec = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> Generation:
    """Greedy decoding (with the KV cache) of ``prompts`` padded into one batch, against
    each prompt alone (or in chunks), through the model's own ``generate()``.

    Both runs get the same settings; their tokens are exactly those ``generate()`` gives
    for the padded batch and for each prompt alone. The result's table compares, per
    prompt and step, the tokens and the raw logits; ``Generation.at(step)`` compares the
    forward call of one step layer by layer (step 0: the prefill).

    Args:
        model: A model with a Hugging Face ``generate()`` (a causal LM), in eval mode.
        prompts: 1-D token-id tensors of any lengths (or a :class:`~divtrace.Prompts`).
        max_new_tokens: Tokens each run generates at most.
        pad_token_id: The padding id (default: the model's, else its end-of-sequence id,
            else 0).
        eos_token_id: The id(s) that end a prompt's generation (default: the model's
            generation config; None: none, every prompt takes ``max_new_tokens`` steps).
        padding_side: ``"left"`` (as for generation) or ``"right"``.
        chunk: The split run's batch size (1: each prompt alone).
        samples: The prompts to compare (default: all); only their chunks run.
        progress: Show a progress bar on stderr.
        ops, modules, rtol, atol: As for :func:`~divtrace.compare`, for ``at(step)``.

    Returns:
        A :class:`~divtrace.generate.result.Generation`.

    Example:
        >>> import torch, divtrace, transformers
        >>> config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
        >>> lm = transformers.GPT2LMHeadModel(config).eval()
        >>> found = divtrace.compare_generate(lm, [torch.tensor([1, 2, 3]), torch.tensor([4])],
        ...                                   max_new_tokens=3, eos_token_id=None,
        ...                                   progress=False)
        >>> len(found.table), list(found.per_prompt["steps"])
        (6, [3, 3])
    """
    generator(model, "compare_generate", ". For other models, compare one forward pass of "
              "the prompts: divtrace.compare(model, divtrace.Prompts(...))")
    new_tokens = whole_number(max_new_tokens, "max_new_tokens", minimum=1)
    config = getattr(model, "generation_config", None)
    eos = end_tokens(model, eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    given = prompts.prompts if isinstance(prompts, Prompts) else prompts
    side = prompts.padding_side if isinstance(prompts, Prompts) else padding_side
    padded = Prompts(given, padding_side=side, pad_token_id=int(pad_token_id),
                     position_ids=False)  # generate() makes the position ids itself
    padded.check_pair()
    size = len(padded)
    rows = prepare_samples(samples, size)
    chunk = check_chunk(chunk, size)
    chunks = list(chunks_for(rows, chunk, size))
    settings: dict[str, Any] = {"pad_token_id": int(pad_token_id),
                                "eos_token_id": eos or None}
    walk = Walk.of(model)
    devices = cuda_devices((walk,), list(padded.prompts))
    with Progress(1 + len(chunks), progress) as bar, untouched(walk, devices):
        bar.stage("batched run (generate)")
        batched = decode(model, padded, [(0, size)], new_tokens, settings, set(eos),
                         bar.advance)
        bar.stage("split run (generate)")
        split = decode(model, padded, chunks, new_tokens, settings, set(eos), bar.advance)
    options = {"progress": progress, "ops": ops, "modules": modules, "rtol": rtol,
               "atol": atol}
    return Generation(token_table(batched, split, rows), padded, settings, chunk,
                      tuple(rows), new_tokens, model, options)
