"""Bad input: each gets a clear error (or warning) that names the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divtrace
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


def test_train_mode_batchnorm_is_refused() -> None:
    model = models.batchnorm_model().train()
    with pytest.raises(divtrace.BatchMixingError,
                       match=r"train mode.*1 \(BatchNorm2d\), 3 \(Dropout\).*model\.eval\(\)"):
        run(model, torch.randn(4, 3, 5, 5))


def test_train_mode_error_is_a_value_error_and_a_divtrace_error() -> None:
    with pytest.raises(ValueError, match="allow_train=True"):
        run(models.batchnorm_model().train(), torch.randn(4, 3, 5, 5))
    assert issubclass(divtrace.BatchMixingError, divtrace.DivtraceError)


def test_allow_train_compares_and_restores_buffers() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = run(model, torch.randn(4, 3, 5, 5), allow_train=True)
    after = model.state_dict()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    assert model.training
    assert model[1].training
    # batch statistics of 4 samples vs of 1: not a rounding matter
    assert result.table.set_index("site").loc["1", "rel_l2"] > 1e-3
    assert "train mode" in result.summary()


def test_eval_mode_batchnorm_is_fine() -> None:
    result = run(models.batchnorm_model().eval(), torch.randn(4, 3, 5, 5))
    assert (result.table["status"] == "ok").all()


def test_dropout_with_p_zero_is_not_refused() -> None:
    run(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0)).train(), torch.randn(4, 3))


@pytest.mark.parametrize("x", [torch.randn(1, 16), torch.randn(1, 3, 4)])
def test_batch_of_one_is_refused(x: torch.Tensor) -> None:
    with pytest.raises(divtrace.DivtraceValueError, match="at least 2"):
        run(models.variant_mlp(), x)


def test_no_batch_dimension_is_refused() -> None:
    with pytest.raises(divtrace.DivtraceValueError, match="no tensor in x has a batch dimension"):
        run(nn.Identity(), torch.tensor(3.0))
    with pytest.raises(divtrace.DivtraceValueError, match="batch_dim="):
        run(nn.Identity(), torch.randn(4, 3), batch_dim=2)


def test_no_tensor_is_refused() -> None:
    with pytest.raises(divtrace.DivtraceValueError, match="holds no tensor"):
        run(nn.Identity(), (3, "a"))


@pytest.mark.parametrize("x", ["text", 3.0])
def test_x_of_the_wrong_type(x: object) -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match="tuple of positional arguments"):
        run(nn.Identity(), x)


def test_friction_caught_before_the_model_runs() -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match=r"list of 2 tensors.*torch\.stack\(x\)"):
        run(nn.Identity(), [torch.randn(4, 2), torch.randn(4, 2)])
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    with pytest.raises(divtrace.DivtraceValueError, match=r"\(3, 16, 16\).*x\.unsqueeze\(0\)"):
        run(conv, torch.randn(3, 16, 16))
    run(conv, torch.randn(2, 3, 16, 16))  # a batch is fine


def test_dict_keys_must_be_names() -> None:
    with pytest.raises(TypeError, match="keyword argument names"):
        run(nn.Identity(), {0: torch.randn(4, 2)})


@pytest.mark.parametrize(("samples", "message"), [
    ([0, 8], r"sample 8 is out of range.*0\.\.7"),
    ([-1], r"sample -1 is out of range"),
    ([], "samples is empty"),
    ([1, 1], r"rows \[1\] more than once"),
])
def test_samples_out_of_range(samples: list[int], message: str) -> None:
    with pytest.raises(divtrace.DivtraceValueError, match=message):
        run(models.variant_mlp(), torch.randn(8, 16), samples=samples)


def test_samples_of_the_wrong_type() -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match="must hold ints"):
        run(models.variant_mlp(), torch.randn(8, 16), samples=[0.5])


def test_samples_as_range_tensor_or_list() -> None:
    x = torch.randn(8, 16)
    for samples in (range(2, 4), torch.tensor([2, 3]), [3]):
        result = run(models.variant_mlp(), x, samples=samples)
        assert set(result.per_sample["sample"]) <= {2, 3}


@pytest.mark.parametrize("chunk", [8, 9])
def test_chunk_not_below_batch(chunk: int) -> None:
    with pytest.raises(divtrace.DivtraceValueError,
                       match=r"runs a and b are the same: as is, the B=8 rows in one "
                             r"pass; chunk=\d takes it whole\. Give run a a chunk below 8"):
        run(models.variant_mlp(), torch.randn(8, 16), a=divtrace.Run(chunk=chunk))


def test_chunk_of_the_wrong_value() -> None:
    with pytest.raises(divtrace.DivtraceValueError,
                       match=r"Run\(chunk=...\) must be None or a whole number >= 1; got 0"):
        run(models.variant_mlp(), torch.randn(8, 16), a=divtrace.Run(chunk=0))
    with pytest.raises(divtrace.DivtraceTypeError, match=r"whole number >= 1; got 2\.0"):
        run(models.variant_mlp(), torch.randn(8, 16), a=divtrace.Run(chunk=2.0))


def test_disagreeing_batch_sizes_warn_and_pass_through() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b.sum()

    with pytest.warns(divtrace.DivtraceWarning, match=r"B=6.*shape \(5, 2\).*batch_dim"):
        result = run(Two(), (torch.randn(6, 2), torch.randn(5, 2)))
    assert result.table.iloc[0]["mismatch"] == 0


def test_model_must_be_a_module() -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match=r"torch\.nn\.Module"):
        run(lambda x: x, torch.randn(4, 2))  # type: ignore[arg-type]


def test_unknown_module_pattern_lists_the_names() -> None:
    with pytest.raises(divtrace.DivtraceValueError,
                       match=r"'features\.\*' matches no module.*Names: 0, 1, 2.*OrderedLinear"):
        run(models.variant_mlp(), torch.randn(4, 16), modules=["features.*"])
    with pytest.raises(divtrace.DivtraceValueError, match="Conv2d matches no module"):
        run(models.variant_mlp(), torch.randn(4, 16), modules=nn.Conv2d)
    with pytest.raises(divtrace.DivtraceTypeError, match="glob patterns"):
        run(models.variant_mlp(), torch.randn(4, 16), modules=[3])


def test_pair_needs_keep() -> None:
    result = run(models.variant_mlp(), torch.randn(4, 16))
    with pytest.raises(divtrace.DivtraceValueError, match="keep=True"):
        result.pair("0")
    kept = run(models.variant_mlp(), torch.randn(4, 16), resources=divtrace.Resources(keep=True))
    with pytest.raises(divtrace.DivtraceValueError, match=r"no compared site 'nope'.*0, 1"):
        kept.pair("nope")
