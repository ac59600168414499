"""Op-level sites (``compare(..., ops=True)``): every tensor-producing ATen op a site."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import divtrace
from tests import models

ROWS = ["site", "module", "module_type", "call", "path", "leaf", "status", "shape", "dtype",
        "numel", "mismatch", "max_abs", "rel_l2", "growth", "input_mismatch", "role"]


def ops_of(result: divtrace.Comparison) -> pd.DataFrame:
    table = result.table
    return table[table["op"] != ""].set_index("site")


def test_a_functional_linear_is_the_op_level_source() -> None:
    torch.manual_seed(0)
    model, x = models.FunctionalLinear().eval(), torch.randn(8, 256)
    with torch.no_grad():
        h = torch.tanh(x * 0.5 + 0.25)
        batched = nn.functional.linear(h, model.weight)
        alone = torch.cat([nn.functional.linear(h[i:i + 1], model.weight) for i in range(8)])
    assert not torch.equal(batched, alone), "this CPU's BLAS is batch-invariant here"
    result = divtrace.compare(model, x, ops=True, progress=False)
    ops = ops_of(result)
    assert list(ops.index) == ["(model):aten.mul", "(model):aten.add", "(model):aten.tanh",
                               "(model):aten.mm", "(model):aten.add#1"]
    assert (ops.loc[["(model):aten.mul", "(model):aten.add", "(model):aten.tanh"],
                    "role"] == "clean").all()
    mm = ops.loc["(model):aten.mm"]
    assert mm["op"] == "aten.mm.default"
    assert mm["scope"] == "(model)"
    assert mm["role"] == "source"
    assert mm["input_mismatch"] == 0
    assert mm["mismatch"] == (batched != alone).double().mean().item()
    assert ops.loc["(model):aten.add#1", "role"] == "carrier"
    sources = result.sources
    assert list(sources[sources["op"] != ""]["site"]) == ["(model):aten.mm"]
    assert "aten.mm" in result.summary()
    assert "(model)" in result.summary()
    assert _get_current_dispatch_mode() is None


def test_module_rows_are_the_same_with_ops() -> None:
    torch.manual_seed(1)
    for model, x in ((models.variant_mlp(), torch.randn(6, 16)),
                     (models.inplace_relu_model(), torch.randn(6, 16)),
                     (models.FunctionalBetween().eval(), torch.randn(6, 16)),
                     (models.InplaceOnFunctional().eval(), torch.randn(6, 16))):
        plain = divtrace.compare(model, x, progress=False).table
        with_ops = divtrace.compare(model, x, ops=True, progress=False).table
        modules = with_ops[with_ops["op"] == ""].reset_index(drop=True)
        pd.testing.assert_frame_equal(modules[ROWS], plain[ROWS])
        assert len(with_ops) > len(plain)


def test_in_place_ops_are_measured_after_they_ran() -> None:
    torch.manual_seed(2)
    x = torch.randn(5, 7)
    given = x.clone()
    # a split run that differs only by a scale: b=a*(1+eps) makes mul's output differ
    result = divtrace.compare(models.InplaceOps(), x, ops=True, progress=False,
                              resources=divtrace.Resources(keep=True))
    ops = ops_of(result)
    assert list(ops.index) == ["(model):aten.mul", "(model):aten.add_", "(model):aten.relu_"]
    assert ops["status"].eq("ok").all()
    assert ops["role"].eq("clean").all()
    _split, batched = result.pair("(model):aten.mul")
    torch.testing.assert_close(batched, x * 3.0, rtol=0, atol=0)  # before add_ changed it
    _, batched = result.pair("(model):aten.add_")
    torch.testing.assert_close(batched, x * 3.0 + 1.0, rtol=0, atol=0)
    assert torch.equal(x, given)


def test_an_op_in_one_run_only_is_reported_and_aligned_around() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(models.SwitchOp(), nn.Tanh()).eval()
    result = divtrace.compare(model, torch.randn(6, 16), ops=True, progress=False)
    ops = ops_of(result)
    assert ops.loc["0:aten.mm", "status"] == "missing_in_split"
    assert ops.loc["0:aten.mul", "status"] == "missing_in_batched"
    assert ops.loc["0:aten.sum", "status"] == "missing_in_batched"
    assert ops.loc["1:aten.tanh", "status"] == "ok"
    table = result.table
    assert list(table["site"]).index("0:aten.mul") < list(table["site"]).index("0")
    assert "control flow" not in result.summary()


def test_sdpa_is_one_op_site() -> None:
    torch.manual_seed(4)
    model, x = models.Attention().eval(), torch.randn(4, 6, 32)
    result = divtrace.compare(model, x, ops=True, progress=False,
                              resources=divtrace.Resources(keep=True))
    ops = ops_of(result)
    sdpa = [s for s in ops.index if "scaled_dot_product" in s]
    assert sdpa
    assert sdpa[0].startswith("(model):aten._scaled_dot_product")
    row = ops.loc[sdpa[0]]
    assert row["status"] == "ok"
    assert row["shape"] == "(4, 4, 6, 8)"
    with torch.no_grad():
        q, k, v = model.qkv(x).view(4, 6, 3, 4, 8).permute(2, 0, 3, 1, 4)
        expected = nn.functional.scaled_dot_product_attention(q, k, v)
    _, batched = result.pair(sdpa[0])
    torch.testing.assert_close(batched, expected, rtol=0, atol=0)


def test_modules_picks_the_scopes_of_op_sites() -> None:
    model, x = models.Attention().eval(), torch.randn(4, 6, 32)
    result = divtrace.compare(model, x, ops=True, modules="qkv", progress=False)
    ops = ops_of(result)
    assert set(ops["scope"]) == {"qkv"}
    assert list(result.table["site"]) == ["qkv:aten.addmm", "qkv", "(model)"]


def test_ops_only_puts_no_hook_inside_the_model() -> None:
    class Checked(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert not self._forward_hooks
            assert not self._forward_pre_hooks
            return super().forward(x)

    model = nn.Sequential(Checked(8, 8), nn.ReLU()).eval()
    result = divtrace.compare(model, torch.randn(3, 8), ops="only", progress=False)
    assert list(result.table["site"]) == ["0:aten.addmm", "1:aten.relu", "(model)"]


def test_local_replays_single_ops() -> None:
    torch.manual_seed(5)
    model, x = models.FunctionalLinear().eval(), torch.randn(8, 256)
    result = divtrace.compare(model, x, ops=True, explain=["local"], progress=False)
    ops = ops_of(result)
    assert ops["local_status"].eq("ok").all()
    assert ops.loc["(model):aten.mm", "adds_error"] == True  # noqa: E712
    assert ops.loc["(model):aten.mm", "local_rel_l2"] == ops.loc["(model):aten.mm", "rel_l2"]
    # the residual add gets the split run's inputs: it adds nothing of its own
    assert ops.loc["(model):aten.add#1", "adds_error"] == False  # noqa: E712
    attention = divtrace.compare(models.Attention().eval(), torch.randn(4, 6, 32), ops=True,
                                 explain=["local"], progress=False)
    assert ops_of(attention)["local_status"].eq("ok").all()


def test_kernels_name_each_op() -> None:
    model, x = models.FunctionalLinear().eval(), torch.randn(4, 256)
    result = divtrace.compare(model, x, ops=True, explain=["kernels"], progress=False)
    ops = ops_of(result)
    assert "aten::mm" in ops.loc["(model):aten.mm", "kernels_b"]
    assert "aten::tanh" in ops.loc["(model):aten.tanh", "kernels_a"]


def test_two_chunked_runs_compare_op_sites() -> None:
    torch.manual_seed(6)
    model, x = models.Attention().eval(), torch.randn(6, 5, 32)
    result = divtrace.compare(model, x, ops=True, a=divtrace.Run(chunk=2),
                              b=divtrace.Run(chunk=3), progress=False)
    ops = ops_of(result)
    assert len(ops) == 4
    assert ops["status"].eq("ok").all()
    plain = divtrace.compare(model, x, ops=True, a=divtrace.Run(chunk=2), progress=False)
    assert list(ops_of(plain).index) == list(ops.index)


def test_bad_ops_values_are_refused() -> None:
    model, x = nn.Linear(4, 4), torch.randn(3, 4)
    with pytest.raises(divtrace.DivtraceValueError, match="ops must be False, True"):
        divtrace.compare(model, x, ops="yes", progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="compiled run"):
        divtrace.compare(model, x, ops=True, b=divtrace.Run(compile=True), progress=False)


def test_an_error_inside_leaves_no_mode_behind() -> None:
    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x * 2
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        divtrace.compare(Failing(), torch.randn(2, 3), ops=True, progress=False)
    assert any("(model):aten.mul" in note for note in info.value.__notes__)
    assert _get_current_dispatch_mode() is None
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_overloads_of_one_op_count_together() -> None:
    class TwoMuls(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.mul.Scalar(x * x, 2.0)

    result = divtrace.compare(TwoMuls(), torch.randn(4, 3), ops=True, progress=False)
    ops = ops_of(result)
    assert list(ops.index) == ["(model):aten.mul", "(model):aten.mul#1"]
    assert list(ops["op"]) == ["aten.mul.Tensor", "aten.mul.Scalar"]
    assert ops["status"].eq("ok").all()


def test_a_write_through_an_alias_does_not_change_what_was_recorded() -> None:
    class WritesThroughAlias(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2.0
            h.data.add_(1.0)  # an alias with a version counter of its own
            return h * 1.0

    x = torch.randn(6, 5)
    result = divtrace.compare(WritesThroughAlias(), x, ops=True,
                              resources=divtrace.Resources(keep=True), progress=False)
    ops = ops_of(result)
    assert ops.loc["(model):aten.mul", "mismatch"] == 0
    split, batched = result.pair("(model):aten.mul")
    torch.testing.assert_close(split, x * 2.0, rtol=0, atol=0)
    torch.testing.assert_close(batched, x * 2.0, rtol=0, atol=0)


def test_an_op_with_empty_outputs_is_measured() -> None:
    # in eval mode native_batch_norm returns empty saved statistics beside its output
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    result = divtrace.compare(model, torch.rand(4, 3, 8, 8), ops=True, progress=False)
    table = result.table.set_index("site")
    empty = table[table["numel"] == 0]
    assert not empty.empty
    assert (empty["status"] == "ok").all()
    assert (empty["mismatch"] == 0).all()
    assert table.loc["1:aten.native_batch_norm/0", "numel"] == 4 * 4 * 6 * 6


def test_a_tensor_at_a_freed_tensors_address_is_not_taken_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a tensor made unseen (torch.tensor([]) in a KV cache) can take the address of a
    # freed one: every tensor at "one address" here, and still nothing is mistaken
    from divtrace.record import oplineage

    monkeypatch.setattr(oplineage, "impl", lambda tensor: 1)
    tracker = oplineage.OpTracker()
    made = torch.ones(3)
    tracker.note("layer:aten.mm", made)
    assert tracker.maker(made) == "layer:aten.mm"
    assert tracker.maker(torch.zeros(3)) is None


def test_op_lineage_is_the_same_run_after_run() -> None:
    pytest.importorskip("transformers")
    model = models.tiny_llama()
    ids = torch.randint(3, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    tables = [divtrace.compare(model, {"input_ids": ids}, ops=True, progress=False).table
              for _ in range(4)]
    for table in tables[1:]:
        assert table.equals(tables[0])
