"""Two run configurations, and sweeps over settings and batch sizes."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch import nn

import divtrace
from divtrace import Run
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


def flags() -> tuple[object, ...]:
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    return (cudnn.enabled, cudnn.deterministic, cudnn.benchmark, matmul.allow_tf32,
            cudnn.allow_tf32, torch.get_float32_matmul_precision())


def test_float32_against_float64() -> None:
    model = models.variant_mlp()
    result = run(model, torch.randn(6, 16), a=Run(), b=Run(dtype=torch.float64))
    table = result.table.set_index("site")
    assert (table["status"] == "ok").all()
    assert (table["dtype"] == "float64").all()  # run b's outputs
    assert (table["rel_l2"] < 1e-6).all()
    assert (table["rel_l2"] > 0).all()  # float32 rounding shows against float64
    assert next(model.parameters()).dtype == torch.float32  # the user's model untouched
    assert result.meta.runs == ("as is", "dtype=float64")
    assert result.summary().splitlines()[1].startswith(
        "Run b (dtype=float64) vs run a (as is), B=6")
    assert result.verdict == "rounding"


def test_bfloat16_ulp_is_counted_in_bfloat16() -> None:
    result = run(nn.Identity(), torch.randn(6, 16), a=Run(), b=Run(dtype=torch.bfloat16))
    row = result.table.iloc[0]
    assert row["mismatch"] > 0.9  # float32 values are not their bfloat16 roundings ...
    assert row["max_ulp"] == 0  # ... but rounded to bfloat16 they are the same numbers
    assert 1e-4 < row["rel_l2"] < 1e-2


def test_channels_last() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    result = run(model, torch.randn(4, 3, 10, 10), a=Run(), b=Run(channels_last=True))
    table = result.table
    assert (table["status"] == "ok").all()
    assert (table["rel_l2"] < 1e-5).all()
    assert model[0].weight.is_contiguous()  # the user's model keeps its memory format


@pytest.mark.parametrize(("first", "second", "diverges"), [
    (1, 4, True),  # the variant order starts at 4 rows
    (2, 3, False),  # both below it
    (1, None, True),  # None: the whole batch of 6
])
def test_batch_size_pairs(first: int, second: int | None, diverges: bool) -> None:
    model = models.variant_mlp(variant_from=4)
    result = run(model, torch.randn(6, 16), a=Run(chunk=first), b=Run(chunk=second))
    assert (result.first_divergence is not None) is diverges
    if diverges:
        assert list(result.sources["site"]) == ["3"]


def test_flags_are_set_for_the_run_only() -> None:
    seen: list[tuple[bool, str]] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.backends.cudnn.deterministic,
                         torch.get_float32_matmul_precision()))
            return x

    before = flags()
    run(Spy(), torch.randn(4, 2), a=Run(deterministic=True, matmul_precision="medium"),
        b=Run(deterministic=False, matmul_precision="high"))
    # run a, run b, then run b again for the independence test
    assert seen[:2] == [(True, "medium"), (False, "high")]
    assert seen[2:]
    assert set(seen[2:]) == {(False, "high")}
    assert flags() == before


def test_flags_are_restored_after_an_exception() -> None:
    before = flags()
    with pytest.raises(KeyError, match="boom"):
        run(models.Exploding().eval(), torch.randn(4, 16),
            a=Run(chunk=2, cudnn=False, deterministic=True, benchmark=True),
            b=Run(tf32_matmul=True, tf32_cudnn=True, matmul_precision="medium"))
    assert flags() == before


def test_compiled_run_compares_the_output() -> None:
    model = models.variant_mlp(variant_from=100)
    result = run(model, torch.randn(4, 16), a=Run(), b=Run(compile="aot_eager"))
    table = result.table
    assert list(table["site"]) == ["(model)"]
    assert table.iloc[0]["status"] == "ok"
    assert table.iloc[0]["mismatch"] == 0


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"a": Run(chunk=4)}, divtrace.DivtraceValueError, "runs a and b are the same: as is, "
     "the B=4 rows in one pass; chunk=4 takes it whole"),
    ({"a": Run(tf32_matmul=True), "b": Run(tf32_matmul=True)}, divtrace.DivtraceValueError,
     "runs a and b are the same: tf32_matmul=True"),
    ({"a": "cpu"}, divtrace.DivtraceTypeError, "a must be a divtrace.Run"),
    ({"b": Run(chunk=2), "explain": ["local"]}, divtrace.DivtraceValueError, "whole batch"),
])
def test_bad_runs(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        run(models.variant_mlp(), torch.randn(4, 16), **kwargs)


def test_bad_run_settings() -> None:
    with pytest.raises(TypeError, match=r"floating torch\.dtype"):
        Run(dtype=torch.int32)
    with pytest.raises(ValueError, match="highest, high, medium"):
        Run(matmul_precision="fast")
    with pytest.raises(ValueError, match="None or a whole number >= 1"):
        Run(chunk=0)
    assert Run(chunk=1, dtype=torch.bfloat16).label() == "chunk=1, dtype=bfloat16"
    assert Run(name="mine", chunk=1).label() == "mine"


def test_sweep_over_a_settings_matrix() -> None:
    model = models.variant_mlp(variant_from=4)
    found = divtrace.sweep(model, torch.randn(6, 16),
                           {"chunk": [1, 2, None], "dtype": [torch.float64]},
                           a=Run(), progress=False)
    table = found.table.set_index("setting")
    assert list(table.index) == ["chunk=1, dtype=float64", "chunk=2, dtype=float64",
                                 "dtype=float64"]
    assert (table["output_rel_l2"] > 0).all()  # float64 against float32 everywhere
    assert set(found.comparisons) == set(table.index)
    exact = divtrace.sweep(model, torch.randn(6, 16), [Run(chunk=5), Run(chunk=2)],
                           a=Run(), progress=False).table.set_index("setting")
    assert exact.loc["chunk=2", "output_rel_l2"] > 0  # 6 rows (reversed) vs 2 (in order)
    assert exact.loc["chunk=5", "first_divergence"] == "3"
    assert exact.loc["chunk=5", "sources"] == 1
    with pytest.raises(divtrace.DivtraceValueError, match="not Run fields"):
        divtrace.sweep(model, torch.randn(6, 16), {"speed": [1]}, progress=False)


def test_sweep_of_batched_against_split_under_each_setting() -> None:
    model = models.variant_mlp(variant_from=4)
    x = torch.randn(6, 16)
    found = divtrace.sweep(model, x, [Run(name="float32"), Run(dtype=torch.float64)],
                           chunk=2, progress=False)
    table = found.table.set_index("setting")
    # batched (6 rows) against chunks of 2: the variant layer parts the runs either way
    assert list(table["first_divergence"]) == ["3", "3"]
    assert list(table["sources"]) == [1, 1]
    plain = divtrace.compare(model, x, a=divtrace.Run(chunk=2), progress=False)
    assert table.loc["float32", "output_rel_l2"] == plain.output["rel_l2"]
    below = divtrace.sweep(model, x, [Run(name="float32")], chunk=3, progress=False)
    assert below.table.iloc[0]["first_divergence"] == "3"  # 6 rows vs 3: still reversed
    assert found.comparisons["dtype=float64"].meta.runs == ("chunk=2, dtype=float64",
                                                              "dtype=float64")


def test_sweep_plot() -> None:
    import matplotlib.pyplot as plt

    found = divtrace.sweep(models.variant_mlp(variant_from=4), torch.randn(6, 16),
                           [Run(chunk=1), Run(chunk=3)], a=Run(), progress=False)
    fig, ax = plt.subplots()
    try:
        assert found.plot(ax=ax) is ax
        assert not ax.patches  # points, not bars on a log axis
        lane = next(a for a in fig.axes if a is not ax)
        assert [t.get_text() for t in lane.get_yticklabels()] == ["chunk=1", "chunk=3"]
        drawn = sum(len(c.get_offsets()) for a in (ax, lane) for c in a.collections)
        assert drawn == 2
    finally:
        plt.close(fig)


def test_batch_size_sweep_finds_where_each_site_starts() -> None:
    model = models.variant_mlp(variant_from=4)
    found = divtrace.sweep_batch(model, torch.randn(16, 16), progress=False)
    onset = found.onset.set_index("site")["diverges_from"]
    assert sorted(found.comparisons) == [2, 4, 8, 16]
    assert onset[["0", "1", "2"]].isna().all()
    assert (onset[["3", "4", "5", "(model)"]] == 4).all()
    assert set(found.table["batch_size"]) == {2, 4, 8, 16}


def test_batch_size_sweep_plot_and_errors() -> None:
    import matplotlib.pyplot as plt

    model = models.variant_mlp(variant_from=3)
    found = divtrace.sweep_batch(model, torch.randn(8, 16), sizes=[2, 3, 8], progress=False)
    fig, ax = plt.subplots()
    try:
        assert found.plot(ax=ax) is ax
        assert ax.get_images()[0].get_array().shape == (7, 3)  # sites × sizes
    finally:
        plt.close(fig)
    with pytest.raises(divtrace.DivtraceValueError, match="from 2 to B=8"):
        divtrace.sweep_batch(model, torch.randn(8, 16), sizes=[1, 9], progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="must lie in every swept batch"):
        divtrace.sweep_batch(model, torch.randn(8, 16), sizes=[2], samples=[3],
                             progress=False)


def test_default_comparison_is_unchanged() -> None:
    result = run(models.variant_mlp(), torch.randn(4, 16))
    assert result.meta.runs is None
    assert result.summary().splitlines()[1].startswith(
        "Batched run (B=4) vs split run (per sample)")
    assert math.isnan(result.table.set_index("site").loc["0", "growth"])


def test_run_a_in_chunks_is_still_batched_against_split() -> None:
    # a=Run(chunk=k) differs from run b in the batch size alone: said as batched vs split
    result = run(models.variant_mlp(variant_from=4), torch.randn(8, 16), a=Run(chunk=2))
    assert result.meta.runs is None
    assert result.meta.names == ("split run", "batched run")
    lines = result.summary().splitlines()
    assert lines[1].startswith("Batched run (B=8) vs split run (in chunks of 2)")
    assert "the batch size changes the order of operations" in lines[0]
    other = run(models.variant_mlp(variant_from=2), torch.randn(8, 16),
                a=Run(chunk=2, name="mine"))
    assert other.meta.runs == ("mine", "as is")
    assert other.meta.names == ("run a (mine)", "batched run")


class _Tied(nn.Module):
    """Tied weights, a buffer already float64, an integer buffer, a frozen parameter and a
    plain tensor attribute that is no buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.a.bias.requires_grad_(False)
        self.register_buffer("scale", torch.full((4,), 0.5, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(3))
        self.register_buffer("mean", torch.randn(4))
        self.constant = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.scale.float() + self.mean) + self.constant


def test_a_cast_copy_is_made_cast_and_is_what_deepcopy_then_to_makes() -> None:
    import copy

    torch.manual_seed(0)
    model = _Tied()
    before = {k: (v.clone(), v.data_ptr()) for k, v in model.state_dict().items()}
    mine = Run(dtype=torch.float64).model(model)
    theirs = copy.deepcopy(model).to(torch.float64)
    for (name, p), (_, q) in zip(mine.named_parameters(), theirs.named_parameters(),
                                 strict=True):
        assert type(p) is type(q), name
        assert p.dtype == q.dtype == torch.float64, name
        assert torch.equal(p, q), name
        assert p.requires_grad == q.requires_grad, name
    assert mine.b.weight is mine.a.weight  # tied still
    for (name, p), (_, q) in zip(mine.named_buffers(), theirs.named_buffers(), strict=True):
        assert p.dtype == q.dtype, name
        assert torch.equal(p, q), name
    assert mine.count.dtype == torch.int64
    assert mine.constant.dtype == torch.float32
    shared = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert not shared & {t.untyped_storage().data_ptr()
                         for t in (*mine.parameters(), *mine.buffers())}  # no aliasing
    for key, value in model.state_dict().items():  # the user's model untouched
        assert torch.equal(value, before[key][0])
        assert value.data_ptr() == before[key][1]
        assert value.dtype == before[key][0].dtype


class _Containers(nn.Module):
    """Empty containers of every kind as attributes, one empty list held by two modules,
    a filled dict and an OrderedDict subclass."""

    class Tagged(collections.OrderedDict):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.shared: list[int] = []
        self.inner.shared = self.shared
        self.empty_set: set[int] = set()
        self.table = {"k": [1, 2]}
        self.tagged = self.Tagged()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_cast_copy_owns_its_containers_as_deepcopy_makes_them() -> None:
    import copy

    model = _Containers()
    seen: list[str] = []
    model.inner.register_forward_hook(lambda *_: seen.append("user's hook"))
    mine = Run(dtype=torch.float64).model(model)
    theirs = copy.deepcopy(model).to(torch.float64)
    for a, b, given in zip(mine.modules(), theirs.modules(), model.modules(), strict=True):
        assert a.__dict__.keys() == b.__dict__.keys()
        for key, value in a.__dict__.items():
            assert type(value) is type(b.__dict__[key]), key
            if isinstance(value, dict | list | set):
                assert value is not given.__dict__[key], key  # a container of its own
                if key not in ("_parameters", "_buffers", "_modules"):
                    assert value == b.__dict__[key], key
    assert mine.inner.shared is mine.shared  # held twice, still one
    assert mine.table == {"k": [1, 2]}
    assert mine.table["k"] is not model.table["k"]
    mine.inner.register_forward_hook(lambda *_: seen.append("copy's hook"))
    mine.shared.append(1)
    model(torch.ones(1, 3))
    assert seen == ["user's hook"]  # the user's model as it was
    assert model.shared == []
    mine(torch.ones(1, 3, dtype=torch.float64))
    assert seen == ["user's hook", "user's hook", "copy's hook"]
