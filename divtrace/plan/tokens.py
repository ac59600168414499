"""Token layouts: the same sequences laid out differently in a model's passes — padded
into one batch, packed into one row, each alone, decoded token by token through the KV
cache, prefilled in chunks, or continued from a reused prefix cache."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from divtrace.errors import DivtraceTypeError, DivtraceValueError
from divtrace.plan.inputs import BatchedInput, Driver
from divtrace.plan.prompts import Prompts, RaggedInput, TokenMap, pad, ragged_input

__all__ = ["Layout", "TokenInput", "pack", "token_input"]


@dataclass(frozen=True)
class Layout:
    """How a run lays out the sequences in its passes, for ``compare_layouts`` (a
    string names one too: ``"padded"``, ``"padded:right"``, ``"packed"``, ``"alone"``,
    ``"decode"``, ``"chunked:16"``, ``"prefix:32"``).

    - ``padded``: one batch, each sequence padded to the longest (``side``: left or
      right), with an attention mask and the position ids ``generate()`` makes.
    - ``packed``: every sequence end to end in one row, the position ids restarting at
      each one, no attention mask and no KV cache (Hugging Face models then keep each
      sequence to itself, as with ``DataCollatorWithFlattening``).
    - Either in micro-batches (``size``: the sequences of each forward call, as a trainer
      takes them): ``"padded:right:4"``, ``"packed:4"``.
    - ``alone``: each sequence by itself.
    - ``decode``: through the model's own ``generate()``: the prompts prefilled in one
      left-padded batch, then one token per step through the KV cache, each step's token
      forced to the sequence's own (a rollout's computation, replayed).
    - ``chunked``: each sequence alone, prefilled ``size`` tokens at a time through the
      KV cache.
    - ``prefix``: each sequence's first ``size`` tokens prefilled alone into a KV cache,
      the rest in one pass on a copy of it (a cached prefix reused).

    Example:
        >>> import divtrace
        >>> divtrace.Layout.of("chunked:16")
        Layout(name='chunked', size=16, side='left')
    """

    name: str
    size: int | None = None
    side: str = "left"

    NAMES: ClassVar[tuple[str, ...]] = ("padded", "packed", "alone", "decode", "chunked",
                                        "prefix")
    #: the layouts that run every sequence of a run in one forward call
    ONE_PASS: ClassVar[tuple[str, ...]] = ("padded", "packed")

    def __post_init__(self) -> None:
        if self.name not in self.NAMES:
            raise DivtraceValueError(
                f"no token layout {self.name!r}; the layouts are {', '.join(self.NAMES)} "
                f"(e.g. 'chunked:16', 'padded:right')")
        sized = self.name in ("chunked", "prefix")
        if self.name in self.ONE_PASS and self.size is not None and (
                not isinstance(self.size, int) or isinstance(self.size, bool)
                or self.size < 1):
            raise DivtraceValueError(
                f"a micro-batch of the layout {self.name!r} is a whole number of sequences "
                f"of 1 or more: e.g. '{self.name}:4' (got {self.size!r})")
        if sized and (not isinstance(self.size, int) or isinstance(self.size, bool)
                      or self.size < 1):
            raise DivtraceValueError(
                f"the layout {self.name!r} needs a size, a whole number of tokens of 1 or "
                f"more: e.g. '{self.name}:16' (got {self.size!r})")
        if not sized and self.name not in self.ONE_PASS and self.size is not None:
            raise DivtraceValueError(f"the layout {self.name!r} takes no size")
        if self.side not in ("left", "right"):
            raise DivtraceValueError(
                f"the padding side must be 'left' or 'right'; got {self.side!r}")

    @classmethod
    def of(cls, given: str | Layout) -> Layout:
        """``given`` as a layout (a string: ``name`` or ``name:size``, ``padded:right``)."""
        if isinstance(given, Layout):
            return given
        if not isinstance(given, str):
            raise DivtraceTypeError(
                f"a layout is a string such as 'packed' or 'chunked:16', or a "
                f"divtrace.Layout; got {type(given).__name__}")
        name, _, size = given.partition(":")
        side = "left"
        if name == "padded" and size.partition(":")[0] in ("left", "right"):
            side, _, size = size.partition(":")
        if not size:
            return cls(name, side=side)
        if not size.isdigit():
            raise DivtraceValueError(
                f"the size in {given!r} must be a whole number (e.g. '{name}:16'; "
                f"'padded:right:4' for micro-batches of 4 sequences)")
        return cls(name, int(size), side)

    @property
    def one_pass(self) -> bool:
        """Whether a run of this layout takes all its sequences in one forward call."""
        return self.name in self.ONE_PASS and self.size is None

    @property
    def whole(self) -> Layout:
        """The layout in one forward call (a micro-batched one without its size)."""
        return Layout(self.name, None, self.side) if self.name in self.ONE_PASS else self

    @property
    def cached(self) -> bool:
        """Whether the layout goes through the model's KV cache."""
        return self.name in ("decode", "chunked", "prefix")

    def label(self) -> str:
        """How sentences name a run of this layout."""
        micro = "" if self.size is None else (
            f", micro-batches of {self.size} sequence{'s' if self.size > 1 else ''}")
        return {"padded": f"{self.side}-padded{micro}", "packed": f"packed{micro}",
                "alone": "each alone", "decode": "KV-cache decode",
                "chunked": f"chunked prefill ({self.size} tokens)",
                "prefix": f"reused prefix ({self.size} tokens)"}[self.name]


def pack(prompts: Prompts, start: int, stop: int, compared: tuple[int, ...] | None = None
         ) -> tuple[dict[str, Any], TokenMap]:
    """The model's keyword inputs for sequences ``start:stop`` packed into one row
    (``position_ids`` restarting at each), and where their tokens lie."""
    chosen = prompts.prompts[start:stop]
    ids = torch.cat(list(chosen)).unsqueeze(0)
    positions = torch.cat([torch.arange(p.numel(), device=p.device) for p in chosen])
    lengths = [int(p.numel()) for p in chosen]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    valid = lengths if compared is None else [min(n, c) for n, c in
                                              zip(lengths, compared[start:stop], strict=True)]
    # no cache: Hugging Face models find packed sequences only in a pass without one
    return ({"input_ids": ids, "position_ids": positions.unsqueeze(0), "use_cache": False},
            TokenMap(ids.shape[1], tuple(offsets), tuple(valid), rows=(0,) * len(chosen)))


@dataclass(frozen=True)
class TokenInput(RaggedInput):
    """A :class:`RaggedInput` of sequences compared token by token across layouts:
    ``compared``, per sequence, how many of its first tokens are compared (None: all);
    ``starts``, where each one's decoding begins (its prompt's length; None: the
    sequences are not decoded)."""

    compared: tuple[int, ...] | None = None
    starts: tuple[int, ...] | None = None

    def counted(self, sequence: int) -> int:
        """How many of sequence ``sequence``'s first tokens are compared."""
        n = int(self.source.prompts[sequence].numel())
        return n if self.compared is None else min(n, self.compared[sequence])

    def one_pass(self, layout: Layout, start: int, stop: int
                 ) -> tuple[dict[str, Any], TokenMap]:
        """The inputs and token map of sequences ``start:stop`` in one forward call of
        ``layout`` (padded or packed), cut to their compared tokens."""
        compared = tuple(self.counted(i) for i in range(len(self.source)))
        if layout.name == "packed":
            return pack(self.source, start, stop, compared)
        source = self.source if layout.side == self.source.padding_side else Prompts(
            self.source.prompts, padding_side=layout.side,
            pad_token_id=self.source.pad_token_id, position_ids=self.source.position_ids)
        inputs, found = pad(source, start, stop)
        return inputs, replace(found, valid=compared[start:stop])

    def layout(self, start: int, stop: int) -> TokenMap:
        found = pad(self.source, start, stop)[1]
        return replace(found, valid=tuple(self.counted(i) for i in range(start, stop)))

    def select(self, rows: list[int]) -> BatchedInput:
        return token_input(self.source.like([self.source.prompts[i] for i in rows]),
                           None if self.compared is None else [self.compared[i] for i in rows],
                           None if self.starts is None else [self.starts[i] for i in rows])

    def replaced(self, fixed: list[int]) -> tuple[BatchedInput, list[int]]:
        other, unchanged = super().replaced(fixed)
        assert isinstance(other, RaggedInput)
        return replace(self, prompts=other.prompts, leaves=other.leaves), unchanged


def token_input(prompts: Prompts, compared: Any = None, starts: Any = None,
                driver: Driver | None = None) -> TokenInput:
    """The input of a comparison of ``prompts`` across token layouts (``compared``: the
    compared tokens per sequence; ``starts``: where each one's decoding begins)."""
    base = ragged_input(prompts, driver)
    fields = {name: getattr(base, name) for name in (
        "leaves", "spec", "dims", "names", "batch_size", "batch_dim", "driver", "prompts")}
    return TokenInput(**fields, compared=None if compared is None else tuple(
        int(c) for c in compared), starts=None if starts is None else tuple(
        int(s) for s in starts))
