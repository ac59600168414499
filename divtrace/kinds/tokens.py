"""The same sequences in two token layouts (``compare_layouts``, ``compare_rollout``):
each run lays them out its own way — padded, packed, alone, decoded through the KV cache,
prefilled in chunks, continued from a reused prefix — and every site is compared token
by token, each compared sequence's tokens against the same tokens in the other run."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from divtrace.errors import DivtraceValueError
from divtrace.kinds.prompts import Ragged
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.measure.tokens import TokenMeter
from divtrace.plan.inputs import BatchedInput
from divtrace.plan.make import Plan
from divtrace.plan.runs import Run
from divtrace.plan.tokens import TokenInput
from divtrace.record.ragged import RaggedStore
from divtrace.record.rows import RowStore
from divtrace.record.tokens import LayoutDriver, TokenStore

__all__ = ["Tokens"]


def _tokens(plan: Plan) -> TokenInput:
    batch = plan.batch
    assert isinstance(batch, TokenInput)
    return batch


@dataclass(frozen=True)
class Tokens(Ragged):
    """Run a in ``driver.a``'s layout against run b in ``driver.b``'s (one forward call:
    padded or packed), each compared sequence token by token."""

    driver: LayoutDriver
    name: ClassVar[str] = "token layouts"
    cannot: ClassVar[Mapping[str, str]] = {
        **Ragged.cannot,
        "padded": "the runs lay the same tokens out in calls of other lengths, not only of "
                  "other rows: no batch size makes their calls one shape (the decode layout "
                  "keeps every sequence in its batch at every step already)"}

    @staticmethod
    def claims(plan: Plan) -> bool:
        return False  # only ever given: compare_layouts, compare_rollout

    def runs(self, a: Run | None, b: Run | None) -> tuple[Run | None, Run | None]:
        """Each run takes every sequence in one pass of its layout."""
        return (Run(name=self.driver.a.label()), Run(name=self.driver.b.label()))

    def prepared(self, plan: Plan) -> Plan:
        """The input run by the driver; run b in several calls recorded as run a is (its
        parts then measured end to end), in one pass over every sequence."""
        plan = replace(plan, batch=replace(_tokens(plan), driver=self.driver))
        if self.driver.b.one_pass:
            return plan
        return replace(plan, b_chunks=((0, plan.batch.batch_size),))

    def check(self, plan: Plan) -> None:
        if not isinstance(plan.batch, TokenInput):
            raise DivtraceValueError(
                "the token-layouts kind compares sequences: give them through "
                "divtrace.compare_layouts(model, sequences, a=..., b=...)")

    def store(self, plan: Plan, samples: list[int], *, offload: bool = False,
              pinned: bool = False, learn_lineage: bool = True) -> RowStore:
        return TokenStore(samples, 0, offload, learn_lineage=learn_lineage, pinned=pinned,
                          tokens=_tokens(plan))

    def meter(self, plan: Plan, store: RowStore, host: Host, **options: Any) -> Meter:
        size = plan.batch.batch_size
        tokens = _tokens(plan).one_pass(self.driver.b, 0, size)[1] if (
            self.driver.b.one_pass) else None  # run b's calls are recorded: laid per site
        return TokenMeter(store, size, host, plan.rtol, plan.atol, layout=tokens, **options)

    def alone(self, plan: Plan) -> tuple[BatchedInput, RowStore, list[tuple[int, int]]]:
        """Each compared sequence alone, in one forward call, its compared tokens."""
        picked = plan.batch.select(list(plan.samples))
        assert isinstance(picked, TokenInput)
        count = len(plan.samples)
        store = RaggedStore(list(range(count)), 0, False, learn_lineage=False, ragged=picked)
        return picked, store, [(i, i + 1) for i in range(count)]

    def real(self, plan: Plan, chunk: tuple[int, int]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda tensor: tensor

    def around(self, which: str) -> AbstractContextManager[Any]:
        return self._laid_out(which)

    @contextmanager
    def _laid_out(self, which: str) -> Iterator[None]:
        """Passes of run ``which`` in its layout."""
        before = self.driver.which
        self.driver.which = which
        try:
            yield
        finally:
            self.driver.which = before
