"""Prompts of different lengths: padded into one batch for the batched run, each alone (or
padded among its chunk) for the split run, as a language model serves them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from divtrace.align.ragged import real_tokens
from divtrace.compat import pytree
from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.inputs import BatchedInput, Driver

__all__ = ["Prompts", "RaggedInput", "TokenMap", "pad", "prompts_input"]


class Prompts:
    """Token-id prompts of different lengths, for ``compare(model, Prompts(...))``.

    The batched run gets them padded into one batch (``input_ids``, ``attention_mask``
    and, with ``position_ids=True``, the position ids a Hugging Face ``generate()`` makes:
    the count of real tokens before each one); the split run gets each prompt alone,
    unpadded (with ``chunk > 1``, padded among its chunk). Every site is compared on each
    prompt's real token positions only: padding is never compared.

    Args:
        prompts: 1-D integer tensors, one per prompt, on the model's device.
        padding_side: ``"left"`` (as for generation) or ``"right"``.
        pad_token_id: The id written at padded positions.
        position_ids: Also pass ``position_ids`` (for models that would otherwise number
            padded positions too).

    Example:
        >>> import torch, divtrace
        >>> prompts = divtrace.Prompts([torch.tensor([5, 6, 7]), torch.tensor([8])])
        >>> prompts.lengths
        (3, 1)
    """

    __slots__ = ("pad_token_id", "padding_side", "position_ids", "prompts")

    def __init__(self, prompts: Sequence[torch.Tensor], *, padding_side: str = "left",
                 pad_token_id: int = 0, position_ids: bool = True) -> None:
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence):
            raise DivtraceTypeError(
                f"prompts must be a list of 1-D token-id tensors; got "
                f"{type(prompts).__name__} (for one padded batch, pass input_ids and "
                f"attention_mask to compare() as a dict)")
        if not prompts:
            raise DivtraceValueError("prompts is empty; give at least one prompt")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or (
                    prompt.is_floating_point() or prompt.is_complex()):
                got = (f"a {prompt.dim()}-D {prompt.dtype} tensor"
                       if isinstance(prompt, torch.Tensor) else type(prompt).__name__)
                raise DivtraceValueError(
                    f"prompts[{i}] must be a 1-D tensor of token ids; got {got}")
            if prompt.numel() == 0:
                raise DivtraceValueError(f"prompts[{i}] is empty; every prompt needs a token")
        devices = {p.device for p in prompts}
        if len(devices) > 1:
            raise DivtraceValueError(
                f"the prompts lie on several devices ({', '.join(map(str, devices))}); "
                f"move them to the model's device")
        if padding_side not in ("left", "right"):
            raise DivtraceValueError(
                f"padding_side must be 'left' or 'right'; got {padding_side!r}")
        self.prompts = tuple(prompts)
        self.padding_side = padding_side
        self.pad_token_id = int(pad_token_id)
        self.position_ids = bool(position_ids)

    @classmethod
    def from_packed(cls, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    **settings: Any) -> Prompts:
        """The sequences of a packed row (as ``DataCollatorWithFlattening`` makes it): a
        new sequence wherever ``position_ids`` restart at 0; each must count up by one.

        Example:
            >>> import torch, divtrace
            >>> divtrace.Prompts.from_packed(torch.tensor([[5, 6, 7, 8]]),
            ...                              torch.tensor([[0, 1, 0, 1]])).lengths
            (2, 2)
        """
        for name, given in (("input_ids", input_ids), ("position_ids", position_ids)):
            if not isinstance(given, torch.Tensor) or given.dim() not in (1, 2) or (
                    given.dim() == 2 and given.shape[0] != 1):
                raise DivtraceValueError(
                    f"{name} of a packed row must be a [1, tokens] (or [tokens]) tensor; got "
                    f"{tuple(given.shape) if isinstance(given, torch.Tensor) else given!r}")
        ids, positions = input_ids.reshape(-1), position_ids.reshape(-1)
        if ids.shape != positions.shape:
            raise DivtraceValueError(
                f"input_ids has {ids.numel()} tokens and position_ids {positions.numel()}: "
                f"give one position per token")
        steps = positions.tolist()
        for i, (before, now) in enumerate(zip([-1, *steps], steps, strict=False)):
            if now != 0 and now != before + 1:
                raise DivtraceValueError(
                    f"position_ids are inconsistent with the packing at token {i}: "
                    f"{before} is followed by {now}, where a packed row either counts on "
                    f"by one or starts a new sequence at 0 (position_ids restarting per "
                    f"sequence, as DataCollatorWithFlattening makes them)")
        starts = [i for i, now in enumerate(steps) if now == 0] + [len(steps)]
        return cls([ids[a:b] for a, b in itertools.pairwise(starts)], **settings)

    def like(self, prompts: Sequence[torch.Tensor]) -> Prompts:
        """Other prompts with the same padding settings."""
        return Prompts(prompts, padding_side=self.padding_side,
                       pad_token_id=self.pad_token_id, position_ids=self.position_ids)

    def check_pair(self) -> None:
        """Refuses a single prompt: a batched run and a split run need two at least."""
        if len(self.prompts) < 2:
            raise DivtraceValueError(
                f"Prompts holds {len(self.prompts)} prompt; a batched run and a split run "
                f"need at least two prompts to differ. Add another prompt (any will do: "
                f"samples= picks the ones compared)")

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(int(p.numel()) for p in self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __repr__(self) -> str:
        return (f"Prompts({len(self)} prompts, lengths {min(self.lengths)}..."
                f"{max(self.lengths)}, padding_side={self.padding_side!r})")


@dataclass(frozen=True)
class TokenMap:
    """Where each sequence's real tokens lie in a pass (one forward call): the pass's
    token length, and per sequence the row it lies in (``rows``; None: sequence ``i`` in
    row ``i``), the offset of its tokens there and their count; ``starts``: the index in
    the sequence of the first of them (None: 0, every sequence from its start)."""

    length: int
    offsets: tuple[int, ...]
    valid: tuple[int, ...]
    rows: tuple[int, ...] | None = None
    starts: tuple[int, ...] | None = None

    def row(self, sequence: int) -> int:
        """The row of the pass that sequence ``sequence`` lies in."""
        return sequence if self.rows is None else self.rows[sequence]

    def widened(self, low: int, count: int) -> TokenMap:
        """This map of a call over sequences ``low:low + n`` of a pass of ``count``, as a
        map of all of them (the others have no token in the call)."""
        n = len(self.offsets)
        if low == 0 and n == count:
            return self

        def spread(values: tuple[int, ...]) -> tuple[int, ...]:
            return (0,) * low + values + (0,) * (count - low - n)
        rows = tuple(range(n)) if self.rows is None else self.rows
        return TokenMap(self.length, spread(self.offsets), spread(self.valid),
                        rows=spread(rows),
                        starts=None if self.starts is None else spread(self.starts))

    def start(self, sequence: int) -> int:
        """The index in the sequence of its first token in this pass."""
        return 0 if self.starts is None else self.starts[sequence]

    def tokens(self, tensor: torch.Tensor, row: int,
               like: tuple[int, ...] | None = None) -> torch.Tensor:
        """Sequence ``row``'s real tokens in ``tensor`` (see :func:`real_tokens`)."""
        if self.rows is None:
            return real_tokens(tensor, row, self.length, self.offsets[row], self.valid[row],
                               like)
        return real_tokens(tensor, self.rows[row], self.length, self.offsets[row],
                           self.valid[row], like, packed=True)


def pad(prompts: Prompts, start: int, stop: int) -> tuple[dict[str, torch.Tensor], TokenMap]:
    """The model's keyword inputs for prompts ``start:stop`` padded into one batch, and
    where their real tokens lie."""
    chosen = prompts.prompts[start:stop]
    lengths = [int(p.numel()) for p in chosen]
    length = max(lengths)
    first = chosen[0]
    ids = torch.full((len(chosen), length), prompts.pad_token_id, dtype=first.dtype,
                     device=first.device)
    mask = torch.zeros((len(chosen), length), dtype=torch.long, device=first.device)
    left = prompts.padding_side == "left"
    offsets = [length - n if left else 0 for n in lengths]
    for row, (prompt, offset, n) in enumerate(zip(chosen, offsets, lengths, strict=True)):
        ids[row, offset:offset + n] = prompt
        mask[row, offset:offset + n] = 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    if prompts.position_ids:  # as generate() makes them: real tokens counted from 0
        inputs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    return inputs, TokenMap(length, tuple(offsets), tuple(lengths))


@dataclass(frozen=True)
class RaggedInput(BatchedInput):
    """A :class:`BatchedInput` whose rows are prompts of different lengths: each pass pads
    its own rows (:func:`pad`); :meth:`layout` says where the real tokens lie."""

    prompts: Prompts | None = None
    #: the generation step whose forward call is observed (0: the prefill); None: no
    #: generation
    step: int | None = None

    def layout(self, start: int, stop: int) -> TokenMap:
        """Where the real tokens of rows ``start:stop`` lie in the observed call of their
        pass (at generation step ``t``, ``t`` tokens more in every row)."""
        layout = pad(self.source, start, stop)[1]
        if not self.step:
            return layout
        return TokenMap(layout.length + self.step, layout.offsets,
                      tuple(n + self.step for n in layout.valid))

    @property
    def source(self) -> Prompts:
        assert self.prompts is not None
        return self.prompts

    def row_leaves(self, start: int, stop: int, copy: bool = False) -> list[Any]:
        inputs, _ = pad(self.source, start, stop)  # fresh tensors: copies already
        return list(inputs.values())

    def select(self, rows: list[int]) -> BatchedInput:
        return ragged_input(self.source.like([self.source.prompts[i] for i in rows]))

    def replacements(self, groups: list[list[int]]) -> Iterator[tuple[BatchedInput, list[int]]]:
        """:meth:`replaced` for each group in turn, as the caller asks for it (its checks
        are the prompts' own, group by group)."""
        return (self.replaced(fixed) for fixed in groups)

    def replaced(self, fixed: list[int]) -> tuple[BatchedInput, list[int]]:
        """The same prompts, every one but ``fixed`` given other tokens of the same
        length (those of a fixed prompt, repeated as needed; the next id where that gives
        the same tokens): the padding, the masks and the positions stay."""
        prompts = list(self.source.prompts)
        top = max(int(p.max()) for p in prompts) + 1
        others = [row for row in range(len(prompts)) if row not in set(fixed)]
        unchanged = []
        for n, row in enumerate(others):
            donor = prompts[fixed[n % len(fixed)]]
            length = prompts[row].numel()
            tokens = donor.repeat(-(-length // donor.numel()))[:length]
            if torch.equal(tokens, prompts[row]):
                tokens = (tokens + 1) % top
            if torch.equal(tokens, prompts[row]):
                unchanged.append(row)
            prompts[row] = tokens
        return ragged_input(self.source.like(prompts), self.driver, self.step), unchanged


def ragged_input(prompts: Prompts, driver: Driver | None = None,
                 step: int | None = None) -> RaggedInput:
    """The input of a comparison of ``prompts`` (run by ``driver``, observed at ``step``)."""
    inputs, _ = pad(prompts, 0, len(prompts))
    leaves, spec = pytree.tree_flatten(((), inputs))
    return RaggedInput(tuple(leaves), spec, (0,) * len(leaves),
                       tuple(f"x[{name!r}]" for name in inputs), len(prompts), 0,
                       driver=driver, prompts=prompts, step=step)


def prompts_input(x: Any, batch_dim: Any) -> BatchedInput | None:
    """``x`` as the batch of prompts it is (None: it is not :class:`Prompts`)."""
    if not isinstance(x, Prompts | RaggedInput):
        return None
    if batch_dim != 0:
        raise DivtraceValueError(
            f"with Prompts the batch is the first dimension; leave batch_dim out (got "
            f"{batch_dim!r})")
    if isinstance(x, RaggedInput):
        return x
    x.check_pair()
    return ragged_input(x)
