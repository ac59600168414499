"""Token layouts in the record stage: the driver that lays a run's sequences out in its
forward calls (:class:`LayoutDriver`), and the row store that gathers each compared
sequence's tokens at every site from all of them (:class:`TokenStore`)."""

from __future__ import annotations

import copy
import inspect
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from divtrace.align.sites import Site
from divtrace.align.status import Status, comparable
from divtrace.errors import DivtraceValueError
from divtrace.plan.prompts import Prompts, TokenMap, pad
from divtrace.plan.tokens import Layout, TokenInput
from divtrace.record.recorder import Gate, Sink, Tracker
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows

__all__ = ["LayoutDriver", "TokenStore", "cache_word"]


def _per_token(tensor: torch.Tensor, tokens: TokenMap, rows: int
               ) -> tuple[torch.Tensor, int] | None:
    """``tensor`` as ``[rows, tokens, ...]`` and the position in the pass of its first
    token (a model that computes its last positions only, as ``logits_to_keep`` does,
    gives fewer); None: it has no axis of the pass's tokens."""
    if tensor.dim() < 2:
        return None
    length = tokens.length
    if tensor.shape[0] != rows and tensor.shape[0] == rows * length:
        tensor = tensor.view(rows, length, *tensor.shape[1:])  # tokens of every row, flat
    if tensor.shape[0] != rows:
        return None
    kept = tensor.shape[1]
    if kept == length:
        return tensor, 0
    ends = all(o + v == length for o, v in zip(tokens.offsets, tokens.valid, strict=True)
               if v)
    return (tensor, length - kept) if kept < length and ends else None


@dataclass
class TokenStore(RowStore):
    """A :class:`RowStore` of sequences laid out by a token layout: a site's rows are one
    tensor per compared sequence, its compared tokens in order, gathered from every
    forward call of the pass (:meth:`piece` says where they lie in each)."""

    tokens: TokenInput | None = None
    _map: TokenMap | None = None
    _rows: int = 0
    _start: int = 0
    #: the compared sequences of the call in progress: (index in the pass, slot)
    _slots_now: list[tuple[int, int]] = field(default_factory=list)
    #: per site, per slot: (first token's index in its sequence, its tokens), this pass
    _gathered: dict[str, dict[int, list[tuple[int, torch.Tensor]]]] = field(
        default_factory=dict)

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        super().begin_chunk(start, stop, tracker)
        self._start = start
        self._gathered = {}
        self._map = None

    def piece(self, tokens: Any, rows: int) -> None:
        self._map, self._rows = tokens, rows
        slots = {sample: slot for slot, sample in enumerate(self.samples)}
        self._slots_now = [(sequence, slots[self._start + sequence])
                           for sequence in range(len(tokens.offsets))
                           if self._start + sequence in slots]

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        usable = comparable(tensor) if site.opaque is None else site.opaque
        tokens = self._map
        if tokens is None or isinstance(usable, Status):
            super().on_tensor(site, tensor)  # reported, never compared
            return
        stored = self.rows.get(site.key)
        found = _per_token(usable, tokens, self._rows)
        if stored is None:
            stored = self.rows[site.key] = StoredRows(
                site, tuple(usable.shape), None, (), usable.dtype,
                parts=[None] * len(self.samples), firsts=[0] * len(self.samples))
        if found is None:
            stored.drop(Status.NOT_PER_TOKEN)
        elif usable.dtype != stored.dtype:
            stored.drop(Status.SHAPE_MISMATCH)
        if stored.parts is None or found is None:
            return
        laid, first = found
        device = torch.device("cpu") if self.offload else laid.device
        spans = []
        for sequence, slot in self._slots_now:
            offset, count = tokens.offsets[sequence], tokens.valid[sequence]
            low = max(offset, first)
            if count > 0 and low < offset + count:
                spans.append((slot, tokens.start(sequence) + low - offset,
                              tokens.row(sequence), low - first, offset + count - low))
        whole = sum(span[4] for span in spans) == laid.shape[0] * laid.shape[1]
        # one copy of the call's tensor when every token of it is compared (a decode
        # step), else a copy of each sequence's tokens only (no padding kept)
        held = laid.detach().to(device, copy=True) if whole else laid.detach()
        gathered = self._gathered.setdefault(site.key, {})
        for slot, at, row, position, count in spans:
            part = held[row].narrow(0, position, count)
            gathered.setdefault(slot, []).append((at, part if whole else part.to(
                device, copy=True)))

    def end_chunk(self) -> bool:
        """Each compared sequence's tokens at each site, end to end (a site whose tokens
        do not follow one another is not laid out token by token)."""
        while self._gathered:  # each site's pieces freed once joined
            key, by_slot = self._gathered.popitem()
            stored = self.rows[key]
            if stored.parts is None or stored.firsts is None:
                continue
            for slot, pieces in by_slot.items():
                pieces.sort(key=lambda piece: piece[0])
                ends = [at + part.shape[0] for at, part in pieces]
                if any(at != end for (at, _), end in zip(pieces[1:], ends, strict=False)):
                    stored.drop(Status.NOT_PER_TOKEN)
                    break
                try:
                    joined = torch.cat([part for _, part in pieces]) if len(pieces) > 1 else (
                        _own(pieces[0][1]))
                except RuntimeError:  # other shapes in other calls
                    stored.drop(Status.SHAPE_MISMATCH)
                    break
                stored.parts[slot] = joined
                stored.firsts[slot] = pieces[0][0]
            else:
                stored.filled += len(by_slot)
        return True

    @property
    def stored_bytes(self) -> int:
        return super().stored_bytes + sum(
            p.numel() * p.element_size() for stored in self.rows.values()
            for p in (stored.parts or ()) if p is not None)


def _own(part: torch.Tensor) -> torch.Tensor:
    """``part`` as a tensor of its own memory (a view into a call's copy is copied)."""
    base = part._base if part._base is not None else part
    return part if base.numel() == part.numel() else part.clone()


class _Chunk(Gate):
    """The sink of a layout's pass: every call observed; notes the pass's rows."""

    start: int = 0
    stop: int = 0

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        self.start, self.stop = start, stop
        super().begin_chunk(start, stop, tracker)


@dataclass
class LayoutDriver:
    """Runs each pass of run a or b (:attr:`which`, set around it by the kind) in that
    run's layout: the pass's sequences (read from its padded input, so that a pass over
    other tokens lays out those) go to the model in one or several forward calls, each
    told to the sink as a :meth:`Sink.piece`.

    ``tokens``: the comparison's input (where decoding begins, what is compared);
    ``settings``: ``generate()``'s (the decode layout's: pad and end-of-sequence ids).
    """

    a: Layout
    b: Layout
    tokens: TokenInput
    settings: dict[str, Any] = field(default_factory=dict)
    which: str = "b"
    _sinks: list[_Chunk] = field(default_factory=list)

    def observed(self, sink: Sink) -> Sink:
        chunk = _Chunk(sink, active=True)
        self._sinks.append(chunk)
        return chunk

    @property
    def layout(self) -> Layout:
        return self.a if self.which == "a" else self.b

    def run(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            tracker: Tracker) -> Any:
        sink = self._sinks[-1]
        sequences = _unpadded(kwargs)
        layout = self.layout
        compared = [self.tokens.counted(i) for i in range(sink.start, sink.stop)]

        def call(tokens: TokenMap, rows: int, inputs: dict[str, Any]) -> Any:
            tracker.reset(rows)
            sink.piece(tokens, rows)
            return model(**inputs)

        if layout.name in Layout.ONE_PASS:  # in one call, or in micro-batches
            laid = replace(self.tokens, prompts=self.tokens.source.like(sequences),
                           compared=tuple(compared))
            count = len(sequences)
            step = layout.size or count
            out = None
            for low in range(0, count, step):
                high = min(low + step, count)
                inputs, tokens = laid.one_pass(layout.whole, low, high)
                out = call(tokens.widened(low, count),
                           1 if layout.name == "packed" else high - low, inputs)
            return out
        if layout.name == "decode":
            return self._decode(model, sequences, compared, sink, tracker)
        out = None
        word = cache_word(model) or "past_key_values"
        for i, sequence in enumerate(sequences):
            out = self._cached(sequence, i, len(sequences), compared[i], layout, call, word)
        return out

    def _cached(self, sequence: torch.Tensor, index: int, count: int, compared: int,
                layout: Layout, call: Any, word: str) -> Any:
        """One sequence alone: in one call, in chunks, or continued from its prefix's
        cache (each a forward call through the KV cache, which the model calls
        ``word``)."""
        n = sequence.numel()
        if layout.name == "alone":
            bounds = [0, n]
        elif layout.name == "chunked":
            assert layout.size is not None
            bounds = [*range(0, n, layout.size), n]
        else:
            assert layout.size is not None
            bounds = [0, layout.size, n]
        cache, out = None, None
        for low, high in itertools.pairwise(bounds):
            offsets = [0] * count
            valid = [0] * count
            starts = [0] * count
            valid[index] = max(0, min(high, compared) - low)
            starts[index] = low
            tokens = TokenMap(high - low, tuple(offsets), tuple(valid), rows=(0,) * count,
                              starts=tuple(starts))
            positions = torch.arange(low, high, device=sequence.device)
            inputs: dict[str, Any] = {"input_ids": sequence[low:high].unsqueeze(0),
                                      "position_ids": positions.unsqueeze(0)}
            if layout.cached:
                inputs |= {"use_cache": True, "cache_position": positions,
                           word: cache}
            out = call(tokens, 1, inputs)
            if layout.cached:
                cache = getattr(out, word, None)
                if cache is None:
                    raise DivtraceValueError(
                        f"the {layout.label()} layout goes through the model's KV cache, "
                        f"and the model returned none (past_key_values): use a model with "
                        f"a KV cache (a Hugging Face causal LM), or the 'alone' layout")
                if layout.name == "prefix":
                    cache = copy.deepcopy(cache)  # the prefix's cache, reused by a copy
        return out

    def _decode(self, model: nn.Module, sequences: list[torch.Tensor], compared: list[int],
                sink: _Chunk, tracker: Tracker) -> Any:
        """The prompts through the model's own ``generate()``, every forward call of it
        observed: the prefill, then one token per row and step, each step's token the
        sequence's own (forced: a rollout's computation replayed, whatever the logits of
        this pass favour)."""
        starts = self.tokens.starts
        assert starts is not None
        prompts = [s[:starts[sink.start + i]] for i, s in enumerate(sequences)]
        source = self.tokens.source
        padded = Prompts(prompts, padding_side="left", pad_token_id=source.pad_token_id)
        inputs, prefill = pad(padded, 0, len(prompts))  # as generate() wants them
        inputs.pop("position_ids", None)
        length = prefill.length
        new = [s[p.numel():] for s, p in zip(sequences, prompts, strict=True)]
        count = len(prompts)
        calls = 0

        def begin(_module: nn.Module, _args: Any, _kwargs: Any) -> None:
            nonlocal calls
            tracker.reset(count)
            if calls == 0:
                valid = tuple(min(c, p.numel()) for c, p in zip(compared, prompts, strict=True))
                sink.piece(TokenMap(length, prefill.offsets, valid), count)
            else:  # step t feeds each row's token t - 1 after its prompt
                at = tuple(p.numel() + calls - 1 for p in prompts)
                valid = tuple(int(a < c) for a, c in zip(at, compared, strict=True))
                sink.piece(TokenMap(1, (0,) * count, valid, starts=at), count)
            calls += 1

        forced = _Forced(new, length)
        handle = model.register_forward_pre_hook(begin, with_kwargs=True, prepend=True)
        try:
            run = model.generate
            return run(**inputs, max_new_tokens=forced.table.shape[1],  # type: ignore[operator]
                       do_sample=False, return_dict_in_generate=True,
                       logits_processor=[forced], **self.settings)
        finally:
            handle.remove()


class _Forced:
    """A logits processor for ``generate()``: each row's next token is its sequence's
    (``new``: per row the tokens after its prompt; ``length``: the padded prompts'); past
    a sequence's end, token 0 (never compared)."""

    def __init__(self, new: list[torch.Tensor], length: int) -> None:
        steps = max(t.numel() for t in new)
        self.table = torch.zeros(len(new), steps, dtype=torch.long, device=new[0].device)
        for row, tokens in enumerate(new):
            self.table[row, :tokens.numel()] = tokens
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.length
        forced = torch.full_like(scores, -math.inf)
        return forced.scatter_(1, self.table[:, step:step + 1].to(scores.device), 0.0)


def cache_word(model: nn.Module) -> str | None:
    """What ``model``'s forward call names its KV cache: ``cache`` (newer Hugging Face
    models) or ``past_key_values``; None: it takes none."""
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return None
    return next((word for word in ("cache", "past_key_values") if word in names), None)


def _unpadded(kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The sequences of a padded pass's input: each row's real tokens."""
    ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
    return [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
