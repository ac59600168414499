"""The verdict: identical, rounding, or not rounding — and the sentence that says why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divtrace
from divtrace.explain.rounding import budget
from divtrace.report.meta import Meta
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


class Center(nn.Module):
    """x - x.mean(0): a statistic over the batch, in eval mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


def test_identical() -> None:
    result = run(models.elementwise_model(), torch.randn(6, 4, 8))
    assert result.verdict == "identical"
    assert result.summary().startswith("Verdict: identical — all 6 compared sites")


@pytest.mark.parametrize("name", ["vgg11", "alexnet"])
def test_the_seed_models_on_the_cpu_are_rounding(name: str) -> None:
    from torchvision.models import alexnet, vgg11

    torch.manual_seed(0)
    model = (vgg11() if name == "vgg11" else alexnet()).eval()
    x = torch.rand(4, 3, 64, 64)
    result = run(model, x, samples=[0, 1], explain=["local"])
    assert result.first_divergence is not None  # the CPU's Linear layers part
    assert result.verdict == "rounding"
    assert result.summary().startswith("Verdict: rounding — ")


@pytest.mark.parametrize(("model", "x", "options", "said"), [
    (nn.Sequential(models.OrderedLinear(8, 8), Center(), nn.Linear(8, 4)).eval(),
     torch.randn(6, 8), {"a": divtrace.Run(chunk=2)}, "batch mixing: at '1' (Center)"),
    (nn.LSTM(4, 5).eval(), torch.randn(7, 3, 4), {}, "'(model)/0' (LSTM)"),
    (nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train(), torch.randn(6, 8),
     {"allow_train": True}, "the model ran in train mode"),
], ids=["mean-over-batch", "lstm-time-first", "dropout-in-train-mode"])
def test_not_rounding(model: nn.Module, x: torch.Tensor, options: dict, said: str) -> None:
    result = run(model, x, **options)
    assert result.verdict == "not rounding"
    first = result.summary().splitlines()[0]
    assert first.startswith("Verdict: not rounding — ")
    assert said in first


def test_a_layer_that_mixes_after_the_source_is_found_by_its_jump() -> None:
    model = nn.Sequential(*models.variant_mlp(), Center()).eval()
    result = run(model, torch.randn(8, 16), a=divtrace.Run(chunk=4))
    assert result.verdict == "not rounding"
    assert "at '6' (Center)" in result.summary().splitlines()[0]


def test_the_closeness_test_does_not_decide() -> None:
    class Tiny(nn.Module):  # outputs of magnitude 1e-6: atol=1e-5 passes almost anything
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 1e-6 * (x - x.mean(0))

    result = run(Tiny(), torch.randn(6, 8), a=divtrace.Run(chunk=2))
    assert result.output["exceed"] == 0  # "passes the closeness test"...
    assert result.verdict == "not rounding"  # ...yet floating point does not explain it


def test_a_far_run_against_float64_is_not_rounding() -> None:
    class Lossy(nn.Module):  # rounds hard only for whole batches: the batched run is off
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 8).round() / 8 if x.shape[0] > 2 else x

    result = run(Lossy(), torch.randn(6, 8), explain=["fp64"])
    assert result.verdict == "not rounding"


def test_budgets_follow_the_precision_in_force() -> None:
    def meta(**settings: object) -> Meta:
        return Meta(4, 1, (0,), 0, 1, 0, None, None, False, "", settings={"a": settings})

    assert budget("float32", meta(device="cpu", dtype="float32"))[0] == pytest.approx(6.2e-5,
                                                                                    rel=0.01)
    tf32 = budget("float32", meta(device="cuda:0", dtype="float32", tf32_cudnn=True))
    assert tf32[2] == "TF32"
    assert tf32[0] == pytest.approx(4.0e-3, rel=0.03)
    assert budget("bfloat16", meta(device="cpu", dtype="float32"))[0] == pytest.approx(
        3.1e-2, rel=0.02)
    assert budget("float64", meta(device="cpu", dtype="float64"))[0] < 1e-12
