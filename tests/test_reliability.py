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
    result = run(model, x, explain=["local"] if local else [],
                 resources=divtrace.Resources(keep=True))
    torch.testing.assert_close(x, given, rtol=0, atol=0)  # the user's x is untouched
    split, batched = result.pair("(model)")
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
    result = run(model, x, resources=divtrace.Resources(keep=True))
    out = result.output
    split, batched = result.pair("(model)")
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
    result = run(ComplexOut().eval(), torch.randn(6, 16), resources=divtrace.Resources(keep=True))
    out = result.output
    split, batched = result.pair("(model)")
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
    ({"batch_dim": 0.0}, TypeError, "batch_dim must be an int; got 0.0"),
    ({"batch_dim": None}, TypeError, "batch_dim must be an int or a structure"),
])
def test_bad_arguments_are_named(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        run(models.variant_mlp(), torch.randn(4, 16), **kwargs)
    assert isinstance(info.value, divtrace.DivtraceError)
    with pytest.raises(TypeError, match=r"Local\(skip=...\) must be a glob pattern"):
        divtrace.Local(skip=5)  # type: ignore[arg-type]


def test_numpy_integers_and_0d_tensors_work_where_ints_are_expected() -> None:
    x = torch.randn(8, 16)
    result = run(models.variant_mlp(), x, explain=[divtrace.Repeat(np.int8(1))],
                 a=divtrace.Run(chunk=np.int64(2)), samples=np.array([1, 5]),
                 batch_dim=np.int32(0))
    assert result.meta.a_chunk == 2
    assert result.meta.samples == (1, 5)
    assert run(models.variant_mlp(), x, samples=torch.tensor([3])).meta.samples == (3,)
    for one in (3, np.int64(3), torch.tensor(3)):  # "row 3" or "the first 3"?
        with pytest.raises(divtrace.DivtraceTypeError, match=r"samples=3 is one number; "
                           r"samples takes the rows to compare: samples=\[3\] for row 3 "
                           r"alone, samples=range\(3\) for the first 3 rows"):
            run(models.variant_mlp(), x, samples=one)
    assert run(models.variant_mlp(), x, a=divtrace.Run(chunk=np.int64(4))).meta.a_chunk == 4


# -- buffers, parameters and the random state -------------------------------------------------


class CountsCalls(nn.Module):
    """An eval-mode model that counts its calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


@pytest.mark.parametrize("model", [
    CountsCalls().eval(),
    nn.Sequential(nn.Linear(16, 4), nn.InstanceNorm1d(1, track_running_stats=True),
                  nn.Flatten()).train(),
], ids=["call-counter", "instance-norm-train"])
def test_every_buffer_comes_back(model: nn.Module) -> None:
    x = torch.randn(6, 16)
    if isinstance(model, nn.Sequential):
        x = x.unsqueeze(1)  # InstanceNorm1d wants (B, C, L)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run(model, x)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


class ChangesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fc.weight.mul_(1.0)
        return self.fc(x)


def test_a_parameter_changed_in_place_is_a_warning() -> None:
    with pytest.warns(divtrace.DivtraceWarning,
                      match=r"changed these parameters.*fc\.weight") as caught:
        run(ChangesItsWeight().eval(), torch.randn(4, 16))
    assert caught[0].filename == __file__  # the user's call, not divtrace's frames
    with pytest.warns(divtrace.DivtraceWarning, match=r"changed these parameters") as caught:
        divtrace.compare_models(ChangesItsWeight().eval(), ChangesItsWeight().eval(),
                                torch.randn(4, 16), progress=False)
    assert caught[0].filename == __file__


class DrawsRandom(nn.Module):
    """Eval mode, no Dropout module, yet random: a functional dropout left on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.fc(x), 0.5, training=True)


@pytest.mark.parametrize("model", [
    DrawsRandom().eval(),
    nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True),  # fresh: in train mode
], ids=["functional-dropout", "attention-dropout"])
def test_random_draws_are_refused(model: nn.Module) -> None:
    x = torch.randn(4, 3, 8) if isinstance(model, nn.MultiheadAttention) else torch.randn(4, 16)
    args = (x, x, x) if isinstance(model, nn.MultiheadAttention) else x
    with pytest.raises(divtrace.BatchMixingError, match=r"drew random numbers in the split run"):
        run(model, args)


def test_random_draws_allowed_are_said_and_the_random_state_comes_back() -> None:
    model, x = DrawsRandom().eval(), torch.randn(4, 16)
    state = torch.get_rng_state()
    result = run(model, x, allow_train=True)
    assert torch.equal(torch.get_rng_state(), state)  # compare() moved no generator
    assert result.meta.random_draws
    assert "drew random numbers during its passes" in result.summary()


def test_a_deterministic_model_is_not_flagged() -> None:
    result = run(models.variant_mlp(), torch.randn(4, 16))
    assert not result.meta.random_draws
    assert "random" not in result.summary()


# -- tensors that are not per-sample rows ---------------------------------------------------


class PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> object:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        return self.lstm(packed)


def test_packed_sequences_are_reported_apart_and_the_states_compared() -> None:
    model, x, lengths = PackedLSTM().eval(), torch.randn(6, 4, 4), torch.tensor([6, 3, 5, 2])
    result = run(model, (x, lengths), batch_dim=(1, 0), resources=divtrace.Resources(keep=True))
    table = result.table.set_index("site")
    packed = [f"lstm/0/{f}" for f in ("data", "batch_sizes", "sorted_indices",
                                      "unsorted_indices")]
    assert (table.loc[packed, "status"] == "not_per_sample").all()
    assert table.loc["lstm/1/0", "status"] == "ok"  # h_n: (layers, B, H), batch at dim 1
    split, batched = result.pair("lstm/1/0")
    with torch.no_grad():
        alone = torch.cat([model(x[:, i:i + 1], lengths[i:i + 1])[1][0] for i in range(4)],
                          dim=1)
    torch.testing.assert_close(split, alone.movedim(1, 0), rtol=0, atol=0)
    assert batched.shape == split.shape == (4, 1, 5)
    first = result.first_divergence
    assert first is None or first["site"] not in packed


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_inside_an_encoder_are_reported_and_the_output_compared() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x, mask = torch.randn(4, 6, 16), torch.zeros(4, 6, dtype=torch.bool)
    mask[0, 4:] = True
    result = run(encoder, {"src": x, "src_key_padding_mask": mask})
    table = result.table
    assert (table.loc[table["site"] != "(model)", "status"] == "nested").all()
    assert result.output["status"] == "ok"
    assert result.output["rel_l2"] < 1e-5


class SparseOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = models.OrderedLinear(16, 8, variant_from=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu().to_sparse()


def test_sparse_outputs_are_compared_as_dense() -> None:
    model, x = SparseOut().eval(), torch.randn(6, 16)
    result = run(model, x, resources=divtrace.Resources(keep=True))
    split, batched = result.pair("(model)")
    with torch.no_grad():
        expected = model(x).to_dense()
    torch.testing.assert_close(batched, expected, rtol=0, atol=0)
    assert result.output["mismatch"] == (batched != split).double().mean().item()


def test_meta_tensors_are_refused_with_the_fix() -> None:
    with pytest.raises(divtrace.DivtraceValueError, match=r"meta device.*load the weights"):
        run(nn.Linear(4, 4, device="meta"), torch.randn(4, 4))
    with pytest.raises(divtrace.DivtraceValueError, match=r"x lie\(s\) on the meta device"):
        run(nn.Linear(4, 4), torch.empty(4, 4, device="meta"))


# -- inputs that say what they are ------------------------------------------------------------


def test_a_seq_first_encoder_with_a_batch_first_mask() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=False)
    encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    src, mask = torch.randn(5, 4, 16), torch.zeros(4, 5, dtype=torch.bool)
    mask[1, 3:] = True
    result = run(encoder, {"src": src, "src_key_padding_mask": mask},
                 batch_dim={"src": 1,
                            "src_key_padding_mask": 0}, resources=divtrace.Resources(keep=True))
    split, batched = result.pair("(model)")
    with torch.no_grad():
        alone = torch.cat([encoder(src[:, i:i + 1], src_key_padding_mask=mask[i:i + 1])
                           for i in range(4)], dim=1)
    torch.testing.assert_close(split, alone.movedim(1, 0), rtol=0, atol=0)
    with torch.no_grad():
        whole = encoder(src, src_key_padding_mask=mask)
    torch.testing.assert_close(batched, whole.movedim(1, 0), rtol=0, atol=0)
    assert result.meta.batch_dim == 1


def test_an_lstm_with_an_initial_state() -> None:
    lstm = nn.LSTM(4, 5).eval()
    x, h0, c0 = torch.randn(6, 3, 4), torch.randn(1, 3, 5), torch.randn(1, 3, 5)
    result = run(lstm, (x, (h0, c0)), batch_dim=(1, (1, 1)),
                 resources=divtrace.Resources(keep=True))
    split, batched = result.pair("(model)/0")
    with torch.no_grad():
        alone = torch.cat([lstm(x[:, i:i + 1], (h0[:, i:i + 1], c0[:, i:i + 1]))[0]
                           for i in range(3)], dim=1)
        whole = lstm(x, (h0, c0))[0]
    torch.testing.assert_close(split, alone.movedim(1, 0), rtol=0, atol=0)
    torch.testing.assert_close(batched, whole.movedim(1, 0), rtol=0, atol=0)


@pytest.mark.parametrize(("batch_dim", "message"), [
    ((1,), r"batch_dim for x has 1 entries but x has 2"),
    ({"nope": 0}, r"batch_dim names \['nope'\]"),
    ((3, None), r"dimension 3 of x\[0\], which has shape \(6, 3, 4\)"),
    ((None, None), "keeps every tensor of x whole"),
    ((1, 0), r"x\[1\] has 4 rows at its batch dimension 0, but B=3"),
])
def test_bad_batch_dim_structures(batch_dim: object, message: str) -> None:
    x = {"a": torch.randn(6, 3, 4)} if isinstance(batch_dim, dict) else (
        torch.randn(6, 3, 4), torch.randn(4))
    with pytest.raises(divtrace.DivtraceError, match=message):
        run(nn.Identity(), x, batch_dim=batch_dim)


class WithBias(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + bias.sum()


def test_a_1d_tensor_beside_a_batched_one_is_named_when_cut() -> None:
    x = {"x": torch.randn(8, 16), "bias": torch.randn(8)}
    with pytest.warns(divtrace.DivtraceWarning, match=r"x\['bias'\] \(shape \(8,\)\): cut per"):
        run(WithBias().eval(), x)
    result = run(WithBias().eval(), x, batch_dim={"x": 0, "bias": None})  # no warning
    assert result.output["status"] == "ok"


def test_a_list_of_images_is_refused_with_the_fix() -> None:
    images = [torch.randn(3, 8, 8), torch.randn(3, 8, 8)]
    with pytest.raises(divtrace.DivtraceValueError, match=r"x\[0\] is a list of 2 tensors.*"
                                                          r"Stack them"):
        run(nn.Identity(), (images,))


# -- outputs with nothing to compare, and the observer check ------------------------------------


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> None:
        self.fc(x)


class ReturnsText(nn.Module):
    def forward(self, x: torch.Tensor) -> str:
        return "done"


@pytest.mark.parametrize(("model", "said"), [
    (ReturnsNone(), "The model's output (a NoneType) holds no tensor"),
    (ReturnsText(), "No site could be compared: no observed module returned a tensor."),
])
def test_outputs_without_tensors_are_said(model: nn.Module, said: str) -> None:
    result = run(model.eval(), torch.randn(4, 4))
    assert said in result.summary()
    assert "agree exactly" not in result.summary()
    assert result.meta.output_type == type(model.eval()(torch.randn(1, 4))).__name__


class HookShy(nn.Module):
    """Takes another path when it has hooks (as TransformerEncoderLayer's fast path does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0 + (1e-3 if self._forward_hooks else 0.0)


def test_the_observer_check_finds_hooks_that_change_the_code_path() -> None:
    result = run(HookShy().eval(), torch.randn(4, 8), explain=["observer"])
    note = result.meta.notes["observer"]
    assert not note["identical"]
    assert note["differs"]["(model)"] > 1e-5
    assert "Observer effect" in result.summary()
    plain = run(models.variant_mlp(), torch.randn(4, 16), explain=["observer"])
    assert plain.meta.notes["observer"]["identical"]
    assert "observer" not in run(models.variant_mlp(), torch.randn(4, 16)).meta.notes


def test_the_observer_check_runs_by_itself_for_transformer_layers() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    result = run(layer, torch.randn(4, 6, 16))
    assert "observer" in result.meta.notes
    assert result.meta.notes["observer"]["identical"] in (True, False)


ODD_OUTPUTS = {
    "quantized": lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8),
    "float8": lambda x: x.to(torch.float8_e4m3fn),
    "complex32": lambda x: torch.complex(x, x).to(torch.complex32),
    "generator": lambda x: (t for t in [x]),
    "0-d": lambda x: x.sum(),
    "jagged": lambda x: torch.nested.nested_tensor(list(x), layout=torch.jagged),
    "list with None": lambda x: [x * 2, None, "text"],
}


class Odd(nn.Module):
    def __init__(self, make: object) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> object:
        return self.make(x * (1.0001 if x.shape[0] > 1 else 1.0))  # type: ignore[operator]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(ODD_OUTPUTS))
def test_odd_outputs_are_reported_never_a_crash(name: str) -> None:
    truth = [] if name == "quantized" else ["fp64"]  # quantize takes no float64 input
    result = run(Odd(ODD_OUTPUTS[name]).eval(), torch.randn(4, 3),
                 explain=["local", *truth, divtrace.Repeat(1), "kernels", "observer"])
    statuses = set(result.table["status"])
    assert statuses <= {"ok", "unbatched", "nested", "not_per_sample"}
    assert result.summary()
    if name in ("quantized", "float8", "complex32"):
        assert statuses == {"ok"}


class InPlaceWhenBatched(nn.Module):
    """Changes its input in place only for batches of more than 2 rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            x.mul_(2.0)
        return x + 1.0


def test_only_the_first_pass_pays_for_a_copy_unless_the_input_changes() -> None:
    from divtrace.plan.inputs import prepare_input
    from divtrace.record.loop import InputCopies

    batch = prepare_input(torch.randn(4, 3), 0)
    copies = InputCopies(batch)
    quiet = [torch.randn(3)]
    copies.after(quiet, copies.seen(quiet))
    assert not copies.copy  # the first pass left its copy alone: views from now on
    loud = [torch.randn(3)]
    seen = copies.seen(loud)
    loud[0].add_(1.0)
    copies.after(loud, seen)
    assert copies.copy  # a view was changed, so was the input: copies from now on
    assert copies.changed_given
    with torch.inference_mode():
        made_there = torch.randn(4, 3)
    assert InputCopies(prepare_input(made_there, 0)).copy  # no version counter: copies


def test_a_model_that_changes_its_input_only_when_batched_is_named() -> None:
    x = torch.randn(4, 3)
    with pytest.warns(divtrace.DivtraceWarning, match="rows of x were changed"):
        run(InPlaceWhenBatched(), x, a=divtrace.Run(chunk=2))
