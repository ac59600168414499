"""Tiny models with known behaviour, for divtrace's tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class OrderedLinear(nn.Module):
    """A linear layer that sums its products one by one, in a fixed order.

    With ``variant_from=None`` the order never changes, so the layer is batch-invariant
    on every machine. With ``variant_from=t`` the products are summed in reverse order
    whenever the batch has ``t`` or more rows: a deterministic, batch-variant reduction,
    the way a kernel switches algorithm with the batch size.
    """

    def __init__(self, n_in: int, n_out: int, variant_from: int | None = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(n_in * 1000 + n_out)
        self.weight = nn.Parameter(torch.randn(n_out, n_in, generator=generator) / n_in**0.5)
        self.variant_from = variant_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = x.unsqueeze(-2) * self.weight  # [..., n_out, n_in]
        order = range(products.shape[-1])
        if self.variant_from is not None and x.shape[0] >= self.variant_from:
            order = reversed(order)
        total = torch.zeros_like(products[..., 0])
        for j in order:
            total = total + products[..., j]
        return total


class Scale(nn.Module):
    """Multiplies by a constant: element-wise, batch-invariant, amplifies error by k."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def variant_mlp(variant_from: int = 2) -> nn.Sequential:
    """invariant layers, then the batch-variant layer (index 3), then invariant layers."""
    return nn.Sequential(
        OrderedLinear(16, 32),  # 0
        nn.Hardtanh(-3.0, 3.0),  # 1
        Scale(0.5),  # 2
        OrderedLinear(32, 32, variant_from=variant_from),  # 3: the source
        nn.Hardtanh(-3.0, 3.0),  # 4
        OrderedLinear(32, 8),  # 5
    ).eval()


def elementwise_model() -> nn.Sequential:
    """Exactly rounded element-wise ops only. (Transcendental ones such as Sigmoid can
    differ on a CPU between a vectorised body and a scalar tail, so they are left out.)"""
    return nn.Sequential(nn.Identity(), Scale(3.0), nn.ReLU(), nn.Hardtanh(-4.0, 4.0),
                         nn.MaxPool1d(2)).eval()


def inplace_relu_model() -> nn.Sequential:
    """As in VGG: a layer whose output the next ReLU(inplace=True) overwrites."""
    return nn.Sequential(OrderedLinear(16, 32), nn.ReLU(inplace=True),
                         OrderedLinear(32, 8, variant_from=2), nn.ReLU(inplace=True)).eval()


class ReusedActivation(nn.Module):
    """One ReLU module called twice per forward pass, as in ResNet's BasicBlock."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = OrderedLinear(16, 16)
        self.fc2 = OrderedLinear(16, 16, variant_from=2)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc2(self.act(self.fc1(x))))


@dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    name: str


class MultiOutput(nn.Module):
    """Returns tuple, dict, dataclass, integer, bool and non-tensor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = OrderedLinear(16, 8, variant_from=2)

    def forward(self, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], Output, str]:
        h = self.fc(x)
        table = {"argmax": h.argmax(-1), "positive": h > 0, "h": h}
        return table, Output(logits=h * 2, hidden=h, name="not a tensor"), "meta"


class KeywordModel(nn.Module):
    """Takes keyword arguments, one of them a tensor without the batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = OrderedLinear(16, 8, variant_from=2)

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor, scale: float) -> torch.Tensor:
        return self.fc(x) * scale + bias


class BranchOnBatch(nn.Module):
    """Data-dependent control flow: an extra layer runs only for batches of 4 or more."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = OrderedLinear(16, 16)
        self.extra = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.extra(h) if x.shape[0] >= 4 else h


class Exploding(nn.Module):
    """Raises inside its forward pass once it sees a marked input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = OrderedLinear(16, 16)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))
        if x.shape[0] > 2:
            raise KeyError("boom in the user's forward")
        return h


def batchnorm_model() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Dropout(0.5))


class SwitchOp(nn.Module):
    """Computes x @ W one way for batches of 2 or more rows and another way for one row:
    the same numbers from different ops, as a library picks a kernel by batch size."""

    def __init__(self, n_in: int = 16, n_out: int = 8) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.weight = nn.Parameter(torch.randn(n_out, n_in, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 2:
            return torch.mm(x, self.weight.t())
        return (x.unsqueeze(-2) * self.weight).sum(-1)


class Noisy(nn.Module):
    """Adds fresh noise on every call: nondeterministic from run to run, as a kernel with
    racing atomics is. Its own generator: the global random state does not move."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=self.generator).to(x.device, x.dtype)
        return x + 1e-3 * noise


class FunctionalBetween(nn.Module):
    """A functional op between two modules: the second one's input is made unseen."""

    def __init__(self) -> None:
        super().__init__()
        self.first = OrderedLinear(16, 16, variant_from=2)
        self.second = OrderedLinear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * 2.0)


class InplaceOnFunctional(nn.Module):
    """An in-place module applied to a tensor made by a functional op."""

    def __init__(self) -> None:
        super().__init__()
        self.first = OrderedLinear(16, 16, variant_from=2)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.first(x) - 0.1)


class FunctionalLinear(nn.Module):
    """Element-wise ops, then ``F.linear`` as a functional call, then a residual add: the
    functional matmul is the op that parts the runs (a GEMM at batch B, a GEMV alone)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.weight = nn.Parameter(torch.randn(width, width, generator=generator) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x * 0.5 + 0.25)
        y = nn.functional.linear(h, self.weight)
        return x + y


class InplaceOps(nn.Module):
    """In-place ops on a tensor an op made: ``mul`` then ``add_`` and ``relu_`` on it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 3.0
        h.add_(1.0)
        return torch.relu_(h)


class Attention(nn.Module):
    """Projections, then ``F.scaled_dot_product_attention`` over heads."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, w))


def tiny_llama() -> nn.Module:
    """A random-init two-layer Llama built from a config (needs ``transformers``)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


def grouped_mm_mixtral() -> nn.Module:
    """A random-init one-layer Mixtral whose experts run on ``grouped_mm`` (skips where
    ``transformers`` is missing or runs them another way)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config).eval()
    if model.config._experts_implementation != "grouped_mm":
        pytest.skip("this transformers runs its experts another way")
    return model


class ShapeBias(nn.Module):
    """A bug: the output depends on the batch size."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.eps * x.shape[0]


class PerBatch(nn.Module):
    """Scales by one over the batch size (a mean taken as a sum over the rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 / x.shape[0])


class ShapePath(nn.Module):
    """Takes another code path for batches of more than one row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * (1 + 1e-7)
        return x
