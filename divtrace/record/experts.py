"""Tokens flattened inside a mixture-of-experts block: a router (Hugging Face's
``mlp.gate``, or the modules a :class:`Routers` pattern names) and its experts see the
batch's tokens as one axis of ``rows × sequence`` entries; read back as ``(rows,
sequence, ...)`` they are per-sample sites like any other."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from divtrace.errors import DivtraceTypeError, DivtraceValueError

__all__ = ["Routers", "flattened_inside", "moe_blocks"]


@dataclass(frozen=True)
class Routers:
    """Where a model's mixture-of-experts routers are, and where their outputs hold the
    logits, the chosen experts' weights and the chosen experts (paths as the sites name
    them: ``"0"``, ``"1"``, a dict's key, ``"0/1"`` nested).

    Args:
        pattern: The routers: a glob on qualified names (``"*.moe.router"``) or a module
            type; None: each block's ``gate`` in a block with ``gate`` and ``experts``
            (Hugging Face's Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), whose outputs
            are (logits, weights, experts).
        logits: The path of the logits in a router's output, ``(tokens, experts)``.
        weights: The path of the chosen experts' weights, ``(tokens, k)`` (None: the
            router gives none; the routing replay then forces the experts only).
        experts: The path of the chosen experts' indices, ``(tokens, k)``.

    A router's block, whose input gives the pass's ``(rows, sequence)``, is the module
    that holds it; the modules inside that block read their tokens per sample.
    """

    pattern: str | type[nn.Module] | None = None
    logits: str = "0"
    weights: str | None = "1"
    experts: str = "2"

    def __post_init__(self) -> None:
        if self.pattern is not None and not isinstance(self.pattern, str) and not (
                isinstance(self.pattern, type) and issubclass(self.pattern, nn.Module)):
            raise DivtraceTypeError(
                f"routers= takes a glob on qualified names ('*.moe.router') or a module "
                f"type; got {type(self.pattern).__name__}")
        given = [p for p in (self.logits, self.weights, self.experts) if p is not None]
        if not all(isinstance(p, str) for p in given) or len(set(given)) != len(given):
            raise DivtraceValueError(
                f"a router's logits, weights and experts are three different paths of its "
                f"output (strings, as the sites name them: '0', 'logits'); got "
                f"{self.logits!r}, {self.weights!r}, {self.experts!r}")

    def names(self, model: nn.Module) -> tuple[str, ...]:
        """The routers' qualified names in ``model``, in registration order."""
        if self.pattern is None:
            return tuple(f"{block}.gate" for block in moe_blocks(model))
        pattern = self.pattern
        return tuple(name for name, module in model.named_modules() if name and (
            fnmatch.fnmatchcase(name, pattern) if isinstance(pattern, str)
            else isinstance(module, pattern)))

    def blocks(self, model: nn.Module) -> tuple[str, ...]:
        """The mixture-of-experts blocks: the modules that hold the routers."""
        if self.pattern is None:
            return tuple(moe_blocks(model))
        return tuple(dict.fromkeys(name.rpartition(".")[0] for name in self.names(model)))

    def paths(self) -> dict[str, str | None]:
        """The three paths by their meaning, as the routing note records them."""
        return {"logits": self.logits, "weights": self.weights, "experts": self.experts}

    def described(self) -> str:
        """The pattern in words, for errors and notes."""
        if self.pattern is None:
            return "each mixture-of-experts block's gate"
        return repr(self.pattern) if isinstance(self.pattern, str) else self.pattern.__name__


def moe_blocks(model: nn.Module) -> list[str]:
    """The mixture-of-experts blocks of ``model``: modules with a router child ``gate``
    and an ``experts`` child, as Hugging Face's Mixtral, Qwen2-MoE, Qwen3-MoE and
    DeepSeek-V3 blocks have."""
    return [name for name, module in model.named_modules()
            if isinstance(getattr(module, "gate", None), nn.Module)
            and isinstance(getattr(module, "experts", None), nn.Module)]


def flattened_inside(model: nn.Module, modules: dict[str, nn.Module],
                     routers: Routers | None = None
                     ) -> tuple[dict[str, str], dict[str, nn.Module]]:
    """Of the observed ``modules``, those inside a mixture-of-experts block (of
    ``routers``, default: Hugging Face's), each with the block whose input gives the
    pass's ``(rows, sequence)``; and those blocks."""
    named = dict(model.named_modules())
    blocks = sorted((routers or Routers()).blocks(model), key=len, reverse=True)
    found: dict[str, str] = {}
    for name in modules:  # the innermost block that holds it
        block = next((b for b in blocks if b and name.startswith(b + ".")), None)
        if block is not None:
            found[name] = block
    return found, {b: named[b] for b in set(found.values())}
