"""Sites: where a tensor is observed. Module selection, site keys, output flattening."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from divtrace.errors import DivtraceTypeError, DivtraceValueError

__all__ = ["INPUT", "ROOT", "flatten_output", "select_modules", "site_key"]

#: The name under which the model itself (its final output) appears in the table.
ROOT = "(model)"
#: The producer of the model's own input tensors: the same rows in both runs.
INPUT = "(input)"


def site_key(module: str, call: int, path: str) -> str:
    """The key of a site, e.g. ``features.3``, ``layer1.0.relu#1``, ``encoder/logits``.

    ``#k`` is added for the (k+1)-th call of a module within one forward pass, and
    ``/path`` for a tensor inside a nested output.
    """
    key = module if call == 0 else f"{module}#{call}"
    return f"{key}/{path}" if path else key


def _key_str(entry: Any) -> str:
    if isinstance(entry, pytree.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, pytree.MappingKey):
        return str(entry.key)
    if isinstance(entry, pytree.GetAttrKey):
        return entry.name
    return str(entry)


def flatten_output(output: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in a (nested) module output, each with its path.

    Tuples, lists, dicts and named tuples are flattened by ``torch.utils._pytree``;
    dataclass instances that pytree does not know are opened field by field. Anything
    that is not a tensor is skipped.
    """
    found: list[tuple[str, torch.Tensor]] = []
    leaves, _ = pytree.tree_flatten_with_path(output)
    for keys, leaf in leaves:
        path = "/".join([prefix] * bool(prefix) + [_key_str(k) for k in keys])
        if isinstance(leaf, torch.Tensor):
            found.append((path, leaf))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf)}
            found.extend(flatten_output(fields, path))
    return found


def _describe(spec: object) -> str:
    return spec.__name__ if isinstance(spec, type) else repr(spec)


def select_modules(
    model: nn.Module, modules: str | type | Iterable[str | type] | None
) -> dict[str, nn.Module]:
    """The modules to observe, by qualified name, in registration order.

    ``modules`` holds glob patterns matched against qualified names (``features.*``) and
    module types (``nn.Conv2d``); ``None`` selects every module. The model itself is
    always observed, under the name :data:`ROOT`, so that its final output is compared.
    """
    named = [(name, mod) for name, mod in model.named_modules() if name]
    chosen: dict[str, nn.Module] = {ROOT: model}
    if modules is None:
        chosen.update(named)
        return chosen
    specs = [modules] if isinstance(modules, str | type) else list(modules)
    for spec in specs:
        if not isinstance(spec, str | type):
            raise DivtraceTypeError(
                f"modules must hold glob patterns (str) or module types; got {spec!r}"
            )
    for spec in specs:
        hits = [
            (name, mod)
            for name, mod in named
            if (isinstance(spec, str) and fnmatch.fnmatchcase(name, spec))
            or (isinstance(spec, type) and isinstance(mod, spec))
        ]
        if not hits:
            names = [name for name, _ in named]
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            types = sorted({type(mod).__name__ for _, mod in named})
            raise DivtraceValueError(
                f"modules entry {_describe(spec)} matches no module of the model. "
                f"Names: {shown or '(none)'}; types: {', '.join(types) or '(none)'}"
            )
        chosen.update(hits)
    order = {name: i for i, (name, _) in enumerate(named)}
    return {ROOT: model} | dict(sorted(
        ((n, m) for n, m in chosen.items() if n != ROOT), key=lambda item: order[item[0]]
    ))
