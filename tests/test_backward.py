"""compare_backward(): one backward over the batch against gradient accumulation, checked
against recorders of the tests' own, and every sentence of its verdict tried."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import divtrace
import divtrace.testing
from divtrace.backward.verdict import HINT
from divtrace.cli import main
from tests.models import tiny_llama

V, D = 40, 24


class Tokens(nn.Module):
    """A token-level model: embedding, an MLP, a head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mlp = nn.Sequential(nn.Linear(D, D), nn.GELU())
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.emb(ids)))


def _tokens_batch(lengths: list[int], width: int = 12) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, V, (len(lengths), width))
    labels = ids.clone()
    for i, n in enumerate(lengths):
        labels[i, n:] = -100
    return {"ids": ids, "labels": labels}


def _token_mean(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b["ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=-100)


def _counted(batch: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    total = int((batch["labels"] != -100).sum())
    return lambda part: int((part["labels"] != -100).sum()) / total


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.ReLU(),
                         nn.Linear(48, 2))


def _mse(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1])


def _regression(rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    return torch.randn(rows, 16), torch.randn(rows, 2)


def _by_hand(model: nn.Module, batch, loss, chunk: int, weight=None):  # type: ignore[no-untyped-def]
    """The batched and the accumulated gradients, by an independent loop."""
    x, y = batch
    size = len(x)
    model.zero_grad(set_to_none=True)
    loss(model, (x, y)).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for start in range(0, size, chunk):
        part = (x[start:start + chunk], y[start:start + chunk])
        w = len(part[0]) / size if weight is None else weight(part)
        (w * loss(model, part)).backward()
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return whole, accumulated


def test_each_parameters_figures_are_those_of_an_independent_accumulation_loop() -> None:
    model, batch = _mlp(), _regression()
    found = divtrace.compare_backward(model, batch, _mse, chunk=4, progress=False)
    whole, accumulated = _by_hand(copy.deepcopy(model), batch, _mse, 4)
    params = found.parameters.set_index("site")
    assert list(params.index) == list(whole)
    for name, b in whole.items():
        a = accumulated[name]
        row = params.loc[name]
        assert row["mismatch"] == pytest.approx(float((a != b).double().mean()), abs=0)
        assert row["max_abs"] == float((a - b).abs().max())
        assert row["rel_l2"] == pytest.approx(
            float((a.double() - b.double()).norm() / a.double().norm()), rel=1e-12)
    assert found.verdict.kind in ("identical", "rounding")
    assert found.weights.passed is True
    assert (found.weights.table["ratio"] - 1).abs().max() <= found.weights.limit


@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_output_gradient_rows_are_those_of_a_full_backward_hook_recorder() -> None:
    model, batch = _mlp(), _regression()
    samples = [1, 6, 7]
    found = divtrace.compare_backward(model, batch, _mse, chunk=4, samples=samples,
                                      progress=False)
    copied = copy.deepcopy(model)
    seen: dict[str, list[list[torch.Tensor]]] = {}
    order: list[str] = []

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(_m, _gin, gout):  # type: ignore[no-untyped-def]
            seen.setdefault(name, []).append(gout[0].detach().clone())
            order.append(name)
        return record

    handles = [m.register_full_backward_hook(hook(n)) for n, m in copied.named_children()]
    x, y = batch
    for start in range(0, 12, 4):  # the split run: rows by chunk, then the batched run
        (4 / 12 * _mse(copied, (x[start:start + 4], y[start:start + 4]))).backward()
    order.clear()
    _mse(copied, batch).backward()
    for h in handles:
        h.remove()
    grads = found.of("grad").set_index("site")
    leaf_order = [s for s in found.of("grad")["site"] if s in seen]
    assert leaf_order == order
    for name, got in seen.items():
        split = torch.cat(got[:3])[samples]
        batched = got[3][samples]
        row = grads.loc[name]
        assert row["max_abs"] == float((batched - split).abs().max())
        assert row["rel_l2"] == pytest.approx(
            float((batched.double() - split.double()).norm() / split.double().norm()),
            rel=1e-12, abs=0)


def test_a_token_mean_loss_accumulated_with_row_weights_is_not_rounding() -> None:
    batch = _tokens_batch([12, 3, 9, 5, 12, 2, 7, 11])
    torch.manual_seed(0)
    model = Tokens()
    found = divtrace.compare_backward(model, batch, _token_mean, chunk=2, progress=False)
    assert found.verdict.kind == "not rounding"
    assert "not the batched loss" in found.verdict.sentence
    assert HINT in found.verdict.sentence
    assert found.weights.passed is False
    # each chunk's ratio is its share of the rows over its share of the tokens
    labels = batch["labels"]
    total = int((labels != -100).sum())
    for row in found.weights.table.itertuples():
        tokens = int((labels[row.start:row.stop] != -100).sum())
        assert row.ratio == pytest.approx((2 / 8) / (tokens / total), rel=1e-5)
    fixed = divtrace.compare_backward(model, batch, _token_mean, chunk=2,
                                      weight=_counted(batch), progress=False)
    assert fixed.verdict.kind == "rounding", fixed.verdict.sentence
    assert fixed.weights.passed is True
    assert "same objective" in fixed.verdict.sentence
    worst = fixed.of("param")["rel_l2"].max()
    assert worst < 1e-5 < found.of("param")["rel_l2"].max()


def test_equal_token_counts_make_row_weights_right() -> None:
    batch = _tokens_batch([6, 4, 5, 5, 8, 2, 3, 7])  # every pair holds 10 tokens
    torch.manual_seed(0)
    found = divtrace.compare_backward(Tokens(), batch, _token_mean, chunk=2, progress=False)
    assert found.weights.passed is True
    assert found.verdict.kind == "rounding"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_right_weights_never_read_as_a_bug(dtype: torch.dtype, chunk: int) -> None:
    for seed in range(3):
        torch.manual_seed(seed)
        model = Tokens().to(dtype)
        lengths = torch.randint(1, 13, (10,)).tolist()
        batch = _tokens_batch(lengths)
        found = divtrace.compare_backward(model, batch, _token_mean, chunk=chunk,
                                          weight=_counted(batch), progress=False,
                                          forward=False)
        assert found.weights.passed is True, found.weights.table
        assert found.verdict.kind in ("rounding", "identical")


def test_a_bfloat16_model_with_row_weights_is_caught() -> None:
    batch = _tokens_batch([12, 1, 12, 1, 12, 1, 2, 12])
    torch.manual_seed(0)
    found = divtrace.compare_backward(Tokens().bfloat16(), batch, _token_mean, chunk=2,
                                      progress=False, forward=False)
    assert found.weights.dtype == "bfloat16"
    assert found.verdict.kind == "not rounding"


def test_a_summed_loss_takes_weight_one() -> None:
    model, batch = _mlp(), _regression()

    def summed(m: nn.Module, b):  # type: ignore[no-untyped-def]
        return F.mse_loss(m(b[0]), b[1], reduction="sum")

    found = divtrace.compare_backward(model, batch, summed, chunk=3, progress=False)
    assert found.verdict.kind == "not rounding"
    assert found.weights.table["ratio"].tolist() == pytest.approx([0.25] * 4, rel=1e-6)
    ones = divtrace.compare_backward(model, batch, summed, chunk=3, weight=lambda p: 1,
                                     progress=False)
    assert ones.verdict.kind in ("rounding", "identical")


def test_a_loss_that_mixes_the_batch_is_not_rounding() -> None:
    model, batch = _mlp(), _regression()

    def centred(m: nn.Module, b):  # type: ignore[no-untyped-def]
        out = m(b[0])
        return ((out - out.mean(0)) ** 2).mean()

    found = divtrace.compare_backward(model, batch, centred, chunk=4, progress=False)
    assert found.verdict.kind == "not rounding"
    assert "mixes the samples of its batch" in found.verdict.sentence


def test_bit_identical_runs_are_identical() -> None:
    model = nn.Sequential(nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, -2.0]]))
    x = torch.tensor([[1.0, 2.0], [0.0, 1.0], [2.0, 2.0], [1.0, 0.0]])
    y = torch.tensor([[1.0], [0.0], [-2.0], [3.0]])
    found = divtrace.compare_backward(model, (x, y), _mse, chunk=2, progress=False)
    assert found.verdict.kind == "identical", found.summary()
    assert (found.table["mismatch"] == 0).all()


def test_the_users_model_and_grads_come_back_as_they_were() -> None:
    model, batch = _mlp(), _regression()
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    model.train()
    divtrace.compare_backward(model, batch, _mse, chunk=4, progress=False)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "0.weight")
    assert torch.equal(torch.get_rng_state(), state)


def test_dropout_in_train_mode_is_refused_unless_allowed() -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    with pytest.raises(divtrace.BatchMixingError, match=r"model\.eval"):
        divtrace.compare_backward(model, _regression(), _mse, chunk=4, progress=False)
    found = divtrace.compare_backward(model, _regression(), _mse, chunk=4, progress=False,
                                      allow_train=True, forward=False)
    assert found.forward is None
    assert found.forward_why == "forward=False"


def test_bad_arguments_name_the_fix() -> None:
    model, batch = _mlp(), _regression()
    with pytest.raises(divtrace.DivtraceTypeError, match="loss must be a callable"):
        divtrace.compare_backward(model, batch, "mse", chunk=4)  # type: ignore[arg-type]
    with pytest.raises(divtrace.DivtraceTypeError, match="scalar tensor"):
        divtrace.compare_backward(model, batch, lambda m, b: m(b[0]), chunk=4,
                                  progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="finite number"):
        divtrace.compare_backward(model, batch, _mse, chunk=4, weight=lambda p: "half",
                                  progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="without a gradient"):
        divtrace.compare_backward(model, batch, lambda m, b: _mse(m, b).detach(), chunk=4,
                                  progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="chunk"):
        divtrace.compare_backward(model, batch, _mse, chunk=12, progress=False)
    assert all(p.grad is None for p in model.parameters())


def test_saved_loaded_drawn_and_diffed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    batch = _tokens_batch([12, 3, 9, 5, 12, 2, 7, 11])
    torch.manual_seed(0)
    found = divtrace.compare_backward(Tokens(), batch, _token_mean, chunk=2, progress=False)
    back = divtrace.load(found.save(tmp_path / "b.json"))
    assert isinstance(back, divtrace.Backward)
    assert back.table.equals(found.table)
    assert back.summary() == found.summary()
    assert back.forward is not None
    assert back.forward.table.equals(found.forward.table)
    assert found.diff(back).changed.empty
    assert set(found.diff(back).table["site"]) == set(found.rows()["site"])
    for kind in ("grad", "param"):
        ax = found.plot(kind=kind)
        assert ax.get_title().endswith("not rounding")
    page = found.to_html(tmp_path / "b.html").read_text()
    assert "weights test" in page
    assert "data:image/png" in page
    assert "not rounding" in found._repr_html_()
    assert "not rounding" in repr(found)


def test_the_testing_assertion() -> None:
    batch = _tokens_batch([12, 3, 9, 5, 12, 2, 7, 11])
    torch.manual_seed(0)
    model = Tokens()
    with pytest.raises(AssertionError, match="not the batched loss"):
        divtrace.testing.assert_accumulation_matches(model, batch, _token_mean, chunk=2)
    divtrace.testing.assert_accumulation_matches(model, batch, _token_mean, chunk=2,
                                                 weight=_counted(batch))


def test_the_command_line(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "target.py"
    target.write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        def step():
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                      torch.nn.Linear(8, 1))
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            return net, (x, y), lambda m, b: F.mse_loss(m(b[0]), b[1], reduction="sum")

        def fixed():
            return (*step(), lambda part: 1)
        """))
    out = tmp_path / "b.json"
    code = main(["backward", f"{target}:step", "--chunk", "2", "--fail-on", "not-rounding",
                 "--json", str(out), "--no-progress"])
    assert code == 1
    assert "Verdict: not rounding" in capsys.readouterr().out
    assert main(["show", str(out)]) == 0
    assert "not rounding" in capsys.readouterr().out
    assert main(["diff", str(out), str(out), "--fail-on-change"]) == 0
    assert "No site changed its behaviour" in capsys.readouterr().out
    assert main(["backward", f"{target}:fixed", "--chunk", "2", "--fail-on", "not-rounding",
                 "--no-progress"]) == 0
    assert main(["backward", f"{target}:fixed", "--chunk", "2", "--dtype", "float64",
                 "--no-progress"]) == 0
    assert "float64" in capsys.readouterr().out
    assert main(["backward", f"{target}:nothing", "--chunk", "2"]) == 2


def test_a_language_model_with_its_own_loss() -> None:
    pytest.importorskip("transformers")
    model = tiny_llama()
    torch.manual_seed(3)
    ids = torch.randint(0, 100, (6, 10))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for i, n in enumerate([10, 3, 7, 10, 2, 5]):
        mask[i, n:] = 0
        labels[i, n:] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def tokens(part):  # type: ignore[no-untyped-def]
        return int((part["labels"][:, 1:] != -100).sum())  # the loss shifts its labels

    total = tokens(batch)
    loss = lambda m, b: m(**b).loss  # noqa: E731
    bug = divtrace.compare_backward(model, batch, loss, chunk=2, progress=False)
    assert bug.verdict.kind == "not rounding"
    assert bug.weights.site == "lm_head"
    fixed = divtrace.compare_backward(model, batch, loss, chunk=2,
                                      weight=lambda p: tokens(p) / total, progress=False)
    assert fixed.verdict.kind == "rounding", fixed.verdict.sentence
    assert fixed.forward is not None
    assert "lm_head" in set(fixed.forward.table["site"])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_bug_is_named_and_the_fix_confirmed(dtype: torch.dtype) -> None:
    batch = {k: v.cuda() for k, v in _tokens_batch([12, 3, 9, 5, 12, 2, 7, 11]).items()}
    torch.manual_seed(0)
    model = Tokens().to("cuda", dtype)
    bug = divtrace.compare_backward(model, batch, _token_mean, chunk=2, progress=False)
    assert bug.verdict.kind == "not rounding"
    fixed = divtrace.compare_backward(model, batch, _token_mean, chunk=2,
                                      weight=_counted(batch), progress=False)
    assert fixed.verdict.kind in ("rounding", "identical"), fixed.verdict.sentence
    assert fixed.weights.passed is True


@pytest.mark.cuda
def test_on_cuda_each_parameters_figures_are_an_independent_loops() -> None:
    model = _mlp().cuda()
    batch = tuple(t.cuda() for t in _regression(64))
    found = divtrace.compare_backward(model, batch, _mse, chunk=16, progress=False)
    whole, accumulated = _by_hand(copy.deepcopy(model), batch, _mse, 16)
    params = found.of("param").set_index("site")
    for name, b in whole.items():
        a = accumulated[name]
        assert params.loc[name]["max_abs"] == float((a - b).abs().max())
        assert params.loc[name]["rel_l2"] == pytest.approx(  # the fused kernel's float32 sums
            float((a.double() - b.double()).norm() / a.double().norm()), rel=1e-6, abs=0)


def test_a_model_of_one_layer_is_its_own_loss_input() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 2)
    found = divtrace.compare_backward(model, _regression(), _mse, chunk=4, progress=False)
    assert found.weights.site == "(model)"
    assert found.weights.passed is True
    assert found.forward is None
    assert "one module" in str(found.forward_why)
    assert found.verdict.kind in ("identical", "rounding")
    if found.verdict.kind == "rounding":
        assert "the forward pass was not compared" in found.verdict.sentence
    assert set(found.of("param")["module"]) == {"(model)"}


def _variant_loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b[0]), b[1])


def test_the_forward_sites_are_compare_on_the_loss_and_every_chunk_is_trained() -> None:
    from divtrace.backward.passes import Objective
    from tests.models import variant_mlp

    torch.manual_seed(3)
    batch = (torch.randn(8, 16), torch.randn(8, 8))
    model = variant_mlp(variant_from=3)  # chunks of 2 sum one way, the batch the other
    found = divtrace.compare_backward(model, batch, _variant_loss, chunk=2, samples=[5],
                                      progress=False)
    alone = divtrace.compare(Objective(model, _variant_loss, batch), batch, samples=[5],
                             a=divtrace.Run(chunk=2), progress=False)
    shown = ["site", "status", "mismatch", "rel_l2", "max_abs", "max_ulp", "role",
             "depends_on_others"]
    assert found.forward is not None
    assert found.forward.first_divergence is not None  # the layer that sums the other way
    assert found.forward.first_divergence["site"] == "3"
    assert found.forward.table[shown].equals(alone.table[shown])
    # with one sample compared, the split run still trains on every chunk, in order
    assert found.steps["start"].tolist() == [0, 2, 4, 6, 0]
    whole, accumulated = _by_hand(copy.deepcopy(model), batch, _variant_loss, 2)
    params = found.parameters.set_index("site")
    for name, b in whole.items():
        a = accumulated[name]
        assert params.loc[name, "max_abs"] == float((a - b).abs().max())
    assert found.verdict.kind == "rounding", found.verdict.sentence


class GradModeBranch(nn.Module):
    """Adds a different tiny amount with autograd on and off: a kernel or fast path chosen
    by whether a gradient is wanted."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (1e-3 if torch.is_grad_enabled() else 2e-3)


def test_the_independence_test_runs_as_the_training_passes_do() -> None:
    from tests.models import OrderedLinear

    model = nn.Sequential(OrderedLinear(16, 32), OrderedLinear(32, 32, variant_from=3),
                          GradModeBranch(), OrderedLinear(32, 2)).eval()
    found = divtrace.compare_backward(model, _regression(8), _mse, chunk=2, progress=False)
    assert found.forward is not None
    tested = found.forward.table["depends_on_others"].dropna()
    assert len(tested) >= 2  # the test ran at the source and before it
    assert not tested.astype(bool).any()  # and nothing moved
    assert found.verdict.kind == "rounding", found.verdict.sentence
    assert "inconclusive" not in found.verdict.sentence  # its repeat agreed with the run


def test_a_pass_asked_for_again_is_not_backpropagated_twice() -> None:
    from divtrace.backward.training import Training

    trained: list[tuple[int, int]] = []

    class Counted:
        samples = (1,)
        batch = type("B", (), {"batch_size": 4})()

        def train(self, start, stop, value):  # type: ignore[no-untyped-def]
            trained.append((start, stop))
            value(None)
            return type("S", (), {"value": torch.zeros(())})()

    driver = Training(Counted())  # type: ignore[arg-type]
    ran: list[bool] = []

    def model(*_a):  # type: ignore[no-untyped-def]
        ran.append(torch.is_grad_enabled())
        return torch.zeros(())

    for chunk in [(0, 2), (0, 2), (2, 4), (0, 4), (0, 4)]:  # a rerun, then a probe's pass
        told = driver.begin(*chunk)
        assert told == (chunk != (2, 4))  # rows 2:4 hold no compared sample
        with torch.no_grad():
            driver.run(model, (), {}, None)  # type: ignore[arg-type]
    assert trained == [(0, 2), (2, 4), (0, 4)]
    assert ran == [True] * 5  # autograd on in every pass, as in training
