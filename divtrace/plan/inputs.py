"""The model's input: which tensors carry the batch, along which dimension, and how big."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from divtrace.compat import pytree
from divtrace.errors import DivtraceTypeError, DivtraceValueError, DivtraceWarning
from divtrace.plan.replace import replaced, replacements

__all__ = ["BatchDim", "BatchedInput", "Driver", "each_once", "prepare_input"]

#: ``batch_dim=``: one dimension for every input tensor, or a structure matching ``x``
#: (a tuple for a tuple, a dict for a dict; an int or None for a whole argument), where
#: None keeps that input whole.
BatchDim = int | None | tuple[Any, ...] | list[Any] | dict[str, Any]


class Driver(Protocol):
    """How a pass runs the model when it is not one forward call (e.g. ``generate()`` up
    to a step): an input may carry one as its ``driver``. Its sink and tracker are the
    recorder's (:class:`divtrace.record.recorder.Sink`, ``Tracker``): a later stage's
    types, which the plan only hands on."""

    def observed(self, sink: Any) -> Any:
        """The sink the recorder hands tensors to (only those of the observed call)."""

    def run(self, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            tracker: Any) -> Any:
        """Runs the pass; returns its output."""


def each_once(leaves: Iterable[Any], change: Callable[[Any], Any],
              key: Callable[[Any], Hashable] = id) -> list[Any]:
    """``change`` applied to each leaf, once per ``key`` (the object): a tensor given
    twice (``mha(x, x, x)``, whose fast path needs ``query is key``) stays one tensor."""
    made: dict[Hashable, Any] = {}
    out = []
    for leaf in leaves:
        found = key(leaf)
        if found not in made:
            made[found] = change(leaf)
        out.append(made[found])
    return out


def _leaf_and_dim(pair: tuple[Any, int | None]) -> tuple[int, int | None]:
    return id(pair[0]), pair[1]


@dataclass(frozen=True)
class BatchedInput:
    """The user's input, flattened, with the tensors that carry the batch marked.

    Attributes:
        leaves: The flattened ``(args, kwargs)`` pair.
        spec: The pytree spec that rebuilds ``(args, kwargs)`` from ``leaves``.
        dims: For each leaf, the dimension it is cut along (None: passed whole).
        names: For each leaf, how messages name it (``x``, ``x[1]``, ``x['mask']``).
        batch_size: B, the size of the batch dimension.
        batch_dim: The batch dimension of the observed outputs (that of the first cut
            input tensor, as the user gave it).
        driver: How a pass runs the model when it is not one forward call (None: one
            forward call).
    """

    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec
    dims: tuple[int | None, ...]
    names: tuple[str, ...]
    batch_size: int
    batch_dim: int
    driver: Driver | None = None

    def row_leaves(self, start: int, stop: int, copy: bool = False) -> list[Any]:
        """The leaves holding rows ``start:stop`` of every cut tensor: views (the inputs as
        given for the whole batch), or with ``copy`` fresh copies of every tensor, for a
        pass that may change its input in place."""
        def rows_of(pair: tuple[Any, int | None]) -> Any:
            leaf, dim = pair
            part = leaf if dim is None or (start == 0 and stop == self.batch_size) else (
                leaf.narrow(dim, start, stop - start))
            return part.clone() if copy and isinstance(part, torch.Tensor) else part

        return each_once(zip(self.leaves, self.dims, strict=True), rows_of, _leaf_and_dim)

    def build(self, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` from leaves in the order of :attr:`leaves`."""
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def rows(self, start: int, stop: int, copy: bool = False
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` holding rows ``start:stop`` (see :meth:`row_leaves`)."""
        return self.build(self.row_leaves(start, stop, copy))

    def select(self, rows: list[int]) -> BatchedInput:
        """The batch of only these rows, in this order."""
        index = torch.tensor(rows)
        leaves = tuple(each_once(
            zip(self.leaves, self.dims, strict=True),
            lambda pair: pair[0] if pair[1] is None else pair[0].index_select(
                pair[1], index.to(pair[0].device)), _leaf_and_dim))
        return BatchedInput(leaves, self.spec, self.dims, self.names, len(rows),
                            self.batch_dim)

    def replaced(self, fixed: list[int]) -> tuple[BatchedInput, list[int]]:
        """The same batch, every row but ``fixed`` given other valid data, and the rows
        that could not be made to differ (see :func:`divtrace.plan.replace.replaced`)."""
        return replaced(self, fixed)

    def replacements(self, groups: list[list[int]]) -> Iterator[tuple[BatchedInput, list[int]]]:
        """:meth:`replaced` of each group in turn, one wait for the device for all of them
        (see :func:`divtrace.plan.replace.replacements`)."""
        return replacements(self, groups)

    def whole(self, copy: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` exactly as the user gave them (or copies of them)."""
        return self.rows(0, self.batch_size, copy)


def _list_message(x: list[torch.Tensor]) -> str:
    """What a list of tensors most likely is, and what to pass instead."""
    shapes = [tuple(t.shape) for t in x]
    if len(x) == 1:
        return (f"x is a list of one tensor of shape {shapes[0]} (a DataLoader over a "
                f"TensorDataset gives [batch]): pass the tensor itself, x[0]")
    batched = all(t.dim() for t in x) and len({t.shape[0] for t in x}) == 1 and (
        len(set(shapes)) > 1)  # one batch of several inputs; alike ones are samples
    if batched:  # e.g. [inputs, labels] from a DataLoader
        return (f"x is a list of {len(x)} tensors of shapes {shapes}, all with "
                f"{x[0].shape[0]} rows (a DataLoader's [inputs, labels]?): pass the model's "
                f"input, x[0], or all of them as positional arguments, tuple(x)")
    return (f"x is a list of {len(x)} tensors of shapes {shapes}; if they are samples, "
            f"stack them into one batch (torch.stack(x)); if they are the model's "
            f"positional arguments, pass them as a tuple (tuple(x))")


def _split_x(x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(x, torch.Tensor):
        return (x,), {}
    if isinstance(x, tuple):
        return x, {}
    if isinstance(x, dict):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise DivtraceTypeError(
                f"x is a dict, so its keys must be the model's keyword argument names "
                f"(str); got the key(s) {bad!r}")
        return (), dict(x)
    if isinstance(x, list) and x and all(isinstance(v, torch.Tensor) for v in x):
        raise DivtraceTypeError(_list_message(x))
    if type(x).__module__ == "numpy" and hasattr(x, "shape"):
        raise DivtraceTypeError(
            f"x is a NumPy array of shape {tuple(x.shape)}; pass a tensor: "
            f"torch.from_numpy(x) (and .float() for float64 data and a float32 model)")
    if isinstance(x, torch.utils.data.Dataset):
        raise DivtraceTypeError(
            f"x is a {type(x).__name__}, a dataset; divtrace compares one batch: take one, "
            f"e.g. next(iter(torch.utils.data.DataLoader(x, batch_size=32))) (for "
            f"[inputs, labels], its inputs: [0])")
    if isinstance(x, torch.utils.data.DataLoader) or (
            hasattr(x, "__iter__") and hasattr(x, "batch_size")):
        raise DivtraceTypeError(
            f"x is a {type(x).__name__}; divtrace compares one batch: pass "
            f"x=next(iter(loader)) (for a TensorDataset's [inputs, labels], pass the "
            f"inputs only: next(iter(loader))[0])")
    raise DivtraceTypeError(
        f"x must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments; got {type(x).__name__}. Wrap a single non-tensor argument as (x,)")


def _key(entry: Any) -> str:
    if isinstance(entry, pytree.SequenceKey):
        return f"[{entry.idx}]"
    if isinstance(entry, pytree.MappingKey):
        return f"[{entry.key!r}]"
    if isinstance(entry, pytree.GetAttrKey):
        return f".{entry.name}"
    return str(entry)


def _names(x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """How messages name each leaf of ``(args, kwargs)``: as a path into ``x``."""
    paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    names = []
    for keys, _leaf in paths:
        inner = keys[2:] if not isinstance(x, torch.Tensor) else ()
        head = "x" + (_key(keys[1]) if not isinstance(x, torch.Tensor) else "")
        names.append(head + "".join(_key(k) for k in inner))
    return names


def _is_index(value: Any) -> bool:
    """An int (or NumPy integer), not a bool."""
    return hasattr(value, "__index__") and not isinstance(value, bool)


def _broadcast(spec: Any, value: Any, name: str) -> list[int | None]:
    """One requested dimension per pytree leaf of ``value``, from the matching part of a
    ``batch_dim`` structure."""
    if spec is None or _is_index(spec):
        dim = None if spec is None else operator.index(spec)
        return [dim] * len(pytree.tree_leaves(value))
    if isinstance(spec, tuple | list) and isinstance(value, tuple | list):
        if len(spec) != len(value):
            raise DivtraceValueError(
                f"batch_dim for {name} has {len(spec)} entries but {name} has "
                f"{len(value)}; give one entry (an int, or None to keep it whole) per item")
        return [d for i, (s, v) in enumerate(zip(spec, value, strict=True))
                for d in _broadcast(s, v, f"{name}[{i}]")]
    if isinstance(spec, dict) and isinstance(value, dict):
        unknown = [k for k in spec if k not in value]
        if unknown:
            raise DivtraceValueError(
                f"batch_dim names {unknown} but {name} has the keys {list(value)}")
        return [d for k, v in value.items() for d in _broadcast(spec.get(k), v, f"{name}[{k!r}]")]
    raise DivtraceTypeError(
        f"batch_dim for {name} must be an int, None, or a structure matching it (a tuple "
        f"for a tuple, a dict for a dict); got {spec!r}")


def _requested(x: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               batch_dim: Any) -> list[int | None] | None:
    """Per leaf, the dimension a ``batch_dim`` structure asks for (None: not a structure)."""
    if batch_dim is None or _is_index(batch_dim):
        return None
    if isinstance(x, torch.Tensor):
        raise DivtraceTypeError(
            f"x is one tensor, so batch_dim must be an int; got {batch_dim!r}")
    return _broadcast(batch_dim, args if isinstance(x, tuple) else kwargs, "x")


def _refuse_lists(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> None:
    """A list of tensors as one argument is a list of samples (images for a detection
    model, say): cutting each tensor along ``batch_dim`` would be wrong."""
    for name, value in [*((f"x[{i}]", a) for i, a in enumerate(args)),
                        *((f"x[{k!r}]", v) for k, v in kwargs.items())]:
        if isinstance(value, list) and value and all(isinstance(v, torch.Tensor)
                                                     for v in value):
            raise DivtraceValueError(
                f"{name} is a list of {len(value)} tensors (samples such as the images of a "
                f"detection model?); divtrace cuts tensors along batch_dim={batch_dim}, so it "
                f"would take dimension {batch_dim} of each (size {value[0].shape[batch_dim]} "
                f"for the first) as the batch. Stack them into one tensor if the model "
                f"accepts that; lists of samples cannot be split yet")


def _auto_dims(leaves: list[Any], names: list[str], batch_dim: int, stacklevel: int
               ) -> tuple[list[int | None], int]:
    """One ``batch_dim`` for every tensor: those of size B there are cut."""
    tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    batched = [(i, t) for i, t in tensors if -t.dim() <= batch_dim < t.dim()]
    if not batched:
        shapes = ", ".join(str(tuple(t.shape)) for _, t in tensors)
        raise DivtraceValueError(
            f"no tensor in x has a batch dimension {batch_dim} (shapes: {shapes}); "
            f"add one, e.g. x.unsqueeze(0), or pass batch_dim=")
    first = batched[0][1]
    size = first.shape[batch_dim]
    dims: list[int | None] = [None] * len(leaves)
    odd, ambiguous = [], []
    for i, t in batched:
        if t.shape[batch_dim] != size:
            odd.append(f"{names[i]} with shape {tuple(t.shape)}")
            continue
        dims[i] = batch_dim % t.dim()
        if t.dim() == 1 and first.dim() > 1:
            ambiguous.append(f"{names[i]} (shape {tuple(t.shape)})")
    if odd:
        warnings.warn(
            f"B={size} (from the first tensor in x), but these tensors have another "
            f"size at batch_dim={batch_dim} and pass through whole: {'; '.join(odd)}. If "
            f"they carry the batch too, fix their shape or batch_dim",
            DivtraceWarning, stacklevel=stacklevel)
    if ambiguous:
        warnings.warn(
            f"{', '.join(ambiguous)}: cut per sample because the size at batch_dim="
            f"{batch_dim} equals B={size}. If it is not per-sample data (a bias, a vector "
            f"of weights), keep it whole with a batch_dim structure, e.g. "
            f"batch_dim={{'x': 0, 'bias': None}}", DivtraceWarning, stacklevel=stacklevel)
    return dims, size


def _explicit_dims(leaves: list[Any], names: list[str], requested: list[int | None]
                   ) -> tuple[list[int | None], int, int]:
    """The dimensions a ``batch_dim`` structure names; every cut tensor must have B rows."""
    dims: list[int | None] = [None] * len(leaves)
    size = given = None
    for i, (leaf, dim) in enumerate(zip(leaves, requested, strict=True)):
        if dim is None or not isinstance(leaf, torch.Tensor):
            continue
        if not -leaf.dim() <= dim < leaf.dim():
            raise DivtraceValueError(
                f"batch_dim asks for dimension {dim} of {names[i]}, which has shape "
                f"{tuple(leaf.shape)}")
        if size is None:
            size, given = leaf.shape[dim], dim
        elif leaf.shape[dim] != size:
            raise DivtraceValueError(
                f"{names[i]} has {leaf.shape[dim]} rows at its batch dimension {dim}, but B="
                f"{size} (from the first cut tensor); fix its batch_dim entry, or None to "
                f"keep it whole")
        dims[i] = dim % leaf.dim()
    if size is None or given is None:
        raise DivtraceValueError("batch_dim keeps every tensor of x whole: there is no batch "
                                 "to split; give the batch dimension of at least one")
    return dims, size, given


def prepare_input(x: Any, batch_dim: BatchDim = 0, stacklevel: int = 3) -> BatchedInput:
    """Validates ``x`` and ``batch_dim`` and finds the batch size B.

    With one ``batch_dim`` for all, B is the size there of the first tensor (in argument
    order) that has that dimension; other tensors of that size are cut too (a 1-D one
    beside a batched one with a warning: it may not be per-sample data), tensors of another
    size pass through whole with a warning. A ``batch_dim`` structure names each input's
    dimension, or None to keep it whole. ``stacklevel`` points warnings at the user's call.
    """
    args, kwargs = _split_x(x)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        raise DivtraceValueError(
            "x holds no tensor, so there is no batch to split; pass the model's input "
            "tensor(s) as x")
    names = _names(x, args, kwargs)
    requested = _requested(x, args, kwargs, batch_dim)
    if requested is None:
        if not _is_index(batch_dim):
            raise DivtraceTypeError(f"batch_dim must be an int or a structure matching x; "
                                    f"got {batch_dim!r}")
        batch_dim = operator.index(batch_dim)  # type: ignore[arg-type]
        _refuse_lists(args, kwargs, batch_dim)
        dims, size = _auto_dims(leaves, names, batch_dim, stacklevel + 1)
        out_dim = batch_dim
    else:
        dims, size, out_dim = _explicit_dims(leaves, names, requested)
    if size < 2:
        raise DivtraceValueError(
            f"the batch has {size} sample(s) at batch_dim={out_dim}; comparing a batched "
            f"run with a split run needs at least 2. Pass a larger batch, or the right "
            f"batch_dim")
    return BatchedInput(tuple(leaves), spec, tuple(dims), tuple(names), size, out_dim)
