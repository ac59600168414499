"""Tokens flattened inside a mixture-of-experts block: a router (``mlp.gate``) and its
experts see the batch's tokens as one axis of ``rows × sequence`` entries; read back as
``(rows, sequence, ...)`` they are per-sample sites like any other."""

from __future__ import annotations

from torch import nn

__all__ = ["flattened_inside", "moe_blocks"]


def moe_blocks(model: nn.Module) -> list[str]:
    """The mixture-of-experts blocks of ``model``: modules with a router child ``gate``
    and an ``experts`` child, as Hugging Face's Mixtral, Qwen2-MoE, Qwen3-MoE and
    DeepSeek-V3 blocks have."""
    return [name for name, module in model.named_modules()
            if isinstance(getattr(module, "gate", None), nn.Module)
            and isinstance(getattr(module, "experts", None), nn.Module)]


def flattened_inside(model: nn.Module, modules: dict[str, nn.Module]
                     ) -> tuple[dict[str, str], dict[str, nn.Module]]:
    """Of the observed ``modules``, those inside a mixture-of-experts block, each with
    the block whose input gives the pass's ``(rows, sequence)``; and those blocks."""
    named = dict(model.named_modules())
    blocks = moe_blocks(model)
    found: dict[str, str] = {}
    for name in modules:
        block = next((b for b in blocks if b and name.startswith(b + ".")), None)
        if block is not None:
            found[name] = block
    return found, {b: named[b] for b in set(found.values())}
