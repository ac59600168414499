"""Where divergence starts, and what the table says about every site."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import divtrace
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_first_divergence_is_the_batch_variant_module(chunk: int) -> None:
    result = run(models.variant_mlp(variant_from=4), torch.randn(8, 16),
                 a=divtrace.Run(chunk=chunk))
    table = result.table.set_index("site")
    first = result.first_divergence
    assert first is not None
    assert first["site"] == "3"
    assert first["module_type"] == "OrderedLinear"
    assert (table.loc[["0", "1", "2"], "mismatch"] == 0).all()
    assert (table.loc[["0", "1", "2"], "rel_l2"] == 0).all()
    assert (table.loc[["3", "4", "5", "(model)"], "mismatch"] > 0).all()
    assert (table.loc[["3", "4", "5", "(model)"], "rel_l2"] > 0).all()


def test_no_divergence_below_the_variant_threshold() -> None:
    # the split chunks (2) and the batch (3) both stay below variant_from=4
    result = run(models.variant_mlp(variant_from=4), torch.randn(3, 16), a=divtrace.Run(chunk=2))
    assert result.first_divergence is None
    assert (result.table["mismatch"] == 0).all()


@pytest.mark.parametrize("model", [models.elementwise_model(), nn.Identity(),
                                   nn.Sequential(models.OrderedLinear(16, 4))])
def test_elementwise_and_identity_models_never_diverge(model: nn.Module) -> None:
    result = run(model, torch.randn(6, 16) * 5)
    table = result.table
    assert (table["status"] == "ok").all()
    assert (table["mismatch"] == 0).all()
    assert (table["rel_l2"] == 0).all()
    assert (table["max_ulp"] == 0).all()
    assert (table["cosine"] == 1).all()
    assert result.first_divergence is None
    assert "bit-identical" in result.summary()


def test_table_columns_are_stable() -> None:
    result = run(models.variant_mlp(), torch.randn(4, 16))
    assert tuple(result.table.columns) == divtrace.COLUMNS
    assert list(result.per_sample.columns) == ["site", "sample", "mismatch", "rel_l2", "max_abs"]


def test_the_per_sample_table_is_the_same_made_early_or_late() -> None:
    # it is made when first asked for: through select() first, or on its own
    x = torch.randn(6, 16)
    late, early = (run(models.variant_mlp(), x, samples=[0, 3]) for _ in range(2))
    whole = early.per_sample
    leaves = late.select(leaf=True).per_sample
    assert len(whole) == 2 * len(early.table)
    assert 0 < len(leaves) < len(whole)
    assert leaves.equals(whole[whole["site"].isin(late.select(leaf=True).table["site"])]
                         .reset_index(drop=True))
    assert late.per_sample.equals(whole)


def test_figures_agree_with_a_direct_computation() -> None:
    model = models.variant_mlp()
    x = torch.randn(6, 16)
    result = run(model, x, a=divtrace.Run(chunk=1), resources=divtrace.Resources(keep=True),
                 samples=[1, 4])
    with torch.no_grad():
        batched = model(x)[[1, 4]]
        split = torch.cat([model(x[1:2]), model(x[4:5])])
    row = result.table.set_index("site").loc["(model)"]
    diff = (batched.double() - split.double())
    assert row["mismatch"] == pytest.approx((batched != split).float().mean().item())
    assert row["max_abs"] == pytest.approx(diff.abs().max().item(), rel=1e-6)
    assert row["mean_abs"] == pytest.approx(diff.abs().mean().item(), rel=1e-5)
    assert row["rel_l2"] == pytest.approx((diff.norm() / split.double().norm()).item(),
                                          rel=1e-4)
    assert row["numel"] == batched.numel()
    got_s, got_b = result.pair("(model)")
    torch.testing.assert_close(got_b, batched, rtol=0, atol=0)
    torch.testing.assert_close(got_s, split, rtol=0, atol=0)
    per_sample = result.per_sample.query("site == '(model)'").set_index("sample")
    for i, s in enumerate([1, 4]):
        expected = (diff[i].norm() / split[i].double().norm()).item()
        assert per_sample.loc[s, "rel_l2"] == pytest.approx(expected, rel=1e-4)


def test_growth_relates_to_the_preceding_divergent_leaf() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16, variant_from=2), models.Scale(1024.0),
                          models.Scale(3.0))
    result = run(model, torch.randn(4, 16))
    table = result.table.set_index("site")
    assert math.isnan(table.loc["0", "growth"])
    assert table.loc["1", "growth"] == 1.0  # scaling by a power of two is exact
    assert table.loc["2", "growth"] == pytest.approx(1.0, rel=0.1)  # rounding in both runs
    assert table.loc["(model)", "growth"] == 1.0


def test_inplace_relu_does_not_alter_the_recorded_site() -> None:
    result = run(models.inplace_relu_model(), torch.randn(6, 16),
                 resources=divtrace.Resources(keep=True))
    split, batched = result.pair("0")
    assert (batched < 0).any()
    assert (split < 0).any()
    after_s, after_b = result.pair("1")
    assert (after_b >= 0).all()
    assert (after_s >= 0).all()
    assert result.table.set_index("site").loc["0", "mismatch"] == 0


def test_an_inplace_op_seen_in_the_first_chunk_costs_no_pass() -> None:
    model = models.inplace_relu_model()
    passes: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: passes.append(a[0].shape[0]))
    x = torch.randn(6, 16)
    try:
        result = run(model, x, explain=["-independence", "-precision"],
                     resources=divtrace.Resources(keep=True))
    finally:
        handle.remove()
    # the first chunk copies every site at once and sees that ReLU(inplace=True) changes
    # sites 0 and 2 afterwards: the later chunks copy those at once too, the others
    # together at the end of the chunk; no pass runs twice
    assert passes == [1, 1, 1, 1, 1, 1, 6]
    split, _ = result.pair("0")
    with torch.no_grad():
        expected = torch.cat([model[0](x[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(split, expected, rtol=0, atol=0)  # negatives kept
    assert (split < 0).any()


class LateInPlace(nn.Module):
    """Changes the output of its layer in place only for batches whose rows all start
    with a positive number: an in-place op the first chunk does not show."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if bool((x[:, 0] > 0).all()):
            h.mul_(2.0)
        return h * 1.0


def test_an_inplace_op_found_late_reruns_that_chunk_once() -> None:
    torch.manual_seed(0)
    model = LateInPlace().eval()
    x = torch.randn(4, 4)
    x[:, 0] = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    passes: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: passes.append(a[0].shape[0]))
    try:
        result = run(model, x, explain=["-independence", "-precision"],
                     resources=divtrace.Resources(keep=True))
    finally:
        handle.remove()
    assert passes == [1, 1, 1, 1, 1, 4]  # the third chunk ran twice
    split, _ = result.pair("fc")
    with torch.no_grad():  # each row alone, as the split run made it, before mul_
        alone = torch.cat([model.fc(x[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(split, alone, rtol=0, atol=0)


def test_a_module_called_twice_gives_two_sites() -> None:
    result = run(models.ReusedActivation().eval(), torch.randn(6, 16))
    table = result.table.set_index("site")
    assert list(result.table["site"]) == ["fc1", "act", "fc2", "act#1", "(model)"]
    assert table.loc["act", "call"] == 0
    assert table.loc["act#1", "call"] == 1
    assert table.loc["act", "mismatch"] == 0
    assert table.loc["act#1", "mismatch"] > 0
    assert result.first_divergence["site"] == "fc2"


def test_nested_outputs_are_flattened_and_typed() -> None:
    result = run(models.MultiOutput().eval(), torch.randn(6, 16))
    table = result.table.set_index("site")
    assert list(table.index) == ["fc", "(model)/0/argmax", "(model)/0/positive",
                                 "(model)/0/h", "(model)/1/logits", "(model)/1/hidden"]
    assert table.loc["(model)/0/argmax", "dtype"] == "int64"
    assert table.loc["(model)/0/positive", "dtype"] == "bool"
    for key in ("(model)/0/argmax", "(model)/0/positive"):  # mismatch only
        assert table.loc[key, "status"] == "ok"
        assert not math.isnan(table.loc[key, "mismatch"])
        assert math.isnan(table.loc[key, "rel_l2"])
        assert math.isnan(table.loc[key, "max_ulp"])
    assert table.loc["(model)/1/logits", "path"] == "1/logits"
    assert table.loc["(model)/1/logits", "mismatch"] > 0


def test_integer_outputs_count_mismatches() -> None:
    class Rounds(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # batch-variant integers: the batch size leaks into the values
            return torch.full((x.shape[0], 3), x.shape[0], dtype=torch.int32)

    result = run(Rounds(), torch.randn(4, 2))
    row = result.table.iloc[0]
    assert row["mismatch"] == 1.0
    assert math.isnan(row["rel_l2"])


def test_keyword_and_tuple_inputs_slice_only_batched_tensors() -> None:
    model = models.KeywordModel().eval()
    x = torch.randn(6, 16)
    bias = torch.randn(())  # no batch dimension: passes through whole
    result = run(model, {"x": x, "bias": bias, "scale": 2.0}, samples=[0, 5],
                 resources=divtrace.Resources(keep=True))
    split, batched = result.pair("(model)")
    with torch.no_grad():
        expected = torch.cat([model(x[i:i + 1], bias=bias, scale=2.0) for i in (0, 5)])
    torch.testing.assert_close(split, expected, rtol=0, atol=0)
    assert batched.shape == (2, 8)

    class TwoArgs(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
            return a * k + b

    result = run(TwoArgs(), (torch.randn(5, 3), torch.randn(5, 3), 3))
    assert result.table.iloc[0]["mismatch"] == 0


def test_only_the_chunks_holding_compared_samples_run() -> None:
    model = models.variant_mlp()
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    try:
        result = run(model, torch.randn(10, 16), explain=["-independence"],
                     a=divtrace.Run(chunk=3), samples=[1, 7])
    finally:
        handle.remove()
    assert seen == [3, 3, 10]  # rows 0:3 and 6:9, then the batched run
    assert result.meta.a_passes == 2
    assert sorted(result.per_sample["sample"].unique()) == [1, 7]


def test_batch_dim_other_than_zero() -> None:
    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = models.OrderedLinear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [seq, batch, features]
            return self.fc(x.transpose(0, 1)).transpose(0, 1)

    result = run(SeqFirst(), torch.randn(5, 6, 4), batch_dim=1)
    table = result.table.set_index("site")
    assert table.loc["(model)", "status"] == "ok"
    assert table.loc["(model)", "mismatch"] == 0
    assert table.loc["(model)", "numel"] == 6 * 5 * 4
    # inside, the batch sits at dim 0, not batch_dim: reported, not guessed
    assert table.loc["fc", "status"] == "unbatched"


def test_modules_filter_by_glob_and_type() -> None:
    model = models.variant_mlp()
    by_glob = run(model, torch.randn(4, 16), modules=["[0-2]"])
    assert list(by_glob.table["site"]) == ["0", "1", "2", "(model)"]
    by_type = run(model, torch.randn(4, 16), modules=nn.Hardtanh)
    assert list(by_type.table["site"]) == ["1", "4", "(model)"]


def test_site_present_in_one_run_only_is_reported() -> None:
    result = run(models.BranchOnBatch().eval(), torch.randn(6, 16))
    table = result.table.set_index("site")
    assert table.loc["extra", "status"] == "missing_in_split"
    assert math.isnan(table.loc["extra", "rel_l2"])
    assert "missing_in_split" in result.summary()

    class OnlySmall(models.BranchOnBatch):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return self.extra(h) if x.shape[0] < 4 else h

    result = run(OnlySmall().eval(), torch.randn(6, 16))
    assert list(result.table["site"]) == ["fc", "extra", "(model)"]
    assert result.table.set_index("site").loc["extra", "status"] == "missing_in_batched"


def test_nonfinite_inputs_are_counted_not_fatal() -> None:
    x = torch.randn(6, 16)
    x[1, 3] = float("nan")
    x[4, 0] = float("inf")
    result = run(models.elementwise_model(), x)
    table = result.table.set_index("site")
    assert table.loc["0", "nonfinite"] == 2  # Identity: NaN and inf in both runs
    assert table.loc["0", "mismatch"] == 0  # NaN vs NaN and inf vs inf are not divergence
    assert table.loc["0", "exceed"] > 0  # but NaN is never "close", as torch.isclose says
    assert table.loc["0", "rel_l2"] == 0
    assert "Non-finite" in result.summary()


def test_first_exceeding_defaults_and_custom_tolerances() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16, variant_from=2),
                          models.Scale(1e7), models.Scale(1e-7))
    result = run(model, torch.randn(6, 16), resources=divtrace.Resources(keep=True))
    # the rounding difference is about 1e-7 relative: within assert_close's float32
    # default at site 0, far beyond its atol once scaled by 1e7 at site 1
    assert result.first_divergence["site"] == "0"
    assert result.first_exceeding()["site"] == "1"
    assert result.first_exceeding(rtol=0.0, atol=0.0)["site"] == "0"
    assert result.first_exceeding(rtol=1.0, atol=1.0) is None
    strict = run(model, torch.randn(6, 16), rtol=0.0, atol=0.0)
    assert strict.first_exceeding()["site"] == "0"
    with pytest.raises(divtrace.DivtraceValueError, match="keep=True"):
        strict.first_exceeding(rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("samples", [None, [1, 4]])
def test_split_rows_are_released_as_soon_as_measured(
        samples: list[int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    from divtrace.measure import meter

    # small sites wait in a queue, their rows with them, until it holds its budget of
    # bytes: here one byte, so that it is measured (and lets go) after every site
    monkeypatch.setattr(meter, "budget_for", lambda *args, **kwargs: 1)

    model = models.variant_mlp()
    alive: list[bool] = []
    watched: list[weakref.ref] = []

    def watch(module: nn.Module, args: object, output: torch.Tensor) -> None:
        if output.shape[0] == 6:  # the batched run: site 0 was measured just before
            alive.append(watched[0]() is not None)

    from divtrace.record import rows as rows_module

    original = rows_module.RowStore._first

    def first(self, site, tensor, row_shape, *args):  # type: ignore[no-untyped-def]
        ref = original(self, site, tensor, row_shape, *args)
        if site.key == "0":
            watched.append(weakref.ref(ref.rows))
        return ref

    handle = model[1].register_forward_hook(watch)
    rows_module.RowStore._first = first  # type: ignore[method-assign]
    try:
        run(model, torch.randn(6, 16), samples=samples)
    finally:
        rows_module.RowStore._first = original  # type: ignore[method-assign]
        handle.remove()
    # site 0's split rows were freed before site 1 ran (in the batched run, and in the
    # independence test's passes after it)
    assert alive
    assert not any(alive)


def test_offload_gives_the_same_table() -> None:
    x = torch.randn(6, 16)
    a = run(models.variant_mlp(), x).table
    b = run(models.variant_mlp(), x, resources=divtrace.Resources(offload=True)).table
    assert a.equals(b)


def test_results_are_immutable() -> None:
    result = run(models.variant_mlp(), torch.randn(4, 16))
    table = result.table
    table.loc[0, "mismatch"] = 99.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.meta.batch_size = 3  # type: ignore[misc]
    result.meta.to_dict()["samples"].append(100)
    assert result.table.loc[0, "mismatch"] == 0
    assert 100 not in result.meta.samples
    leaves = result.select(leaf=True)
    assert "(model)" not in set(leaves.table["site"])
    assert "(model)" in set(result.table["site"])
