"""``compare_layouts()`` and ``compare_rollout()``: the same tokens laid out two ways —
packed, padded, alone, decoded through the KV cache, prefilled in chunks, continued from
a reused prefix — compared token by token, layer by layer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from divtrace.compare import compare
from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.explain.registry import Explain
from divtrace.explain.tokens import PerToken
from divtrace.generate.decode import ended
from divtrace.generation import end_tokens, generator
from divtrace.kinds.tokens import Tokens
from divtrace.plan.checks import whole_number
from divtrace.plan.prompts import Prompts, pad
from divtrace.plan.runs import Resources
from divtrace.plan.selection import ModuleSpec
from divtrace.plan.tokens import Layout, token_input
from divtrace.plan.walk import Walk
from divtrace.record.guard import cuda_devices, untouched
from divtrace.record.tokens import LayoutDriver, cache_word
from divtrace.report.comparison import Comparison

__all__ = ["compare_layouts", "compare_rollout"]


def _sequences(sequences: Sequence[torch.Tensor] | Prompts, pad_token_id: int) -> Prompts:
    if isinstance(sequences, Prompts):
        return Prompts(sequences.prompts, padding_side="right", pad_token_id=pad_token_id)
    return Prompts(sequences, padding_side="right", pad_token_id=pad_token_id)


def _checked(model: nn.Module, layouts: tuple[Layout, Layout], prompts: Prompts,
             starts: list[int] | None) -> None:
    """Refuses layouts the model or the sequences cannot take, naming the fix."""
    if any(layout.name == "decode" for layout in layouts):
        if not callable(getattr(model, "generate", None)) or cache_word(model) is None:
            raise DivtraceValueError(
                f"the decode layout runs the model's own generate() through its KV cache, "
                f"and {type(model).__name__} has no generate() or no KV cache: compare "
                f"layouts of one forward call ('padded', 'packed', 'alone')")
        if starts is None:
            raise DivtraceValueError(
                "the decode layout needs each sequence's prompt length (where decoding "
                "begins): pass prompt_lengths=[...], or use divtrace.compare_rollout, "
                "which generates the sequences")
    for layout in layouts:
        if layout.name in ("chunked", "prefix") and cache_word(model) is None:
            raise DivtraceValueError(
                f"the {layout.label()} layout goes through the model's KV cache, and "
                f"{type(model).__name__}.forward takes none (past_key_values): compare "
                f"layouts of one forward call ('padded', 'packed', 'alone')")
        if layout.name in ("chunked", "prefix"):
            assert layout.size is not None
            short = [(i, n) for i, n in enumerate(prompts.lengths) if n <= layout.size]
            if short:
                i, n = short[0]
                raise DivtraceValueError(
                    f"sequence {i} has {n} tokens, not more than the {layout.label()} "
                    f"layout's {layout.size}: every sequence needs more tokens than a "
                    f"{'chunk' if layout.name == 'chunked' else 'prefix'}; give a size "
                    f"below {min(prompts.lengths)}")


def compare_layouts(
    model: nn.Module,
    sequences: Sequence[torch.Tensor] | Prompts,
    *,
    a: str | Layout = "alone",
    b: str | Layout = "packed",
    prompt_lengths: Sequence[int] | None = None,
    samples: Iterable[int] | None = None,
    modules: ModuleSpec = None,
    explain: Explain = None,
    pad_token_id: int = 0,
    generate: dict[str, Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    resources: Resources | None = None,
    progress: bool = True,
) -> Comparison:
    """The same token sequences laid out two ways, compared token by token at every site.

    Run a lays them out as ``a``, run b as ``b`` (any two layouts, see :class:`~divtrace.Layout`);
    each compared sequence's tokens at every site are measured against the same tokens in
    the other run, gathered from all of its forward calls. The independence test (where
    run b is one forward call) and the precision test judge it as any comparison.

    Args:
        model: The model (a Hugging Face causal LM for the cached layouts), in eval mode.
        sequences: 1-D token-id tensors, one per sequence (or :class:`~divtrace.Prompts`).
        a, b: The two layouts (see :class:`~divtrace.Layout`: ``"padded"``,
            ``"padded:right"``, ``"packed"``, ``"padded:right:4"`` and ``"packed:4"`` in
            micro-batches of 4 sequences, ``"alone"``, ``"decode"``, ``"chunked:16"``,
            ``"prefix:32"``).
        prompt_lengths: For ``"decode"``: each sequence's prompt length; the rest of it is
            fed step by step through the model's own ``generate()``, each step's token
            forced to the sequence's (a rollout's tokens, greedy or sampled). Each
            sequence's tokens then compared are those fed to the model: all but its last.
        samples: The sequences to compare (default: all).
        modules, explain, rtol, atol, resources, progress: As for
            :func:`~divtrace.compare`.
        pad_token_id: The id written at padded positions.
        generate: Settings for ``generate()`` in the decode layout (``pad_token_id``,
            ``eos_token_id``).

    Returns:
        A :class:`~divtrace.Comparison` (``meta.kind == "token layouts"``).

    Example:
        >>> import torch, divtrace, transformers
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
        ...     intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
        >>> lm = transformers.LlamaForCausalLM(config).eval()
        >>> result = divtrace.compare_layouts(lm, [torch.arange(1, 9), torch.arange(3, 12)],
        ...                                   a="alone", b="packed", progress=False)
        >>> result.meta.names
        ('run a (each alone)', 'run b (packed)')
    """
    if not isinstance(model, nn.Module):
        raise DivtraceTypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    layouts = (Layout.of(a), Layout.of(b))
    if layouts[0] == layouts[1]:
        raise DivtraceValueError(
            f"runs a and b have the same layout ({layouts[0].label()}); give each its own "
            f"(e.g. a='alone', b='packed')")
    prompts = _sequences(sequences, whole_number(pad_token_id, "pad_token_id"))
    prompts.check_pair()
    starts = None if prompt_lengths is None else [
        whole_number(n, "prompt_lengths", minimum=1) for n in prompt_lengths]
    if starts is not None:
        if len(starts) != len(prompts):
            raise DivtraceValueError(
                f"prompt_lengths has {len(starts)} entries for {len(prompts)} sequences; "
                f"give one per sequence")
        long = [i for i, (s, n) in enumerate(zip(starts, prompts.lengths, strict=True))
                if s >= n]
        if long:
            raise DivtraceValueError(
                f"sequence {long[0]} has {prompts.lengths[long[0]]} tokens and a prompt of "
                f"{starts[long[0]]}: a decoded sequence needs a token after its prompt")
    _checked(model, layouts, prompts, starts)
    decoded = any(layout.name == "decode" for layout in layouts)
    compared = [n - 1 for n in prompts.lengths] if decoded else None
    tokens = token_input(prompts, compared, starts)
    driver = LayoutDriver(*layouts, tokens, dict(generate or {}))
    return compare(model, tokens, kind=Tokens(driver), samples=samples, modules=modules,
                   explain=explain, rtol=rtol, atol=atol, resources=resources,
                   progress=progress)


def compare_rollout(
    model: nn.Module,
    prompts: Sequence[torch.Tensor] | Prompts,
    *,
    max_new_tokens: int = 16,
    trainer: str | Layout = "padded:right",
    tolerance: float = 1e-3,
    pad_token_id: int | None = None,
    eos_token_id: int | Sequence[int] | str | None = "model",
    samples: Iterable[int] | None = None,
    modules: ModuleSpec = None,
    explain: Explain = None,
    rtol: float | None = None,
    atol: float | None = None,
    resources: Resources | None = None,
    progress: bool = True,
) -> Comparison:
    """A reinforcement-learning rollout against its trainer: the prompts generated with
    batched KV-cache decoding (greedy, the model's own ``generate()``), then the finished
    sequences scored teacher-forced (``trainer``: ``"padded:right"``, ``"padded"``,
    ``"packed"``, or in micro-batches, ``"padded:right:4"``), compared token by token and
    layer by layer. ``result.remedies()`` tries the float32 head and the other remedies,
    each verified per token.

    Besides every site, the result holds the log-probability each run gives each
    generated token (``divtrace.token_figures(result)``: max and mean |Δlogprob|, the share over
    ``tolerance``, argmax flips) and each token's error at every decoder layer.

    Args:
        model: A Hugging Face causal LM, in eval mode.
        prompts: 1-D token-id tensors (or :class:`~divtrace.Prompts`).
        max_new_tokens: Tokens each prompt generates at most.
        trainer: How the trainer lays the finished sequences out (any
            :class:`~divtrace.Layout`).
        tolerance: The |Δlogprob| counted as too far.
        pad_token_id, eos_token_id: As for :func:`~divtrace.compare_generate`.
        samples, modules, explain, rtol, atol, resources, progress: As for
            :func:`~divtrace.compare` (the ``"tokens"`` probe runs unless
            ``explain=["-tokens"]``).

    Returns:
        A :class:`~divtrace.Comparison`: run a the rollout (``"KV-cache decode"``), run b
        the trainer.
    """
    generator(model, "compare_rollout")
    new_tokens = whole_number(max_new_tokens, "max_new_tokens", minimum=1)
    eos = end_tokens(model, eos_token_id)
    if pad_token_id is None:
        config = getattr(model, "generation_config", None)
        pad_token_id = getattr(config, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    given = prompts.prompts if isinstance(prompts, Prompts) else prompts
    padded = Prompts(given, padding_side="left", pad_token_id=int(pad_token_id))
    padded.check_pair()
    settings: dict[str, Any] = {"pad_token_id": int(pad_token_id), "eos_token_id": eos or None}
    inputs, layout = pad(padded, 0, len(padded))
    inputs.pop("position_ids")
    walk = Walk.of(model)
    with torch.no_grad(), untouched(walk, cuda_devices((walk,), list(padded.prompts))):
        out = model.generate(**inputs, max_new_tokens=new_tokens,  # type: ignore[operator]
                             do_sample=False, return_dict_in_generate=True, **settings)
    made = [row[:ended(row, set(eos))] for row in out.sequences[:, layout.length:]]
    sequences = [torch.cat([p, m.to(p.device)]) for p, m in zip(padded.prompts, made,
                                                                 strict=True)]
    probes = [*([] if explain is None else [explain] if isinstance(explain, str)
                else list(explain))]
    if not {"tokens", "-tokens"} & {p for p in probes if isinstance(p, str)} and not any(
            isinstance(p, PerToken) for p in probes):
        probes.append(PerToken(tolerance))
    return compare_layouts(model, sequences, a="decode", b=trainer,
                           prompt_lengths=list(padded.lengths), samples=samples,
                           modules=modules, explain=[p for p in probes if p != "-tokens"],
                           pad_token_id=int(pad_token_id), generate=settings, rtol=rtol,
                           atol=atol, resources=resources, progress=progress)
