"""The lineage of op sites: what made each tensor a pass's ops read, and what the ops are.

Between ops a tensor may have no Python object, so entries are keyed by the tensor's C++
object; an entry holds the tensor's version and its memory's count of in-place writes
when it was made (an alias may write to the memory under a version counter of its own).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from divtrace.align.sites import CONSTANT, INPUT, Site
from divtrace.compat import impl, pytree, version
from divtrace.record.recorder import Tracker

__all__ = ["CASTS", "MOVES", "PART", "Kind", "OpTracker", "keeps_dtype", "kind_of",
           "op_outputs", "per_sample", "storage", "written_args"]

#: Ops that return their input's values in a new tensor.
MOVES = frozenset({"aten::clone", "aten::_unsafe_view", "aten::alias", "aten::detach",
                    "aten::lift_fresh", "aten::lift_fresh_copy"})
#: Ops that copy values, maybe into another dtype: a site only when they cast.
CASTS = frozenset({"aten::_to_copy", "aten::copy_"})
#: What made a tensor that holds per-sample data but is no site's whole output (a part
#: of one, a view when views are not followed, what an op outside the scopes made): an
#: op reading it gets it recorded under a pseudo-site of its own.
PART = "(part)"


class Kind(Enum):
    VIEW = 1  # a view or a move: no site, the lineage passes through
    CAST = 2  # a copy: a view when the dtype stays, else an op
    OP = 3  # a site, when it reads per-sample data


def kind_of(func: Any) -> Kind:
    if func.is_view or func.name() in MOVES:
        return Kind.VIEW
    return Kind.CAST if func.name() in CASTS else Kind.OP


def storage(tensor: torch.Tensor) -> int:
    """The address of a tensor's memory (0 for one without plain storage)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def written_args(func: Any) -> tuple[int, ...]:
    """The positions of the arguments an op writes to (``add_``'s self, ``out=``)."""
    return tuple(i for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def keeps_dtype(func: Any, tensors: list[torch.Tensor], kwargs: dict[str, Any]) -> bool:
    """Whether a copy keeps the dtype (``_to_copy(x, dtype=...)``, ``copy_(dst, src)``)."""
    if func.name() == "aten::copy_":
        return len(tensors) > 1 and tensors[0].dtype == tensors[1].dtype
    return kwargs.get("dtype") in (None, tensors[0].dtype)


def op_outputs(out: Any) -> list[tuple[str, torch.Tensor]]:
    """An op's output tensors with their paths: ``""`` for a single tensor, else the
    position among the outputs (``aten.native_layer_norm``'s ``/0``, ``/1``, ``/2``)."""
    if isinstance(out, torch.Tensor):
        return [("", out)]
    return [(str(i), t) for i, t in enumerate(pytree.tree_leaves(out))
            if isinstance(t, torch.Tensor)]


def per_sample(tensor: torch.Tensor, batch_dim: int, rows: int) -> torch.Tensor:
    """``tensor`` with the batch in a dimension of its own: inside ops the batch is often
    merged with the next dimension (``[B * heads, S, D]`` for a ``bmm``); a size that is
    ``k`` times the rows is read as ``[rows, k]`` (batch-major, as ``view`` makes it)."""
    if tensor.is_nested or tensor.dim() == 0 or rows <= 0:
        return tensor  # a nested tensor is reported, not compared
    dim = batch_dim % tensor.dim()
    size = tensor.shape[dim]
    if size == rows or size % rows:
        return tensor
    return tensor.unflatten(dim, (rows, size // rows))


@dataclass
class OpTracker(Tracker):
    """A pass's state with ops: which call of each module is running, and which op site
    made which tensor (apart from the module sites' lineage, which stays as it is)."""

    entered: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: per (scope, its call, op): how many such op calls ran
    op_calls: defaultdict[tuple[str, int, Any], int] = field(
        default_factory=lambda: defaultdict(int))
    running: dict[str, int] = field(default_factory=dict)
    #: per tensor (by its C++ object): what made it, its version and its memory's writes
    #: then, and a weak reference to it (a tensor made unseen — ``torch.tensor(...)`` —
    #: may take the address of a freed one: the reference tells them apart)
    made_by_op: dict[int, tuple[str | None, int, int, weakref.ref[torch.Tensor]]] = field(
        default_factory=dict)
    #: per storage: how many in-place ops wrote to it (an alias may carry another version
    #: counter than the tensor it shares memory with)
    writes: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))
    #: the last op's outputs, handed on once the op has returned (see :class:`_OpMode`)
    pending: list[tuple[str | None, torch.Tensor, Site | None]] = field(default_factory=list)

    def reset(self, rows: int = 0) -> None:
        super().reset(rows)
        self.entered.clear()
        self.op_calls.clear()
        self.running.clear()
        self.made_by_op.clear()
        self.writes.clear()
        self.pending.clear()

    def produced(self, key: str, tensor: torch.Tensor) -> None:
        super().produced(key, tensor)
        if key == INPUT:  # the model's input: per-sample when cut, else a constant
            cut = tensor.dim() > 0 and self.rows in tensor.shape
            self.note(INPUT if cut else CONSTANT, tensor)

    def note(self, key: str | None, tensor: torch.Tensor) -> None:
        """The op site ``key`` (or INPUT, CONSTANT; None: an op that is no site) made
        ``tensor``."""
        writes = self.writes
        count = writes.get(storage(tensor), 0) if writes else 0  # no write yet: no lookup
        self.made_by_op[impl(tensor)] = (key, version(tensor), count, weakref.ref(tensor))

    def maker(self, tensor: torch.Tensor) -> str | None:
        """What made this very tensor, unchanged since (None: nothing seen in this pass)."""
        entry = self.made_by_op.get(impl(tensor))
        if entry is None or version(tensor) != entry[1] or entry[3]() is not tensor:
            return None
        writes = self.writes
        if writes and entry[2] != writes.get(storage(tensor), 0):
            return None
        return entry[0]

    def writes_to(self, tensor: torch.Tensor) -> int:
        writes = self.writes
        return writes.get(storage(tensor), 0) if writes else 0

    def wrote(self, tensors: list[torch.Tensor]) -> None:
        """An in-place op wrote to these tensors' memory."""
        for tensor in tensors:
            self.writes[storage(tensor)] += 1


