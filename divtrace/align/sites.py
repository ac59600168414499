"""Sites: what a site is, its key, and the tensors inside a (nested) output."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from divtrace.align.status import Status
from divtrace.compat import pytree

__all__ = ["CONSTANT", "INPUT", "ROOT", "Site", "flatten_output", "input_site", "op_key",
           "replaced", "site_key"]

#: The name under which the model itself (its final output) appears in the table.
ROOT = "(model)"
#: The producer of the model's own input tensors: the same rows in both runs.
INPUT = "(input)"
#: The producer of tensors that hold no per-sample data: parameters, buffers, tensors
#: made from nothing (``torch.arange``, ``torch.ones``) and tensors without the batch
#: dimension. Like a module's weights, they count as part of the op that reads them.
CONSTANT = "(constant)"


@dataclass(frozen=True)
class Site:
    """Where a tensor was observed: a module call's output, or a tensor inside it.

    ``input`` is set for the pseudo-site of a leaf call's input that no observed module
    made (e.g. the result of a functional op): the index of that input among the call's
    tensor arguments. Such sites feed the lineage; they are not rows of the table.
    ``opaque`` is set for a tensor that is not per-sample data by construction (a field of
    a PackedSequence): why it is reported, never compared.

    An *op site* (``op`` set: the ATen overload, e.g. ``aten.bmm.default``) is a tensor an
    ATen op produced; ``module`` and ``call`` are then its scope, the innermost module call
    that ran it, and ``index`` counts the earlier calls of the same op in that scope call.
    """

    key: str
    module: str
    module_type: str
    call: int
    path: str
    leaf: bool
    input: int | None = None
    opaque: Status | None = None
    op: str = ""
    index: int = 0

    @property
    def is_output(self) -> bool:
        """Whether this is (a tensor of) the model's own output (not an op run in it)."""
        return self.module == ROOT and not self.op

    @property
    def scope(self) -> str:
        """The module call this site belongs to (for an op site: the one that ran it)."""
        return site_key(self.module, self.call, "")

    @property
    def call_key(self) -> str:
        """The key of the call this site is an output of (no output path): a module call,
        or for an op site the op call."""
        return op_key(self.scope, self.op, self.index) if self.op else self.scope


def site_key(module: str, call: int, path: str) -> str:
    """The key of a site, e.g. ``features.3``, ``layer1.0.relu#1``, ``encoder/logits``.

    ``#k`` is added for the (k+1)-th call of a module within one forward pass, and
    ``/path`` for a tensor inside a nested output.
    """
    key = module if call == 0 else f"{module}#{call}"
    return f"{key}/{path}" if path else key


def op_key(scope: str, op: str, index: int) -> str:
    """The key of an op call, e.g. ``layers.0.self_attn:aten.bmm#1``: its scope's key, the
    op's name without the overload, and ``#k`` for the (k+1)-th such op in that scope call.
    """
    name = op.rsplit(".", 1)[0] if op.count(".") > 1 else op
    return f"{scope}:{name}" if index == 0 else f"{scope}:{name}#{index}"


def input_site(call: Site, index: int) -> Site:
    """The pseudo-site under which an unseen input of the leaf call ``call`` is recorded."""
    path = f"<in{index}>"
    return Site(f"{call.key}{path}", call.module, call.module_type, call.call, path, True,
                input=index, op=call.op, index=call.index)


def _key_str(entry: Any) -> str:
    if isinstance(entry, pytree.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, pytree.MappingKey):
        return str(entry.key)
    if isinstance(entry, pytree.GetAttrKey):
        return entry.name
    return str(entry)


def _packed(value: Any) -> bool:
    return isinstance(value, PackedSequence)


def flatten_output(output: Any, prefix: str = ""
                   ) -> list[tuple[str, torch.Tensor, Status | None]]:
    """The tensors in a (nested) module output: ``(path, tensor, opaque)`` each.

    Tuples, lists, dicts and named tuples are flattened by ``torch.utils._pytree``;
    dataclass instances that pytree does not know are opened field by field. Anything
    that is not a tensor is skipped. The fields of a PackedSequence are not per-sample
    data: their ``opaque`` says so (else it is None).
    """
    found: list[tuple[str, torch.Tensor, Status | None]] = []
    leaves, _ = pytree.tree_flatten_with_path(output, is_leaf=_packed)
    for keys, leaf in leaves:
        path = "/".join([prefix] * bool(prefix) + [_key_str(k) for k in keys])
        if isinstance(leaf, torch.Tensor):
            found.append((path, leaf, None))
        elif _packed(leaf):
            found.extend((f"{path}/{name}" if path else name, value, Status.NOT_PER_SAMPLE)
                         for name, value in zip(leaf._fields, leaf, strict=True)
                         if isinstance(value, torch.Tensor))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf)}
            found.extend(flatten_output(fields, path))
    return found


def replaced(output: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``output`` rebuilt with the tensors at the given paths (as :func:`flatten_output`
    names them) in place of its own; containers that pytree knows only."""
    leaves, spec = pytree.tree_flatten_with_path(output, is_leaf=_packed)
    return pytree.tree_unflatten(
        [tensors.get("/".join(_key_str(k) for k in keys), leaf) for keys, leaf in leaves], spec)
