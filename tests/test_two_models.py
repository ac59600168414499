"""compare_models(): two models on one input, site by site."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import divtrace
from divtrace.explain.rounding import MODELS
from divtrace.plan.other import renamed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4)).eval()


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(6, 8)


def test_the_same_model_twice_is_identical() -> None:
    net = _net()
    for other in (net, copy.deepcopy(net)):
        found = divtrace.compare_models(net, other, _x(), progress=False)
        assert found.verdict == "identical"
        assert "the two runs agree exactly" in found.summary()
        assert (found.table["status"] == "ok").all()


def test_a_copy_with_one_layer_perturbed_parts_exactly_there() -> None:
    net = _net()
    twin = copy.deepcopy(net)
    with torch.no_grad():
        twin[2].weight[0, 0] += 1e-3
    found = divtrace.compare_models(net, twin, _x(), progress=False)
    first = found.first_divergence
    assert first is not None
    assert first["site"] == "2"
    assert list(found.sources["site"]) == ["2"]
    assert found.verdict == "not rounding"
    assert MODELS in found.summary()
    assert "batch" not in found.summary().splitlines()[0]
    local = divtrace.compare_models(net, twin, _x(), explain=["local"], progress=False)
    adds = local.table.set_index("site")["adds_error"]
    assert adds["2"]
    assert not adds["4"]  # the same weights: it only carries what it was given


class Wrapped(nn.Module):
    """The same layers under another name (a re-wrapped model)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_renamed_modules_align_through_names() -> None:
    net = _net()
    wrapped = Wrapped(copy.deepcopy(net))
    found = divtrace.compare_models(net, wrapped, _x(), names={"body": ""}, progress=False)
    table = found.table.set_index("site")
    for site in ("0", "1", "2", "3", "4", "(model)"):
        assert table.loc[site, "status"] == "ok"
        assert table.loc[site, "mismatch"] == 0
    unnamed = divtrace.compare_models(net, wrapped, _x(), progress=False)
    assert (unnamed.table["status"] != "ok").any()  # body.0 is not 0 without names=
    assert renamed("decoder.layers.0", {"decoder": "model"}) == "model.layers.0"
    assert renamed("decoderx.0", {"decoder": "model"}) == "decoderx.0"
    assert renamed("a.b", {"": "m"}) == "m.a.b"


def test_another_shape_is_reported_not_a_crash() -> None:
    net = _net()
    other = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 16), nn.ReLU(),
                          nn.Linear(16, 4)).eval()
    found = divtrace.compare_models(net, other, _x(), progress=False)
    statuses = found.table.set_index("site")["status"]
    assert statuses["0"] == "shape_mismatch"
    assert statuses["2"] == "ok"


def test_both_models_come_back_untouched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
    twin = copy.deepcopy(net).train()
    with pytest.raises(divtrace.BatchMixingError, match="model b"):
        divtrace.compare_models(net, twin, _x(), progress=False)
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    found = divtrace.compare_models(net, twin, _x(), allow_train=True, progress=False)
    assert twin.training
    assert all(torch.equal(before[k], v) for k, v in twin.state_dict().items())
    back = divtrace.load(found.save(tmp_path / "m.json"))
    assert isinstance(back, divtrace.Comparison)
    assert back.verdict == found.verdict
    assert back.summary() == found.summary()
    assert divtrace.diff(found, back).changed.empty


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match="names must be a dict"):
        divtrace.compare_models(_net(), _net(), _x(), names=["body"],  # type: ignore[arg-type]
                                progress=False)
    with pytest.raises(divtrace.DivtraceTypeError, match=r"b must be a torch\.nn\.Module"):
        divtrace.compare_models(_net(), "net", _x(), progress=False)  # type: ignore[arg-type]
