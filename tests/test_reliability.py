"""The reliability matrix: set-ups that used to crash or give a silently wrong answer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import divtrace
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


def per_sample(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(x[i:i + 1].clone()) for i in range(len(x))])


# -- in-place ops on the model's own input ------------------------------------------------


def inplace_on_input() -> nn.Sequential:
    return nn.Sequential(nn.ELU(inplace=True), nn.Linear(8, 8),
                         nn.LeakyReLU(0.1, inplace=True), nn.Linear(8, 4)).eval()


@pytest.mark.parametrize("local", [False, True])
def test_inplace_ops_on_the_input_see_the_input_as_given(local: bool) -> None:
    model, x = inplace_on_input(), torch.randn(16, 8)
    given = x.clone()
    result = run(model, x, local=local, keep=True)
    torch.testing.assert_close(x, given, rtol=0, atol=0)  # the user's x is untouched
    batched, split = result.pair("(model)")
    with torch.no_grad():
        truth = model(given.clone())
    torch.testing.assert_close(batched, truth, rtol=0, atol=0)
    torch.testing.assert_close(split, per_sample(model, given), rtol=0, atol=0)
    assert result.output["rel_l2"] < 1e-6
    if local:  # ELU changed the model's input in place: nothing left to replay it on
        assert result.table.set_index("site").loc["0", "local_status"] == "no_input"


# -- non-finite values and complex outputs -------------------------------------------------


class PoisonRow(nn.Module):
    """A batch-variant layer, then NaN and inf in the samples marked by x[:, 0] > 100."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = models.OrderedLinear(16, 8, variant_from=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        marked = x[:, :1] > 100
        poison = torch.tensor([math.nan, math.inf, *[0.0] * 6])
        return torch.where(marked, h + poison, h)


def test_error_figures_leave_out_non_finite_elements() -> None:
    model, x = PoisonRow().eval(), torch.randn(6, 16)
    x[0, 0] = 1000.0
    result = run(model, x, keep=True)
    out = result.output
    batched, split = result.pair("(model)")
    finite = (batched - split).isfinite()
    expected = ((batched - split)[finite].norm() / split[finite].norm()).item()
    assert out["nonfinite"] == 2
    assert out["rel_l2"] == pytest.approx(expected, rel=1e-6)
    assert 0 < out["rel_l2"] < 1e-5
    assert math.isfinite(out["cosine"])
    assert math.isfinite(out["mean_abs"])
    assert "the error figures leave them out" in result.summary()


class ComplexOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = models.OrderedLinear(16, 8, variant_from=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(self.fc(x))


def test_complex_outputs_count_elements() -> None:
    result = run(ComplexOut().eval(), torch.randn(6, 16), keep=True)
    out = result.output
    batched, split = result.pair("(model)")
    assert out["mismatch"] == (batched != split).double().mean().item()
    assert 0 < out["mismatch"] <= 1
    assert out["numel"] == batched.numel()
    assert out["rel_l2"] == pytest.approx(((batched - split).norm() / split.norm()).item(),
                                          rel=1e-6)
    assert out["max_abs"] == pytest.approx((batched - split).abs().max().item(), rel=1e-6)


# -- inference mode -------------------------------------------------------------------------


def test_inference_mode_around_compare_and_inputs_made_under_it() -> None:
    model = models.variant_mlp()
    x = torch.randn(6, 16)
    plain = run(model, x).table
    with torch.inference_mode():
        inside = run(model, x).table
        made_there = torch.randn(6, 16).copy_(x)
    assert made_there.is_inference()
    outside = run(model, made_there).table
    for table in (inside, outside):
        assert table[["site", "mismatch", "rel_l2"]].equals(plain[["site", "mismatch", "rel_l2"]])


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"rtol": "1e-3"}, TypeError, "rtol must be a number or None; got '1e-3'"),
    ({"atol": -1.0}, ValueError, "atol must be a finite number >= 0"),
    ({"rtol": math.nan}, ValueError, "rtol must be a finite number >= 0"),
    ({"modules": 3}, TypeError, "modules must be glob patterns"),
    ({"local": True, "replay_skip": 5}, TypeError, "replay_skip must be a glob pattern"),
    ({"batch_dim": 0.0}, TypeError, "batch_dim must be an int; got 0.0"),
    ({"batch_dim": None}, TypeError, "batch_dim must be an int or a structure"),
])
def test_bad_arguments_are_named(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        run(models.variant_mlp(), torch.randn(4, 16), **kwargs)
    assert isinstance(info.value, divtrace.DivtraceError)


def test_numpy_integers_and_0d_tensors_work_where_ints_are_expected() -> None:
    x = torch.randn(8, 16)
    result = run(models.variant_mlp(), x, chunk=np.int64(2), samples=np.array([1, 5]),
                 batch_dim=np.int32(0), repeat=np.int8(1))
    assert result.meta["chunk"] == 2
    assert result.meta["samples"] == [1, 5]
    assert run(models.variant_mlp(), x, samples=torch.tensor(3)).meta["samples"] == [3]
    assert run(models.variant_mlp(), x, a=divtrace.Run(chunk=np.int64(4))).meta["chunk"] == 4
