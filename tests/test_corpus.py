"""Cases a new user met, each with a clear outcome: a correct figure, or an error that
names the fix."""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import divtrace
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


# -- inputs ------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.mha(q, k, v, need_weights=False)[0]


@pytest.mark.parametrize("form", ["tuple", "dict", "float64-run"])
def test_one_tensor_given_three_times_stays_one_tensor_in_every_pass(
        form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    plain = nn.MultiheadAttention.forward

    def spy(self: nn.MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            **kwargs: object) -> object:
        seen.append(q is k and k is v)  # MHA's fast path needs query is key is value
        return plain(self, q, k, v, **kwargs)

    monkeypatch.setattr(nn.MultiheadAttention, "forward", spy)
    x = torch.randn(6, 5, 16)
    given = {"q": x, "k": x, "v": x} if form == "dict" else (x, x, x)
    options = {"a": divtrace.Run(chunk=1, dtype=torch.float64),
               "b": divtrace.Run(dtype=torch.float64)} if form == "float64-run" else {}
    run(SelfAttention().eval(), given, **options)
    assert seen
    assert all(seen)


def test_one_prompt_is_refused_with_the_fix() -> None:
    with pytest.raises(divtrace.DivtraceValueError, match="at least two prompts"):
        run(nn.Identity(), divtrace.Prompts([torch.tensor([1, 2, 3])]))


def test_compare_generate_refuses_one_prompt_and_notes_the_models_own_error() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    lm = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(divtrace.DivtraceValueError, match="at least two prompts"):
        divtrace.compare_generate(lm, [torch.tensor([1, 2])], max_new_tokens=2,
                                  progress=False)

    def broken(*args: object, **kwargs: object) -> object:
        raise KeyError("boom in generate")

    lm.generate = broken  # type: ignore[method-assign]
    with pytest.raises(KeyError, match="boom") as caught:
        divtrace.compare_generate(lm, [torch.tensor([1, 2]), torch.tensor([3])],
                                  max_new_tokens=2, progress=False)
    assert any("divtrace: raised in generate() of the batched run" in note
               for note in caught.value.__notes__)


# -- modules that hooks cannot see into ------------------------------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit.script is deprecated
def test_a_scripted_submodule_is_passed_over_with_a_warning() -> None:
    torch.manual_seed(0)
    inner = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(8, 4)).eval()
    with pytest.warns(divtrace.DivtraceWarning,
                      match=r"'1' \(scripted: a scripted module takes no forward hooks"):
        result = run(model, torch.randn(6, 8))
    assert list(result.table["site"]) == ["0", "2", "(model)"]
    assert result.verdict in ("rounding", "identical")
    with pytest.raises(divtrace.DivtraceTypeError, match=r"Sequential\(model\)"):
        run(torch.jit.script(nn.Sequential(nn.Linear(8, 8))), torch.randn(6, 8))


@pytest.mark.parametrize("where", ["root", "child"])
def test_a_compiled_model_already_run_is_compared_at_its_output(where: str) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(6, 8)
    if where == "root":
        model: nn.Module = torch.compile(eager, backend="eager")
        with torch.no_grad():
            model(x)  # a graph made before, without hooks
    else:
        model = nn.Sequential(nn.Linear(8, 8), torch.compile(eager, backend="eager")).eval()
    with pytest.warns(divtrace.DivtraceWarning, match=r"\(torch.compile: "):
        result = run(model, x)
    table = result.table
    assert (table["status"] == "ok").all()  # nothing missing in one run
    assert not table["site"].str.contains("_orig_mod").any()
    assert result.verdict in ("rounding", "identical")


def test_weight_norm_layers_stay_layers_where_the_error_enters() -> None:
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(models.OrderedLinear(8, 16)), nn.Tanh(),
                          weight_norm(nn.Linear(16, 4))).eval()
    table = run(model, torch.randn(6, 8), explain=["local"]).table.set_index("site")
    assert "2.parametrizations.weight" not in table.index
    assert table.loc["2", "leaf"]
    assert table.loc["2", "local_status"] == "ok"


def test_dynamic_quantization_is_found_to_mix_samples() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        model = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).eval(),
            {nn.Linear}, dtype=torch.qint8)
    result = run(model, torch.randn(6, 8), explain=["local"])
    table = result.table.set_index("site")
    assert table.loc["0", "leaf"]
    assert table.loc["0", "role"] == "source"
    assert table.loc["0", "local_status"] == "ok"
    # the activations' scale comes from the whole batch: a sample's result depends on the
    # others
    assert "batch mixing: at '0' (Linear)" in result.summary().splitlines()[0]


# -- random numbers of another thread -------------------------------------------------------


def test_another_threads_random_draws_do_not_refuse_a_deterministic_model() -> None:
    stop = threading.Event()

    def draw() -> None:
        dropout = nn.Dropout(0.5).train()
        while not stop.is_set():
            dropout(torch.randn(64, 64))

    thread = threading.Thread(target=draw)
    thread.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = run(models.variant_mlp(), torch.randn(8, 16))
    finally:
        stop.set()
        thread.join()
    assert result.verdict == "rounding"
    said = [str(w.message) for w in caught if issubclass(w.category, divtrace.DivtraceWarning)]
    assert len(said) <= 1
    assert all("another thread" in s for s in said)


def test_the_models_own_random_draws_are_still_refused() -> None:
    class Rand(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

    with pytest.raises(divtrace.BatchMixingError, match=r"split run \(rand_like"):
        run(Rand(), torch.randn(4, 4))


# -- figures that must not read 0 ---------------------------------------------------------


@pytest.mark.parametrize("exponent", [-565, 531, 664, 997, -990])  # 1e-170 ... 1e-298
def test_float64_beyond_its_squares_is_measured_at_its_scale(exponent: int) -> None:
    scale = math.ldexp(1.0, exponent)  # a power of two: dividing by it is exact
    model = nn.Sequential(models.OrderedLinear(16, 16, variant_from=2)).double().eval()
    x = torch.randn(4, 16, dtype=torch.float64) * scale
    result = run(model, x)
    with torch.no_grad():  # the same figures by hand, the values brought near 1 first
        batched = model(x) / scale
        split = torch.cat([model(x[i:i + 1]) for i in range(4)]) / scale
    diff = batched - split
    expected = (diff.norm() / split.norm()).item()
    row = result.table.set_index("site").loc["0"]
    assert row["mismatch"] > 0
    assert row["rel_l2"] == pytest.approx(expected, rel=1e-6)
    assert row["cosine"] == pytest.approx(
        (batched * split).sum().item() / (batched.norm() * split.norm()).item(), abs=1e-12)
    per_sample = (diff.norm(dim=1) / split.norm(dim=1)).numpy()
    samples = result.per_sample
    np.testing.assert_allclose(samples[samples["site"] == "0"]["rel_l2"].to_numpy(),
                               per_sample, rtol=1e-6)
    assert result.verdict == "rounding"
    assert "not known" not in result.summary()


def test_float64_samples_at_different_scales_are_measured_each_at_its_own() -> None:
    # sample 0 beyond the squares' range, the others not: one site's rows, queued together
    model = nn.Sequential(models.OrderedLinear(16, 16, variant_from=2)).double().eval()
    x = torch.randn(4, 16, dtype=torch.float64)
    x[0] *= math.ldexp(1.0, 600)
    result = run(model, x)
    with torch.no_grad():
        batched = model(x)
        split = torch.cat([model(x[i:i + 1]) for i in range(4)])
    down = torch.tensor([math.ldexp(1.0, -600), 1, 1, 1], dtype=torch.float64)[:, None]
    diff, ref = (batched - split) * down, split * down  # each sample near 1, exactly
    per_sample = (diff.norm(dim=1) / ref.norm(dim=1)).numpy()
    samples = result.per_sample
    assert samples[samples["site"] == "0"]["rel_l2"].to_numpy()[0] == pytest.approx(
        per_sample[0], rel=1e-6)
    site = result.table.set_index("site").loc["0"]  # the others are 2**-600 of sample 0
    assert site["rel_l2"] == pytest.approx(per_sample[0], rel=1e-6)


def test_a_sites_parts_at_different_scales_come_at_one_scale() -> None:
    from divtrace.measure.host import Host, Joined
    from divtrace.measure.pair import pair_fields
    from divtrace.measure.scale import common

    rows = [torch.randn(1, 30, dtype=torch.float64) * 2.0 ** e for e in (700, 0, -650)]
    fields = [pair_fields(r, r * (1 + 1e-9), 1e-7, 1e-7, 1 << 18) for r in rows]
    host = Host()
    joined = Joined([host.add(f) for f in fields], scaled=True)
    host.fetch()
    assert np.array_equal(joined.get(), common(torch.cat(fields)).numpy())
    assert not np.array_equal(joined.get(), torch.cat(fields).numpy())


def test_float64_rows_within_range_keep_their_figures_bit_for_bit() -> None:
    from divtrace.measure.pair import pair_fields
    from divtrace.measure.scale import common
    from divtrace.measure.stats import block_stats

    b = torch.randn(3, 50, dtype=torch.float64) * 1e100
    r = b + torch.randn(3, 50, dtype=torch.float64) * 1e85
    assert torch.equal(pair_fields(b, r, 1e-7, 1e-7, 1 << 18), block_stats(b, r, 1e-7, 1e-7))
    wide = torch.cat([b[:1] * 1e250 / 1e100, b[1:]])  # one row beyond the range
    found = common(pair_fields(wide, wide * (1 + 1e-12), 1e-7, 1e-7, 1 << 18))
    assert np.isfinite(found.numpy()).all()


@pytest.mark.parametrize("odd", [math.inf, -math.inf, math.nan])
def test_a_row_beyond_the_range_with_a_non_finite_value_is_still_scaled(odd: float) -> None:
    from divtrace.measure.fields import INDEX
    from divtrace.measure.pair import pair_fields

    # the largest finite magnitude decides the scale, not the infinity or NaN beside it
    b = torch.randn(3, 40, dtype=torch.float64) * math.ldexp(1.0, 600)
    b[1, 7] = odd
    r = b * (1 + 1e-12)
    found = pair_fields(b, r, 1e-7, 1e-7, 1 << 18)
    assert (found[:, INDEX["scale"]] > 500).all()
    assert found[:, INDEX["sq_ref"]].isfinite().all()


def test_a_row_with_no_finite_value_is_left_unscaled() -> None:
    from divtrace.measure.fields import INDEX
    from divtrace.measure.pair import pair_fields

    inf = torch.full((2, 4), math.inf, dtype=torch.float64)
    found = pair_fields(inf, inf, 1e-7, 1e-7, 1 << 18)
    assert found[:, INDEX["scale"]].tolist() == [0.0, 0.0]


def test_percentages_and_error_figures_never_read_zero_when_they_are_not() -> None:
    from divtrace.words import percent, sci

    rng = np.random.default_rng(0)
    for value in 10.0 ** rng.uniform(-12, 0, 500):
        assert percent(value) not in ("0%", "0.0%", "100%", "100.0%")
        assert float(percent(value).rstrip("%")) > 0
        assert float(sci(value)) > 0
        assert float(percent(1 - value).rstrip("%")) < 100 or value < 1e-11
    assert (percent(0), percent(1), sci(0)) == ("0%", "100%", "0")


def test_the_summary_lists_samples_plainly() -> None:
    summary = run(models.variant_mlp(), torch.randn(12, 16)).summary()
    assert "[0, 1, 2, 3, ..., 11]" in summary
    assert "'...'" not in summary


def test_every_output_tensor_counts_as_the_output() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     vocab_size=50, attn_implementation="eager")
    bert = transformers.BertModel(config).eval()
    ids = torch.randint(1, 50, (4, 7), generator=torch.Generator().manual_seed(0))
    result = run(bert, {"input_ids": ids})
    outputs = result.table[result.table["module"] == "(model)"]
    assert len(outputs) == 2
    first = result.summary().splitlines()[0]
    if (outputs["mismatch"] > 0).any() and result.verdict == "rounding":
        worst = outputs.loc[outputs["rel_l2"].idxmax()]
        assert f"at the output (2 tensors) it is at most {worst['rel_l2']:.2e}" in first


def test_the_element_wise_view_says_where_the_large_relative_differences_lie() -> None:
    class Tiny(nn.Module):  # large values and values near zero, summed in another order
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = torch.linspace(-1, 1, 16 * 3).reshape(16, 3)
            out = x @ weight if x.shape[0] > 1 else (x.unsqueeze(-1) * weight).sum(-2)
            return out * torch.tensor([1.0, 1e-9, 1.0])

    x = torch.randn(32, 16)
    result = run(Tiny(), x, rtol=1e-7, atol=0.0)
    view = result.meta.notes["output_elements"]["(model)"]
    text = result.summary()
    assert "Element by element (as torch.allclose(batched, split, rtol=1e-07, atol=0)" in text
    assert f"{int(view['beyond'])} of {int(view['finite'])} elements are beyond" in text
    assert view["beyond"] >= view["beyond_near_zero"] > 0
    assert f"{int(view['beyond_near_zero'])} of them lie near zero" in text or (
        "all of them near zero" in text)
    assert "measured over the whole output instead" in text
    assert "With torch.allclose's own defaults" not in text  # both were given
    only_rtol = run(Tiny(), x, rtol=1e-7).summary()
    assert "With torch.allclose's own defaults for what was not given (rtol=1e-07, " \
           "atol=1e-08)" in only_rtol


def test_boolean_columns_survive_save_and_load(tmp_path: object) -> None:
    from pathlib import Path

    result = run(nn.Sequential(*models.variant_mlp(), nn.Identity()).eval(),
                 torch.randn(6, 16), explain=["local"])
    assert result.table["adds_error"].dtype == "boolean"
    assert result.table["adds_error"].isna().any()  # the model's own output row
    path = Path(str(tmp_path)) / "run.json"
    result.save(path)
    loaded = divtrace.load(path)
    assert loaded.table.equals(result.table)
    assert loaded.table["depends_on_others"].dtype == "boolean"


def test_op_sites_paired_across_kernel_paths_do_not_decide_the_size() -> None:
    # variant_mlp's layer 3 sums in reverse order in the batch: its op sites pair partial
    # sums of two orders, which say nothing about rounding once every sample is shown
    # independent
    assert run(models.variant_mlp(), torch.randn(8, 16), ops=True).verdict == "rounding"
    said = run(models.variant_mlp(), torch.randn(8, 16), ops=True,
               explain=["-independence", "-precision"])
    assert said.verdict == "not rounding"  # by size alone, as before
    shrunk = run(models.variant_mlp(), torch.randn(8, 16), ops=True, explain=["-independence"])
    assert shrunk.verdict == "rounding"  # the precision test decides on the module sites
    assert "a dependence on the other samples' values is not ruled out" in (
        shrunk.summary().splitlines()[0])


def test_a_row_and_the_command_line_print_figures_that_are_not_zero_as_such() -> None:
    from divtrace.commands import compact

    result = run(models.variant_mlp(), torch.randn(8, 16))
    first = result.first_divergence
    assert first is not None
    assert 0 < first["rel_l2"] < 1e-5  # still a number
    text = repr(first)
    assert f"{first['rel_l2']:.2e}" in text
    assert "rel_l2                         0.0" not in text
    assert f"{first['cosine']:.16g}" in text  # all the digits 1 - cos needs
    shown = compact(result.table)
    assert f"{first['rel_l2']:.2e}" in shown
    assert f"{first['mismatch'] * 100:.1f}%" in shown


def test_the_rounding_sentence_names_where_error_enters_first() -> None:
    # a later layer adds more error of its own than the source: the headline still names
    # the source, where the runs first part
    model = nn.Sequential(models.OrderedLinear(16, 32, variant_from=2), nn.Tanh(),
                          models.OrderedLinear(32, 64, variant_from=2)).eval()
    result = run(model, torch.randn(8, 16), explain=["local"])
    table = result.table.set_index("site")
    assert table.loc["2", "local_rel_l2"] > 0
    first = result.summary().splitlines()[0]
    assert first.startswith("Verdict: rounding — the error enters at '0' (OrderedLinear)")


def test_a_layer_that_copies_values_is_not_headlined_as_amplifying() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 32, variant_from=2),
                          nn.Unflatten(1, (2, 4, 4)), nn.Upsample(scale_factor=3)).eval()
    result = run(model, torch.randn(8, 16), explain=["local"])
    said = [s for s in result.summary().splitlines() if "largest amplification" in s]
    assert said
    assert "the error grows 1×" in said[0] or "the relative error stays" in said[0]


def test_the_float64_sentence_says_how_far_apart_the_runs_are() -> None:
    import pandas as pd

    from divtrace.explain.probe import Judged
    from divtrace.report.meta import Meta

    def result(batched: float, split: float) -> Judged:  # the output row and the names
        table = pd.DataFrame({"module": ["(model)"], "call": [0], "op": [""],
                              "dtype": ["float32"], "b_err_fp64": [batched],
                              "a_err_fp64": [split], "role": [""]})
        return Judged(table, Meta(4, 1, (0,), 0, 4, 0, None, None, False, ""))

    apart = divtrace.Fp64.explain(result(5.1e-7, 1.5e-6)).sentences[0]
    assert "the split run is 2.94× further from it than the batched run" in apart
    assert "neither" not in apart
    close = divtrace.Fp64.explain(result(1.0e-6, 1.1e-6)).sentences[0]
    assert "neither run is clearly closer" in close


def test_samples_far_apart_in_scale_give_no_false_zero() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16, variant_from=2)).double().eval()
    x = torch.randn(4, 16, dtype=torch.float64)
    x[0] *= math.ldexp(1.0, 600)
    x[1:] *= math.ldexp(1.0, -600)
    result = run(model, x)
    samples = result.per_sample[result.per_sample["site"] == "0"].set_index("sample")
    assert 0 < samples.loc[0, "rel_l2"] < 1e-12  # measured at its own scale
    differ = samples["max_abs"] > 0
    assert not (samples.loc[differ, "rel_l2"] == 0).any()  # NaN at worst, never 0
    assert 0 < result.table.set_index("site").loc["0", "rel_l2"] < 1e-12
