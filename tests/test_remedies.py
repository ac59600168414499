"""Remedies: verified by comparing again, costed, applicable by hand, and leaving nothing
behind."""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd
import pytest
import torch
from torch import nn

import divtrace
from divtrace.cli import main
from divtrace.plan.runs import backend_flags
from divtrace.remedies import CudnnOff, FixedBatch, Float64, Remedy
from tests import models

matplotlib.use("Agg")


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything of the process and the model a remedy could leave changed."""
    hooks = [(name, len(m._forward_hooks), len(m._forward_pre_hooks),
              len(m._forward_hooks_always_called)) for name, m in model.named_modules()]
    return {"flags": backend_flags(), "dtype": torch.get_default_dtype(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "hooks": hooks, "training": [m.training for m in model.modules()],
            "params": {k: v.clone() for k, v in model.state_dict().items()},
            "dtypes": [p.dtype for p in model.parameters()]}


def _same(before: dict[str, Any], after: dict[str, Any]) -> None:
    params = before.pop("params"), after.pop("params")
    assert before == after
    for key, value in params[0].items():
        assert torch.equal(value, params[1][key])


def _plain_loop(model: nn.Module, x: torch.Tensor, remedy: Remedy) -> bool:
    """Applied by hand: one batched call, then one call per sample."""
    with torch.no_grad(), remedy.applied(model):
        batched = model(x)
        split = torch.cat([model(x[i:i + 1]) for i in range(len(x))])
    return torch.equal(batched, split)


@pytest.fixture(scope="module")
def found() -> tuple[nn.Module, torch.Tensor, Any]:
    torch.manual_seed(0)
    model, x = models.variant_mlp(), torch.randn(8, 16)
    return model, x, divtrace.compare(model, x, progress=False).remedies(progress=False)


def test_the_table_verifies_each_candidate(found: tuple[nn.Module, torch.Tensor, Any]) -> None:
    _, _, remedies = found
    table = remedies.table.set_index("kind")
    assert list(remedies.table["kind"]) == ["cudnn", "cudnn", "float64", "fixed-batch",
                                            "precision", "math-attention", "deterministic",
                                            "float32-head", "float32-router", "inductor",
                                            "dynamic", "eager-region"]
    assert list(remedies.table.columns) == list(divtrace.remedies.result.COLUMNS)
    assert bool(table.loc["float64", "identical"])
    assert table.loc["float64", "modules"] == 1
    assert table.loc["float64", "output_rel_l2"] == 0
    assert bool(table.loc["fixed-batch", "identical"])
    assert table.loc["fixed-batch", "output_change"] == 0  # the batched call is unchanged
    assert not bool(table.loc["deterministic", "identical"])  # the seed user's attempt
    assert table.loc["deterministic", "output_ratio"] == 1
    # cuDNN twice, precision, attention, the head (an MLP has no output embedding), the
    # routers (nor a mixture of experts), and the three for compiled code (nothing compiled)
    assert table["identical"].isna().sum() == 9
    assert table.loc["inductor", "note"] == "not tried: the runs run no code compiled by divtrace"
    assert table.loc["float32-head", "note"] == (
        "not tried: the model has no output embedding (get_output_embeddings())")
    assert table.loc["float32-router", "note"] == (
        "not tried: the model has no mixture-of-experts router")
    assert "CPU" in remedies.table.iloc[0]["note"]
    tried = remedies.table[remedies.table["identical"].notna()]
    assert (tried["cost"] > 0).all()
    assert (tried["a_cost"] > 0).all()
    assert remedies.best is not None
    assert remedies.best.kind in ("float64", "fixed-batch")
    assert remedies.before == pytest.approx(
        float(remedies.comparisons["deterministic algorithms"].output["rel_l2"]))


def test_what_the_table_calls_identical_is_identical_in_a_plain_loop(
        found: tuple[nn.Module, torch.Tensor, Any]) -> None:
    model, x, remedies = found
    for remedy, row in zip(remedies.candidates, remedies.table.itertuples(), strict=True):
        if not pd.isna(row.identical):
            assert _plain_loop(model, x, remedy) is bool(row.identical), remedy.name
    assert not _plain_loop(model, x, divtrace.remedies.Custom(
        lambda m: contextlib.nullcontext(), "nothing"))


def test_the_summary_names_the_best_and_what_failed(
        found: tuple[nn.Module, torch.Tensor, Any]) -> None:
    _, _, remedies = found
    text = remedies.summary()
    assert text.startswith(f"Best: {remedies.best.name} — the runs become bit-identical")
    assert "Not bit-identical: deterministic algorithms" in text
    assert "Not tried: cuDNN off in 3 (the model runs on the CPU, without cuDNN)" in text
    assert "No candidate" not in text
    assert repr(remedies).startswith("<divtrace.Remedies: 12 candidates, best: ")
    assert "<table" in remedies._repr_html_()


def test_nothing_is_left_behind() -> None:
    model, x = models.variant_mlp(), torch.randn(6, 16)
    result = divtrace.compare(model, x, progress=False)
    before = _state(model)
    remedies = result.remedies(repeats=1, progress=False)
    _same(before, _state(model))
    tried = remedies.table["identical"].notna().tolist()
    for remedy, usable in zip(remedies.candidates, tried, strict=True):
        if not usable and isinstance(remedy, divtrace.remedies.Float32Head):
            fix = ("name the routers" if isinstance(remedy, divtrace.remedies.Float32Router)
                   else "name the head")
            with pytest.raises(divtrace.DivtraceValueError, match=fix), (
                    remedy.applied(model)):
                pass
            continue
        before = _state(model)
        with remedy.applied(model):
            model(x)
        _same(before, _state(model))


def test_applied_restores_everything_after_an_error() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    before = _state(model)
    for remedy in (CudnnOff(), CudnnOff(["1"]), Float64(["1"]), Float64(), FixedBatch(8),
                   divtrace.remedies.Deterministic(), divtrace.remedies.PrecisionOff(),
                   divtrace.remedies.MathAttention(), divtrace.remedies.Float32Head(["1"])):
        with pytest.raises(ValueError, match="boom"), remedy.applied(model):
            model(torch.randn(2, 4))
        _same(dict(before), _state(model))
        assert torch.backends.cudnn.enabled
        assert (torch.ones(2) + 1).dtype == torch.float32  # no float64 mode left in force
        assert (torch.ones(2, dtype=torch.bfloat16) + 1).dtype == torch.bfloat16


def test_a_model_that_mixes_samples_gets_no_remedy() -> None:
    class Centred(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - x.mean(0, keepdim=True)

    model = nn.Sequential(nn.Linear(4, 4), Centred(), nn.Linear(4, 2)).eval()
    remedies = divtrace.compare(model, torch.randn(6, 4), progress=False).remedies(
        progress=False)
    assert remedies.best is None
    assert remedies.needed
    assert remedies.table.empty
    assert remedies.summary().startswith("No remedy is tried: the runs differ for a reason "
                                         "that is not numerical")
    assert "batch mixing" in remedies.summary()
    assert repr(remedies).endswith("no remedy>")


def test_a_model_tested_without_the_independence_test_is_tested_first() -> None:
    class Centred(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - x.mean(0, keepdim=True)

    result = divtrace.compare(Centred().eval(), torch.randn(6, 4),
                              explain=["-independence"], progress=False)
    assert "batch mixing" in result.remedies(progress=False).summary()


def test_runs_that_agree_need_no_remedy() -> None:
    model = models.elementwise_model()
    remedies = divtrace.compare(model, torch.randn(6, 8), progress=False).remedies(
        progress=False)
    assert not remedies.needed
    assert remedies.best is None
    assert remedies.summary() == ("No remedy is needed: the split run and the batched run "
                                  "are already bit-identical at every compared site.")


def test_a_user_remedy_a_subclass_and_a_factory() -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)

    class FixedOrder(Remedy):
        kind = "fixed-order"

        def enter(self, model: nn.Module, stack: ExitStack) -> None:
            layer = model[3]
            was = layer.variant_from
            layer.variant_from = None
            stack.callback(setattr, layer, "variant_from", was)

    @contextlib.contextmanager
    def nothing(model: nn.Module) -> Iterator[None]:
        yield

    remedies = divtrace.compare(model, x, progress=False).remedies(
        [FixedOrder(), nothing, "deterministic"], progress=False)
    assert list(remedies.table["remedy"]) == ["fixed-order", "nothing",
                                              "deterministic algorithms"]
    assert list(remedies.table["identical"]) == [True, False, False]
    assert remedies.best.name == "fixed-order"
    assert model[3].variant_from == 2


def test_bad_candidates_name_the_fix() -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(4, 16), progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match=r"unknown remedy 'cudnn-off'; the "
                       r"names are cudnn, cudnn-everywhere, float64"):
        result.remedies(["cudnn-off"])
    with pytest.raises(divtrace.DivtraceTypeError, match="a candidate must be"):
        result.remedies([3])
    with pytest.raises(divtrace.DivtraceValueError, match="repeats must be an int >= 1"):
        result.remedies(repeats=0)
    with pytest.raises(divtrace.DivtraceValueError, match="candidates is empty"):
        result.remedies([])
    with pytest.raises(divtrace.DivtraceValueError, match=r"no module 'nowhere' to remedy"):
        result.remedies([Float64(["nowhere"])], progress=False)
    with pytest.raises(divtrace.DivtraceTypeError, match="not a context manager"):
        result.remedies([lambda m: None], progress=False)


def test_a_run_on_a_copy_of_the_model_is_refused() -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(4, 16),
                              b=divtrace.Run(dtype=torch.float64), progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="run b runs a changed copy"):
        result.remedies()


def test_saved_remedies_load_back_without_code(tmp_path: Path) -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)
    remedies = result.remedies(repeats=1, progress=False)
    loaded = divtrace.load(remedies.save(tmp_path / "remedies.json"))
    assert isinstance(loaded, divtrace.remedies.Remedies)
    pd.testing.assert_frame_equal(loaded.table, remedies.table)
    assert loaded.summary() == remedies.summary()
    assert loaded.best.name == remedies.best.name
    with pytest.raises(divtrace.DivtraceValueError, match="read from a file"):
        loaded.best.applied(nn.Linear(1, 1))
    assert set(loaded.comparisons) == set(remedies.comparisons)
    again = divtrace.load(result.save(tmp_path / "comparison.json"))
    with pytest.raises(divtrace.DivtraceValueError, match="does not know the model"):
        again.remedies()


def test_the_plot_has_a_row_per_tried_remedy(found: tuple[nn.Module, torch.Tensor, Any]
                                             ) -> None:
    _, _, remedies = found
    ax = remedies.plot()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == list(remedies.table.dropna(subset=["identical"])["remedy"])
    assert ax.get_xscale() == "log"
    untried = divtrace.compare(models.elementwise_model(), torch.randn(4, 8),
                               progress=False).remedies(progress=False)
    assert "No remedy is needed" in untried.plot().texts[0].get_text()


def test_a_scoped_remedy_is_widened_to_the_sources_of_its_own_run() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16, variant_from=2), nn.Tanh(),
                          models.OrderedLinear(16, 8, variant_from=2)).eval()
    x = torch.randn(6, 16)
    result = divtrace.compare(model, x, progress=False)
    assert list(result.sources["site"]) == ["0"]  # the second layer only carries, here
    remedies = result.remedies(["float64"], repeats=1, progress=False)
    row = remedies.table.iloc[0]
    assert row["remedy"] == "float64 in 0, 2"
    assert bool(row["identical"])
    assert row["note"].startswith("widened 1× to the sources of its own run")
    assert _plain_loop(model, x, remedies.best)
    local = divtrace.compare(model, x, explain=["local"], progress=False)
    assert list(local.table.loc[local.table["adds_error"] == True, "site"]) == ["0", "2"]  # noqa: E712
    row = local.remedies(["float64"], repeats=1, progress=False).table.iloc[0]
    assert row["remedy"] == "float64 in 0, 2"  # where error enters, from the start
    assert not row["note"].startswith("widened")


def test_cudnn_off_holds_inside_its_modules_only() -> None:
    seen: list[bool] = []

    class Look(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.backends.cudnn.enabled)
            return x

    model = nn.Sequential(Look(), nn.Sequential(Look()), Look())
    with CudnnOff(["1"]).applied(model):
        model(torch.ones(1))
    assert seen == [True, False, True]


def test_float64_runs_inside_and_leaves_the_parameters_alone() -> None:
    seen: list[torch.dtype] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    with Float64(["0"]).applied(model):
        out = model(torch.randn(3, 4))
        inner = model[0](torch.randn(3, 4, dtype=torch.float16).float())
    assert out.dtype == inner.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert seen[:2] == [torch.float32, torch.float32]
    assert Float64(["0"]).own("0", "aten.mm")
    assert Float64(["0"]).own("0.x", "")
    assert not Float64(["0"]).own("0", "")
    assert not Float64(["0"]).own("1", "")


def test_fixed_batch_pads_calls_and_refuses_bigger_ones() -> None:
    model = models.KeywordModel().eval()
    x, bias = torch.randn(3, 16), torch.randn(8)  # bias: no batch dimension
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(len(a[0])), with_kwargs=True)
    with FixedBatch(8).applied(model):
        out = model(x, bias=bias, scale=2.0)
        with pytest.raises(divtrace.DivtraceValueError, match="got a call of 9 rows"):
            model(torch.randn(9, 16), bias=bias, scale=2.0)
    assert out.shape == (3, 8)
    assert seen == [8]
    torch.testing.assert_close(out, model(x, bias=bias, scale=2.0), rtol=0, atol=0)
    with pytest.raises(divtrace.DivtraceValueError, match="must be an int >= 1"):
        FixedBatch(0)


@pytest.mark.slow
def test_prompts_of_different_lengths() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    prompts = divtrace.Prompts([torch.randint(1, 100, (n,)) for n in (3, 7, 5)])
    result = divtrace.compare(models.tiny_llama(), prompts, progress=False)
    remedies = result.remedies(["fixed-batch", "math-attention", "float64"], repeats=1,
                               progress=False)
    table = remedies.table.set_index("kind")
    assert table.loc["fixed-batch", "note"] == ("not tried: prompts of different lengths "
                                                "differ in length too, not only in rows")
    assert not pd.isna(table.loc["math-attention", "identical"])  # LlamaAttention found
    if result.verdict != "identical":
        assert bool(table.loc["float64", "identical"])


def test_the_command_line_prints_the_remedies(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "target.py").write_text(textwrap.dedent("""
        import torch
        from tests import models
        def build():
            torch.manual_seed(0)
            return models.variant_mlp(), torch.randn(6, 16)
    """))
    assert main(["compare", f"{tmp_path / 'target.py'}:build", "--remedies",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\nBest: " in out
    assert "output_change" in out
    assert out.rstrip().splitlines()[-1].startswith("best: ")
    assert out.rstrip().splitlines()[-1] != "best: none"


def test_reduced_precision_off_through_either_api() -> None:
    from divtrace.plan.make import make_plan
    from divtrace.plan.precision import effective, restored

    with restored():
        torch.set_float32_matmul_precision("medium")
        model = models.variant_mlp()
        situation = divtrace.remedies.search.situation(
            make_plan(model, torch.randn(4, 16)), model)
        assert situation.reduced == ("bfloat16 CPU matmuls",)
        with divtrace.remedies.PrecisionOff().applied(nn.Linear(2, 2)):
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "medium"
    if getattr(torch.backends.cuda.matmul, "fp32_precision", None) is not None:
        with restored():
            torch.backends.cuda.matmul.fp32_precision = "tf32"  # the newer API
            with divtrace.remedies.PrecisionOff().applied(nn.Linear(2, 2)):
                assert effective("cuda.matmul") == "ieee"
            assert effective("cuda.matmul") == "tf32"


def test_when_no_candidate_works_the_closest_is_named() -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)
    remedies = result.remedies(["deterministic", "cudnn"], repeats=1, progress=False)
    assert remedies.best is None
    lines = remedies.summary().splitlines()
    assert lines[0] == (f"No candidate makes the runs bit-identical. The closest, "
                        f"deterministic algorithms, leaves the output's rel_l2 at "
                        f"{divtrace.words.sci(remedies.before)} (without a remedy: "
                        f"{divtrace.words.sci(remedies.before)}). Without a remedy the "
                        f"verdict is rounding: the runs differ by floating point, not by a "
                        f"bug; compare them within a tolerance (divtrace.testing."
                        f"assert_batch_invariant), or try a remedy of your own "
                        f"(candidates=[...]).")
    assert lines[-1].startswith("Not tried: cuDNN off in 3")


def test_a_model_compared_in_train_mode_gets_no_remedy() -> None:
    model = models.batchnorm_model().train()
    remedies = divtrace.compare(model, torch.randn(6, 3, 8, 8), allow_train=True,
                                progress=False).remedies(progress=False)
    assert remedies.best is None
    assert remedies.table.empty
    assert "train mode" in remedies.summary()


def test_a_fixed_batch_keeps_op_sites_aligned() -> None:
    class CatAtRoot(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = models.OrderedLinear(16, 8, variant_from=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.lin(x), x[:, :4]], 1) * 2

    model = CatAtRoot().eval()
    result = divtrace.compare(model, torch.randn(8, 16), ops=True, progress=False)
    remedies = result.remedies(["fixed-batch"], repeats=1, progress=False)
    table = remedies.comparisons["fixed batch of 8"].table
    assert (table["status"] == "ok").all()  # the padding is no op site of the model's
    assert list(table["site"]) == list(result.table["site"])
    assert bool(remedies.table.iloc[0]["identical"])


def test_a_fixed_batch_pads_both_runs_when_both_are_chunked() -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)
    result = divtrace.compare(model, x, a=divtrace.Run(chunk=1), b=divtrace.Run(chunk=4),
                              progress=False)
    assert result.verdict != "identical"
    remedies = result.remedies(["fixed-batch"], repeats=1, progress=False)
    row = remedies.table.iloc[0]
    assert row["note"] == "a call of 1 row is computed as a batch of 8"
    assert bool(row["identical"])
    with torch.no_grad(), remedies.best.applied(model):
        fours = torch.cat([model(x[i:i + 4]) for i in (0, 4)])
        ones = torch.cat([model(x[i:i + 1]) for i in range(8)])
    assert torch.equal(fours, ones)


def test_the_float64_remedy_runs_experts_on_grouped_mm() -> None:
    from divtrace.remedies.catalog import Float64

    model = models.grouped_mm_mixtral()
    x = torch.randint(1, 50, (2, 5))
    with torch.no_grad():
        plain = model(x).logits.double()
        with Float64().applied(model):  # grouped_mm takes no float64: eager meanwhile
            assert model.config._experts_implementation == "eager"
            upcast = model(x).logits.double()
    assert model.config._experts_implementation == "grouped_mm"  # put back
    assert float((upcast - plain).norm() / plain.norm()) < 1e-5  # the same model, nearer float64


def test_a_remedy_that_leaves_only_inner_sites_apart_says_how_many() -> None:
    torch.manual_seed(0)  # the output is 0 in both runs; layer 3 parts them inside
    model = nn.Sequential(*models.variant_mlp(), models.Scale(0.0)).eval()
    result = divtrace.compare(model, torch.randn(6, 16), progress=False)
    remedies = result.remedies(["deterministic"], repeats=1, progress=False)
    table = remedies.comparisons["deterministic algorithms"].table
    compared = table[table["status"] == "ok"]
    apart = int((compared["max_abs"] > 0).sum())
    assert remedies.table.loc[0, "output_rel_l2"] == 0
    assert 0 < apart < len(compared)
    assert remedies.summary().splitlines()[1] == (
        f"Not bit-identical: deterministic algorithms (output rel_l2 0, with {apart} of its "
        f"{len(compared)} compared sites still apart).")
