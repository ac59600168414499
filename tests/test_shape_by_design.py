"""The verdict's second test, the precision test: both runs again in float64. A rounding
difference shrinks with the unit roundoff; one by design (a value read from the batch's
shape) keeps its size, whatever that size is."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import divtrace
from divtrace.explain.precision import judged, shrink
from divtrace.words import sci
from tests import models
from tests.models import PerBatch, ShapeBias, ShapePath


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


def mlp(middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), middle, nn.Tanh(), nn.Linear(32, 8)).eval()


@pytest.mark.parametrize(("middle", "name"), [
    (ShapeBias(1e-6), "ShapeBias"), (ShapeBias(1e-3), "ShapeBias"),
    (PerBatch(), "PerBatch"), (ShapePath(), "ShapePath")])
@pytest.mark.parametrize("samples", [[0, 1], None])
def test_a_value_read_from_the_shape_is_not_rounding_and_is_named(
        middle: nn.Module, name: str, samples: list[int] | None) -> None:
    result = run(mlp(middle), torch.randn(8, 32), samples=samples)
    assert result.verdict == "not rounding"
    first = result.summary().splitlines()[0]
    assert f"the computation depends on the batch's shape: at '1' ({name})" in first
    table = result.table.set_index("site")
    assert not table.loc["0", "depends_on_shape"]  # the Linear before it shrinks
    assert table.loc["1", "depends_on_shape"]
    assert table.loc["1", "fp64_rel_l2"] > table.loc["1", "rel_l2"] / 16
    assert not table["depends_on_others"].any()  # the independence test cannot see it


def test_shape_bias_was_called_rounding_by_size_alone() -> None:
    """The case the test was made for: within the float32 budget, yet a bug."""
    result = run(mlp(ShapeBias(1e-6)), torch.randn(8, 32), samples=[0, 1],
                 explain=["-precision"])
    assert result.verdict == "rounding"
    assert "rests on the size of the error alone" in result.summary().splitlines()[0]
    assert "not a bug" not in result.summary()


def test_left_padding_without_position_ids_depends_on_the_padded_length() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                     n_positions=64, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 100, (n,), generator=generator) for n in (5, 9, 3, 7)]
    bare = run(model, divtrace.Prompts(prompts, position_ids=False))
    assert bare.verdict == "not rounding"
    # the position embeddings are added outside any module: the dropout after the sum is
    # the first site that shows them (the embedding of the position ids holds no batch)
    assert "the computation depends on the batch's shape: at 'transformer.drop'" in (
        bare.summary().splitlines()[0])
    given = run(model, divtrace.Prompts(prompts))  # position ids as generate() makes them
    assert given.verdict in ("rounding", "identical")


def test_rounding_shrinks_and_the_verdict_says_both_tests_passed() -> None:
    result = run(models.variant_mlp(), torch.randn(8, 16))
    assert result.verdict == "rounding"
    first = result.summary().splitlines()[0]
    assert ("No compared row moved when only the other samples changed (independence "
            "test) and in float64 the runs' difference shrinks as rounding does") in first
    table = result.table
    differ = table[table["mismatch"] > 0]
    assert not differ["depends_on_shape"].any()
    assert differ["depends_on_shape"].notna().all()
    assert (differ["fp64_rel_l2"] < differ["rel_l2"] * 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_no_false_bug_in_any_precision(dtype: torch.dtype) -> None:
    model = models.variant_mlp().to(dtype)
    x = torch.randn(8, 16).to(dtype)
    result = run(model, x)
    assert result.verdict in ("rounding", "identical")
    assert not result.table["depends_on_shape"].fillna(False).any()


def test_no_false_bug_on_torchvision_models() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vgg = torchvision.models.vgg11().eval().features[:8]
    result = run(vgg, torch.rand(4, 3, 32, 32), a=divtrace.Run(chunk=2), samples=[0, 1])
    assert result.verdict in ("rounding", "identical")
    alexnet = torchvision.models.alexnet().eval()
    result = run(alexnet, torch.rand(3, 3, 64, 64), samples=[0])
    assert result.verdict in ("rounding", "identical")


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_no_false_bug_on_language_models_with_prompts(kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=100, attn_implementation="eager")).eval()
        padding = "right"
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64,
            attn_implementation="eager")).eval()
        padding = "left"
    else:
        model = models.tiny_llama()
        padding = "left"
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 100, (n,), generator=generator) for n in (6, 3, 8)]
    result = run(model, divtrace.Prompts(prompts, padding_side=padding,
                                         position_ids=kind != "bert"))
    assert result.verdict in ("rounding", "identical"), result.summary()


class NearTie(nn.Module):
    """Rows of a batch-variant layer whose two outputs nearly tie; the class picked by
    the argmax, one-hot, goes on: a discontinuity that float32 rounding can flip."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = models.OrderedLinear(16, 2, variant_from=2)
        with torch.no_grad():  # the second row: the first, one unit in the last place off
            self.layer.weight[1] = torch.nextafter(self.layer.weight[0],
                                                   torch.full((16,), 2.0))
        self.head = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.layer(x)
        picked = nn.functional.one_hot(scores.argmax(-1), 2).to(x.dtype)
        return self.head(picked)


def test_a_flip_on_a_near_tie_is_rounding() -> None:
    torch.manual_seed(0)
    model = NearTie().eval()
    result = run(model, torch.randn(64, 16))
    table = result.table.set_index("site")
    assert table.loc["head", "mismatch"] > 0  # the tie flipped for some samples ...
    assert table.loc["head", "rel_l2"] > 1e-2  # ... far beyond any rounding budget
    assert not table.loc["head", "depends_on_shape"]  # ... and not in float64
    assert result.verdict == "rounding"


def test_the_thresholds_of_a_site() -> None:
    expected = shrink("float32")
    assert expected == 2.0**-29
    assert shrink("int64") is None
    assert judged(1e-6, 1e-15, expected) is False  # shrank about 2**29
    assert judged(1e-6, 0.9e-6, expected) is True  # kept its size
    assert judged(1e-6, 1e-10, expected) is None  # neither
    assert judged(1e-3, 1e-14, expected) is False  # within float64's budget


def test_it_does_not_run_where_it_has_nothing_to_decide() -> None:
    same = run(models.elementwise_model(), torch.randn(6, 16))
    assert same.meta.notes["precision"] == {
        "ran": False, "why": "the runs are bit-identical at every compared site"}
    assert "Precision test" not in same.summary()
    mixing = run(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16, track_running_stats=False)
                               ).eval(), torch.randn(6, 16), a=divtrace.Run(chunk=2))
    assert mixing.meta.notes["precision"]["why"] == "the independence test found batch mixing"
    double = run(models.variant_mlp().double(), torch.randn(8, 16, dtype=torch.float64))
    assert "The precision test did not run: the model already runs in float64." in (
        double.summary())


def test_a_model_that_cannot_run_in_float64_leaves_it_inconclusive() -> None:
    class Float32Only(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float32:
                raise RuntimeError("this kernel takes float32 only")
            return x * 2

    model = nn.Sequential(models.variant_mlp(), Float32Only()).eval()
    result = run(model, torch.randn(8, 16))
    assert result.verdict == "rounding"
    said = result.summary()
    assert ("The precision test did not run: the model could not run in float64 "
            "(RuntimeError: this kernel takes float32 only)") in said
    assert "rests on the size of the error alone" in said.splitlines()[0]
    assert "depends_on_shape" in result.table  # its columns, empty
    assert result.table["depends_on_shape"].isna().all()


def test_its_sentences_are_its_figures() -> None:
    result = run(mlp(ShapeBias(1e-6)), torch.randn(8, 32))
    table = result.table.set_index("site")
    said = next(s for s in result.summary().splitlines() if s.startswith("Precision test"))
    figures = [float(f) for f in re.findall(r"\d\.\d+e[-+]\d+", said)]
    assert figures == [float(f"{table.loc['1', 'fp64_rel_l2']:.3g}"),
                       float(f"{table.loc['1', 'rel_l2']:.3g}")]
    passes = int(re.search(r"float64, (\d+) more passes", said).group(1))
    assert passes == 8 + 1 == result.meta.notes["precision"]["passes"]
    rounding = run(models.variant_mlp(), torch.randn(8, 16))
    said = next(s for s in rounding.summary().splitlines() if s.startswith("Precision test"))
    differ = int(re.search(r"at each of the (\d+) sites", said).group(1))
    assert differ == int((rounding.table["mismatch"] > 0).sum())
    out = rounding.output
    assert out is not None
    assert not math.isnan(out["fp64_rel_l2"])
    assert said.endswith(f"at the output rel_l2 {sci(out['rel_l2'])} becomes "
                         f"{sci(out['fp64_rel_l2'])}.")


def test_two_models_that_compute_differently_are_named_as_such() -> None:
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).eval()
    changed = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).eval()
    changed.load_state_dict(original.state_dict())
    with torch.no_grad():
        changed[2].weight[0, 0] += 1e-5
    result = divtrace.compare_models(original, changed, torch.randn(6, 16), progress=False)
    assert result.verdict == "not rounding"
    assert "the two models compute differently: at '2' (Linear)" in (
        result.summary().splitlines()[0])


# -- the independence test parts every pair; causes named ------------------------------


class PairMix(nn.Module):
    """Each sample takes in its neighbour's value (0 with 1, 2 with 3, ...): a dependence
    inside each half of the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partner = torch.clamp(torch.arange(x.shape[0]) ^ 1, max=x.shape[0] - 1)
        return x + 1e-3 * x[partner]


class CapacityRouter(nn.Module):
    """Top-1 routing over two experts, each taking at most half the batch in batch
    order; a sample past its expert's capacity is passed on unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1)
        capacity = max(1, x.shape[0] // 2)
        out = x.clone()
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()[:capacity]
            out[rows] = expert(x[rows])
        return out


def test_a_dependence_inside_a_half_is_found() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), PairMix(), nn.Linear(16, 4)).eval()
    result = run(model, torch.randn(8, 16))
    assert result.verdict == "not rounding"
    assert "batch mixing: at '1' (PairMix)" in result.summary().splitlines()[0]


def test_a_capacity_limited_router_is_named_by_the_test() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 16), CapacityRouter(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        model[1].gate.bias.copy_(torch.tensor([0.1, -0.1]))  # most go to expert 0
    x = torch.randn(8, 16)
    with torch.no_grad():  # some sample is routed past its expert's capacity
        choice = model[1].gate(model[0](x)).argmax(-1)
    assert int(torch.bincount(choice, minlength=2).max()) > 4
    result = run(model, x)
    assert result.verdict == "not rounding"
    first = result.summary().splitlines()[0]
    assert "batch mixing: at '1' (CapacityRouter)" in first
    assert result.table.set_index("site").loc["1", "depends_on_others"]


def test_the_groups_part_every_ordered_pair() -> None:
    from divtrace.explain.held import groups

    for n, passes in ((1, 1), (2, 2), (3, 3), (8, 5), (128, 10)):
        samples = list(range(0, 3 * n, 3))
        held = groups(samples)
        assert len(held) == passes
        for i in samples:
            for j in samples:
                if i != j:
                    assert any(i in g and j not in g for g in held), (n, i, j)


def test_an_lstm_given_the_wrong_batch_dim_names_the_fix() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8).eval()  # batch_first=False: (T, B, F)
    result = run(lstm, torch.randn(5, 6, 8))
    assert result.verdict == "not rounding"
    assert ("The cause: this LSTM takes the batch along dim 1 (batch_first=False) but the "
            "comparison cut it along dim 0: pass batch_dim=1.") in result.summary().splitlines()[0]


def test_batchnorm_without_running_statistics_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16, track_running_stats=False),
                          nn.Linear(16, 4)).eval()
    result = run(model, torch.randn(8, 16), a=divtrace.Run(chunk=2))
    assert ("The cause: this BatchNorm1d has no running statistics (track_running_stats="
            "False), so it normalises with the batch's own mean and variance in eval mode "
            "too.") in result.summary().splitlines()[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_dynamic_quantization_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    x = torch.randn(8, 16)
    x[5] *= 50  # one sample with a large range: the batch's scale is its
    result = run(quantized, x)
    assert result.verdict == "not rounding"
    assert "is dynamically quantized: the scale of its activations is taken over the whole " \
           "batch" in result.summary().splitlines()[0]


class Counter(nn.Module):
    """Adds the number of calls so far: state kept across calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + 1e-3 * self.calls


class Cache(nn.Module):
    """Keeps the first batch's mean and adds it to every later call."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x if self.kept is None else x + self.kept
        self.kept = x.mean().detach()
        return out


@pytest.mark.parametrize("stateful", [Counter, Cache])
def test_state_across_calls_is_named(stateful: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), stateful(), nn.Linear(16, 4)).eval()
    result = run(model, torch.randn(8, 16))
    assert result.verdict == "not rounding"
    first = result.summary().splitlines()[0]
    assert (f"the model keeps state across calls: the same pass on the same input, repeated "
            f"with deterministic algorithms, differs from '1' ({stateful.__name__}) on") in first
    assert "wrong at one of the two batch sizes" not in result.summary()
    assert result.meta.notes["precision"]["why"] == "the model keeps state across calls"


# -- found as a new user would ---------------------------------------------------------


def test_a_chunk_that_is_not_a_whole_number_is_named() -> None:
    with pytest.raises(divtrace.DivtraceTypeError,
                       match=r"Run\(chunk=...\) must be None or a whole number >= 1; got "
                             r"tensor\(2\.5000\)"):
        divtrace.Run(chunk=torch.tensor(2.5))
    assert divtrace.Run(chunk=torch.tensor(2)).chunk == 2


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_traced_child_is_compared() -> None:
    torch.manual_seed(0)
    inner = torch.jit.trace(nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval(),
                            torch.randn(2, 8))
    model = nn.Sequential(nn.Linear(8, 8), inner, nn.Linear(8, 4)).eval()
    with pytest.warns(divtrace.DivtraceWarning, match="its children run inside TorchScript, "
                      "where no hook fires; its own output is compared"):
        result = run(model, torch.randn(4, 8))
    table = result.table.set_index("site")
    assert "1" in table.index  # the traced module's own output
    assert "1.0" not in table.index  # not what runs inside it
    x = torch.randn(4, 8)
    with pytest.warns(divtrace.DivtraceWarning):
        kept = run(model, x, samples=[0], resources=divtrace.Resources(keep=True))
    with torch.no_grad():
        expected = inner(model[0](x[:1]))
    torch.testing.assert_close(kept.pair("1")[0], expected, rtol=0, atol=0)


def test_removed_attributes_name_their_new_spelling() -> None:
    result = run(models.variant_mlp(), torch.randn(8, 16))
    with pytest.raises(divtrace.DivtraceAttributeError, match=r"Comparison.info is gone: use "
                       r"meta \(the typed settings"):
        _ = result.info
    with pytest.raises(AttributeError, match=r"Comparison.samples is gone: use per_sample"):
        _ = result.samples
    with pytest.raises(divtrace.DivtraceAttributeError, match=r"Meta.get is gone: use the "
                       r"attribute itself"):
        result.meta.get("batch_size")
    with pytest.raises(AttributeError, match="'Comparison' object has no attribute 'nope'"):
        _ = result.nope


def test_the_element_sentence_says_where_the_elements_lie() -> None:
    result = run(mlp(ShapeBias(1e-3)), torch.randn(8, 32), rtol=0, atol=0,
                 resources=divtrace.Resources(keep=True))
    said = next(s for s in result.summary().splitlines() if s.startswith("Element by element"))
    a, b = result.pair("(model)")
    assert bool((a != b).all())
    largest = float(torch.maximum(a.abs(), b.abs()).max())
    assert bool((a.abs() > 1e-3 * largest).all())  # none near zero, as it says
    assert (f"{a.numel()} of {a.numel()} elements are beyond the tolerance, all of them "
            f"away from zero (|value| above 0.001 of the output's largest") in said


class CastNorm(nn.Module):
    """An RMSNorm as language models write it: in float32 whatever the input's dtype,
    its sum over the row in a batch-variant order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        squares = h * h
        order = range(h.shape[-1])
        total = torch.zeros_like(h[..., 0])
        for j in reversed(order) if h.shape[0] > 1 else order:
            total = total + squares[..., j]
        return (h * torch.rsqrt(total[..., None] / h.shape[-1] + 1e-6)).to(x.dtype)


def test_the_model_own_casts_to_float32_stay_in_float64() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), CastNorm(), nn.Linear(64, 4)).eval()
    result = run(model, torch.randn(8, 16))
    table = result.table.set_index("site")
    assert table.loc["1", "mismatch"] > 0  # the float32 sums part the runs ...
    assert not table.loc["1", "depends_on_shape"]  # ... and shrink: it ran in float64
    assert table.loc["1", "fp64_rel_l2"] < 1e-13
    assert result.verdict == "rounding"


class CastSoftmax(nn.Module):
    """Attention weights as language models compute them: a softmax asked for float32
    whatever the input's dtype, over scores whose sum order depends on the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ x.transpose(-1, -2) if x.shape[0] > 1 else (x.double() @ x.double(
        ).transpose(-1, -2)).to(x.dtype)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        return weights @ x


def test_a_function_asked_for_float32_computes_in_float64() -> None:
    from divtrace.explain.float64 import KeptFloat64

    x = torch.randn(4, 8, dtype=torch.float64)
    with KeptFloat64():
        assert torch.softmax(x, dim=-1, dtype=torch.float32).dtype == torch.float64
        assert torch.arange(3, dtype=torch.float32).dtype == torch.float64
        assert torch.arange(3).dtype == torch.int64  # not floating: as it is
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Unflatten(1, (4, 4)), CastSoftmax(),
                          nn.Flatten(), nn.Linear(16, 4)).eval()
    result = run(model, torch.randn(8, 16))
    table = result.table.set_index("site")
    assert table.loc["2", "mismatch"] > 0
    assert table.loc["2", "fp64_rel_l2"] < 1e-13  # the softmax ran in float64
    assert result.verdict == "rounding"


def test_divtrace_own_work_runs_without_the_replay_mode_and_puts_it_back() -> None:
    from torch.overrides import BaseTorchFunctionMode

    from divtrace.compat import function_mode_off
    from divtrace.explain.float64 import KeptFloat64

    x = torch.randn(3, dtype=torch.float64)
    kept = KeptFloat64()
    with kept:
        with function_mode_off(kept):
            assert x.float().dtype == torch.float32  # out of force: a cast is a cast
        assert x.float().dtype == torch.float64  # back on exit
        with pytest.raises(ZeroDivisionError), function_mode_off(kept):
            _ = 1 / 0
        assert x.float().dtype == torch.float64  # back after a raise too
        with BaseTorchFunctionMode(), function_mode_off(kept):  # not innermost: untouched
            assert x.float().dtype == torch.float64
    assert torch._C._len_torch_function_stack() == 0
    with function_mode_off(kept):  # not in force at all: nothing to take off
        assert x.float().dtype == torch.float32


def test_experts_on_grouped_mm_run_in_float64() -> None:
    model = models.grouped_mm_mixtral()
    x = torch.randint(1, 50, (4, 7))
    result = divtrace.compare(model, x, explain=["fp64", "-independence"], progress=False)
    assert model.config._experts_implementation == "grouped_mm"  # the user's model as it was
    assert result.meta.notes["precision"]["ran"]  # grouped_mm takes no float64: eager there
    assert result.table["a_err_fp64"].notna().any()
    output = result.table.set_index("site").loc["(model)/logits"]
    assert output["fp64_rel_l2"] < 1e-13 < output["rel_l2"]


class BatchSoftmax(nn.Module):
    """A softmax over the batch's dimension where the features' was meant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=0)


def test_an_op_along_the_batch_is_named_as_the_cause() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), BatchSoftmax(), nn.Linear(8, 2)).eval()
    result = divtrace.compare(model, torch.randn(6, 8), ops=True, progress=False)
    assert result.verdict == "not rounding"
    found = result.meta.notes["independence"]["causes"]
    key = next(k for k in found if "softmax" in k)
    assert found[key].startswith("this aten.softmax runs along dim 0, the batch's")
    assert f"The cause: {found[key]}." in result.summary()
    plain = divtrace.compare(model, torch.randn(6, 8), progress=False)  # no op sites:
    assert "Check for a statistic over the batch" in plain.summary()  # the list stays
    along = nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=1), nn.Linear(8, 2)).eval()
    fine = divtrace.compare(along, torch.randn(6, 8), ops=True, progress=False)
    assert not fine.meta.notes["independence"].get("causes")  # dim 1: no cause to name


class Float32Only(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise RuntimeError("this kernel takes float32 only")
        return x * 2


@pytest.mark.parametrize("case", ["ran", "identical", "failed", "mixing"])
def test_the_progress_bar_ends_full(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import divtrace.pipeline
    from divtrace.progress import Progress

    ended: list[tuple[int, int]] = []

    class Counted(Progress):
        def __init__(self, total: int, enabled: bool) -> None:
            super().__init__(total, False)
            self.total, self.done = total, 0

        def more(self, passes: int) -> None:
            self.total += passes

        def advance(self) -> None:
            self.done += 1

        def __exit__(self, *exc: object) -> None:
            ended.append((self.done, self.total))

    monkeypatch.setattr(divtrace.pipeline, "Progress", Counted)
    torch.manual_seed(0)
    model = {"ran": mlp(ShapeBias(1e-6)), "identical": nn.Sequential(nn.ReLU()),
             "failed": nn.Sequential(models.variant_mlp(), Float32Only()),
             "mixing": nn.Sequential(nn.Linear(32, 8), BatchSoftmax())}[case].eval()
    width = 16 if case == "failed" else 32
    result = run(model, torch.randn(8, width))
    assert result.meta.notes["precision"]["ran"] == (case == "ran")
    (done, total), = ended
    assert done == total  # every pass it counted on, and no more


def _wide(variant_from: int) -> nn.Sequential:
    """The variant MLP (batch-variant from ``variant_from`` rows on), then a site of rows
    too wide for the CPU's queue (measured alone, in blocks of columns)."""
    torch.manual_seed(0)
    return nn.Sequential(models.variant_mlp(variant_from), nn.Linear(8, 20_000), nn.Tanh(),
                         nn.Linear(20_000, 4)).eval()


@pytest.mark.parametrize(("samples", "chunk", "variant_from"), [
    ([3], 1, 2), ([0, 1], 2, 3), ([1, 3, 6], 8, 9)])  # (one pass: from row 3; from row
# 0; one holding other samples between the compared ones)
def test_the_float64_replay_stores_run_b_first_with_the_same_figures(
        samples: list[int], chunk: int, variant_from: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from divtrace.explain import float64

    model, x = _wide(variant_from), torch.randn(10, 16)
    taken: list[bool] = []
    usual_order = float64._batched_first
    monkeypatch.setattr(float64, "_batched_first",
                        lambda *args: taken.append(usual_order(*args)) or taken[-1])
    first = run(model, x, samples=samples, a=divtrace.Run(chunk=chunk))
    monkeypatch.setattr(float64, "_batched_first", lambda *_: False)
    usual = run(model, x, samples=samples, a=divtrace.Run(chunk=chunk))
    assert taken == [True]
    assert first.meta.notes["precision"]["ran"]
    table = first.table
    wide = table[table["module_type"] == "Linear"].iloc[-2]  # the 20,000 features
    assert wide["mismatch"] > 0
    assert 0 < wide["fp64_rel_l2"] < wide["rel_l2"] * 1e-6
    assert table.equals(usual.table), table.compare(usual.table)
