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
    with pytest.raises(divtrace.DivtraceValueError, match="two models"):
        found.remedies(progress=False)
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


def _torchrun(case: str, out, ranks: int = 2) -> list[dict]:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "distributed" / "tp_compare.py"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
         "--standalone", str(script), str(out), case],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"{case}{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize(("case", "count"), [("mlp", 2), ("llama", 2), ("sequence", 2),
                                             ("mlp", 4)])
def test_tensor_parallel_against_its_unsharded_self(case: str, count: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    if case == "llama":
        pytest.importorskip("transformers")
    ranks = _torchrun(case, tmp_path, count)
    first = ranks[0]
    assert all(r["table"] == first["table"] for r in ranks)  # every rank, the same result
    assert all(r["summary"] == first["summary"] for r in ranks)
    assert all(r["hooks_left"] == 0 for r in ranks)
    table = first["table"]
    statuses = dict(zip(table["site"], table["status"], strict=True))
    assert "shape_mismatch" not in statuses.values()
    rel = dict(zip(table["site"], table["rel_l2"], strict=True))
    for site, by_hand in first["by_hand"].items():  # the shards gathered by hand
        assert rel[site] == pytest.approx(by_hand, rel=1e-9, abs=0)
    row_parallel = {"mlp": "0.down", "llama": "model.layers.0.self_attn.o_proj",
                    "sequence": "down"}[case]
    assert first["first"] == row_parallel  # where the first all-reduce sums partial results
    roles = dict(zip(table["site"], table["role"], strict=True))
    assert roles[row_parallel] == "source"
    assert first["verdict"] == "rounding"


def test_the_command_line(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import textwrap

    from divtrace.cli import main

    target = tmp_path / "pair.py"
    target.write_text(textwrap.dedent("""
        import copy
        import torch

        def original():
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                      torch.nn.Linear(8, 2)).eval()
            return net, torch.randn(6, 4)

        def perturbed():
            net = copy.deepcopy(original()[0])
            with torch.no_grad():
                net[2].bias += 1e-3
            return net
        """))
    out = tmp_path / "m.json"
    assert main(["compare-models", f"{target}:original", f"{target}:original",
                 "--no-progress", "--fail-on", "divergence"]) == 0
    assert "Verdict: identical" in capsys.readouterr().out
    assert main(["compare-models", f"{target}:original", f"{target}:perturbed",
                 "--no-progress", "--fail-on", "not-rounding", "--json", str(out)]) == 1
    assert "'2' (Linear)" in capsys.readouterr().out
    assert main(["show", str(out)]) == 0


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_batched_against_split_on_the_tensor_parallel_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    first, second = _torchrun("split", tmp_path)
    assert first["table"] == second["table"]
    assert first["summary"] == second["summary"]
    assert first["hooks_left"] == second["hooks_left"] == 0
    table = first["table"]
    assert set(table["status"]) == {"ok"}
    rel = dict(zip(table["site"], table["rel_l2"], strict=True))
    for site, by_hand in first["by_hand"].items():  # every rank's shards stacked by hand
        assert rel[site] == pytest.approx(by_hand, rel=1e-9, abs=0)
    assert first["verdict"] in ("identical", "rounding")
    assert "independence test" in first["summary"]
    assert first["kind"] == "on ranks"  # the kind of a sharded model with itself
