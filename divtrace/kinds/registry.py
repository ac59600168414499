"""The built-in kinds, and the kind a plan is of."""

from __future__ import annotations

from divtrace.kinds.accumulation import Accumulation
from divtrace.kinds.compiled import CompiledRegions
from divtrace.kinds.decode import DecodeStep
from divtrace.kinds.kind import Kind, Paired
from divtrace.kinds.models import TwoModels
from divtrace.kinds.padded import Padded
from divtrace.kinds.prompts import Ragged
from divtrace.kinds.sharded import Sharded
from divtrace.kinds.shards import OnRanks
from divtrace.kinds.tokens import Tokens
from divtrace.plan.make import Plan

__all__ = ["GIVEN", "KINDS", "PAIRS", "ROWS", "kind_of"]

#: The built-in kinds a plan made without ``kind=`` may be of, asked in turn (the first
#: that claims it): how the input's rows are read (prompts of different lengths, else
#: :class:`Kind` itself, the batched run against the split run), then which runs are
#: paired (another model, sharded or not; a sharded model with itself), which reads the
#: rows as the first one does.
ROWS: tuple[type[Kind], ...] = (Ragged, Kind)
PAIRS: tuple[type[Paired], ...] = (Sharded, TwoModels, OnRanks)
KINDS: tuple[type[Kind], ...] = (*PAIRS, *ROWS)
#: The built-in kinds that are only ever given: by a face (one backward over the batch
#: against accumulation, one step of decoding, two token layouts, compiled regions) or a
#: remedy's replay (every pass padded).
GIVEN: tuple[type[Kind], ...] = (Accumulation, DecodeStep, Tokens, CompiledRegions, Padded)


def kind_of(plan: Plan) -> Kind:
    """The kind ``plan`` is of: the one it was given, else the built-in one that claims
    it."""
    given = plan.kind
    if isinstance(given, Kind):
        return given
    rows = next(kind for kind in ROWS if kind.claims(plan))()
    pair = next((kind for kind in PAIRS if kind.claims(plan)), None)
    return rows if pair is None else pair(rows)
