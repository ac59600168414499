"""The float32 precision in force: read through either of PyTorch's APIs, never changed by
a comparison, and restored exactly by a run's flags."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

import divtrace
from divtrace.plan.precision import (
    PRECISION_PATHS,
    _holder,
    _legacy_state,
    effective,
    precision_state,
    restored,
)
from divtrace.plan.runs import backend_flags
from tests import models

pytestmark = pytest.mark.skipif(precision_state() is None,
                                reason="this torch has no fp32_precision API")


def everything() -> tuple[object, ...]:
    return (precision_state(), _legacy_state(), torch.backends.cudnn.enabled,
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    with restored():
        yield


def _random_change(r: random.Random) -> None:
    kind = r.randrange(4)
    try:
        if kind == 0:
            _holder(r.choice(PRECISION_PATHS)).fp32_precision = r.choice(["none", "ieee", "tf32"])
        elif kind == 1:
            torch.backends.cuda.matmul.allow_tf32 = r.choice([True, False])
        elif kind == 2:
            torch.backends.cudnn.allow_tf32 = r.choice([True, False])
        else:
            torch.set_float32_matmul_precision(r.choice(["highest", "high", "medium"]))
    except RuntimeError:
        pass  # a setting this torch refuses in this state


def test_every_setting_comes_back_exactly_also_when_the_apis_are_mixed() -> None:
    r = random.Random(0)
    for _ in range(200):
        for _ in range(r.randrange(4)):
            _random_change(r)
        before = everything()
        with restored():
            for _ in range(r.randrange(1, 5)):
                _random_change(r)
        assert everything() == before


@pytest.mark.parametrize("setup", ["new-matmul", "new-conv", "mixed", "generic"])
def test_compare_reads_the_new_api_and_changes_nothing(setup: str) -> None:
    if setup == "new-matmul":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    elif setup == "new-conv":
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    elif setup == "mixed":  # as the first seed report's script does
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.backends.fp32_precision = "tf32"
    before = everything()
    result = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)
    both = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False,
                            a=divtrace.Run(tf32_matmul=True, matmul_precision="medium"),
                            b=divtrace.Run(tf32_cudnn=False, tf32_matmul=False))
    assert everything() == before
    assert result.verdict in ("rounding", "identical")
    assert both.verdict
    settings = result.meta.settings["a"]
    assert settings["tf32_matmul"] == (effective("cuda.matmul") == "tf32")
    assert settings["tf32_cudnn"] == (effective("cudnn.conv") == "tf32")


def test_a_plain_compare_leaves_the_default_state_as_it_was() -> None:
    before = everything()
    divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)
    assert everything() == before
    assert torch.backends.cuda.matmul.fp32_precision == before[0]["cuda.matmul"]


def test_tf32_set_either_way_is_seen() -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert backend_flags()["tf32_matmul"] is True
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.set_float32_matmul_precision("high")
    assert backend_flags()["tf32_matmul"] is True
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    assert backend_flags()["tf32_cudnn"] is False
    torch.backends.fp32_precision = "tf32"  # reaches the ops still at "none"
    torch.backends.cudnn.conv.fp32_precision = "none"
    assert effective("cudnn.conv") == "tf32"


def test_a_runs_flags_are_set_in_the_api_in_use() -> None:
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "tf32"  # the legacy getter now refuses
    before = everything()
    with divtrace.Run(tf32_matmul=True, tf32_cudnn=False).flags():
        assert effective("cuda.matmul") == "tf32"
        assert effective("cudnn.conv") == "ieee"
    assert everything() == before


def test_the_budget_sees_tf32_set_through_the_new_api() -> None:
    from dataclasses import replace

    from divtrace.explain.rounding import budget, reduced
    from divtrace.report.environment import run_settings

    result = divtrace.compare(models.variant_mlp(), torch.randn(4, 16), progress=False)
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    on_gpu = {k: v | {"device": "cuda:0"} for k, v in result.meta.settings.items()}
    for key in on_gpu:  # the flags as a run on a GPU would record them now
        on_gpu[key] |= {k: v for k, v in run_settings(divtrace.Run(), models.variant_mlp())
                        .items() if k.startswith(("tf32", "matmul", "bf16"))}
    meta = replace(result.meta, settings=on_gpu)
    limit, _, name = budget("float32", meta)
    assert name == "TF32"
    assert limit == pytest.approx(3.97e-3, rel=1e-2)
    assert [what for _, what in reduced(meta)] == ["TF32 for float32 convolutions in cuDNN"]
    assert budget("float32", result.meta)[2] == "float32"  # on the CPU TF32 does nothing
