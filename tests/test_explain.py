"""The explain stage: sources and carriers, local error, fp64 truth, noise, kernels."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import divtrace
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


@pytest.fixture
def chain() -> nn.Sequential:
    """clean, clean, clean, source (3), carriers, and a ×4 and a ×3 layer at the end."""
    return nn.Sequential(*models.variant_mlp(), models.Scale(4.0), models.Scale(3.0)).eval()


def test_roles_without_options(chain: nn.Sequential) -> None:
    result = run(chain, torch.randn(8, 16))
    table = result.table.set_index("site")
    assert list(table.loc[["0", "1", "2"], "role"]) == ["clean"] * 3
    assert table.loc["3", "role"] == "source"
    assert table.loc["3", "input_mismatch"] == 0
    assert list(table.loc[["4", "5", "6", "7"], "role"]) == ["carrier"] * 4
    assert (table.loc[["4", "5", "6", "7"], "input_mismatch"] > 0).all()
    assert table.loc["(model)", "role"] == ""  # not a leaf
    assert list(result.sources["site"]) == ["3"]
    assert "Source of divergence (input bit-identical in both runs, output not): '3'" in (
        result.summary())


def test_local_error_of_a_source_equals_its_divergence(chain: nn.Sequential) -> None:
    result = run(chain, torch.randn(8, 16), explain=["local"])
    table = result.table.set_index("site")
    assert table.loc["3", "local_rel_l2"] == table.loc["3", "rel_l2"]
    assert table.loc["3", "local_max_abs"] == table.loc["3", "max_abs"]
    assert table.loc["3", "local_status"] == "ok"
    assert math.isinf(table.loc["3", "amplification"])  # error out of nothing


def test_carriers_add_no_local_error(chain: nn.Sequential) -> None:
    result = run(chain, torch.randn(8, 16), explain=["local"])
    table = result.table.set_index("site")
    for site in ("4", "5", "6", "7"):  # Hardtanh, batch-invariant OrderedLinear, Scales
        assert table.loc[site, "local_rel_l2"] == 0
        assert table.loc[site, "local_max_abs"] == 0
    assert "1 layer adds error of its own (local rel_l2): '3' (OrderedLinear)" in (
        result.summary())
    assert "4 divergent layers add none" in result.summary()
    assert table["adds_error"].dtype == "boolean"
    assert table.loc["3", "adds_error"] == True  # noqa: E712
    assert (table.loc[["4", "5", "6", "7"], "adds_error"] == False).all()  # noqa: E712


def test_scaling_by_k_amplifies_error_by_k(chain: nn.Sequential) -> None:
    table = run(chain, torch.randn(8, 16), explain=["local"]).table.set_index("site")
    assert table.loc["6", "amplification"] == 4.0  # a power of two: exact
    # ×3 rounds in both runs, and the error is a few units in the last place
    assert table.loc["7", "amplification"] == pytest.approx(3.0, rel=0.1)
    assert table.loc["6", "growth"] == 1.0  # the relative error is unchanged


def test_local_replay_leaves_the_table_and_the_model_alone(chain: nn.Sequential) -> None:
    calls: list[int] = []
    handle = chain[3].register_forward_hook(lambda m, a, o: calls.append(o.shape[0]))
    try:
        plain = run(chain, torch.randn(8, 16), explain=["-independence", "-precision"])
        replayed = run(chain, torch.randn(8, 16), explain=["-independence", "-precision", "local"])
    finally:
        handle.remove()
    assert list(plain.table["site"]) == list(replayed.table["site"])
    # 8 split passes + 1 batched, twice, and one replay of module 3 in the second run
    assert calls.count(8) == 3
    assert all(h == 0 for m in chain.modules() for h in (len(m._forward_hooks),))


def test_replay_is_skipped_where_asked_or_in_train_mode(chain: nn.Sequential) -> None:
    chain[5].train()  # no BatchNorm or Dropout: compare() allows it, replay does not
    try:
        result = run(chain, torch.randn(8, 16), explain=[divtrace.Local(skip=["3"])])
    finally:
        chain[5].eval()
    table = result.table.set_index("site")
    assert table.loc["3", "local_status"] == "skipped"
    assert math.isnan(table.loc["3", "local_rel_l2"])
    assert table.loc["5", "local_status"] == "train_mode"
    assert table.loc["4", "local_status"] == "ok"


def test_an_input_made_by_a_functional_op_is_measured() -> None:
    result = run(models.FunctionalBetween().eval(), torch.randn(6, 16), explain=["local"])
    table = result.table.set_index("site")
    assert table.loc["first", "role"] == "source"
    assert table.loc["second", "role"] == "carrier"
    assert table.loc["second", "input_mismatch"] > 0  # measured on the recorded input
    assert table.loc["second", "local_rel_l2"] == 0


def test_an_input_changed_in_place_unseen_is_unknown() -> None:
    result = run(models.InplaceOnFunctional().eval(), torch.randn(6, 16))
    table = result.table.set_index("site")
    assert table.loc["first", "role"] == "source"
    assert table.loc["act", "role"] == "unknown"
    assert math.isnan(table.loc["act", "input_mismatch"])
    assert "the role is unknown" in result.summary()


def test_repeat_reports_no_noise_for_a_deterministic_model(chain: nn.Sequential) -> None:
    result = run(chain, torch.randn(8, 16), explain=[divtrace.Repeat(2)])
    ok = result.table[result.table["status"] == "ok"]
    assert (ok["noise_mismatch"] == 0).all()
    assert (ok["noise_rel_l2"] == 0).all()
    assert "gave bit-identical results" in result.summary()


def test_repeat_finds_run_to_run_noise() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16), models.Noisy(), nn.ReLU()).eval()
    result = run(model, torch.randn(6, 16), explain=[divtrace.Repeat(1)])
    table = result.table.set_index("site")
    assert table.loc["0", "noise_mismatch"] == 0
    assert table.loc["1", "noise_mismatch"] > 0.9
    assert table.loc["1", "noise_rel_l2"] > 0
    assert "not deterministic" in result.summary()


def test_fp64_truth(chain: nn.Sequential) -> None:
    result = run(chain, torch.randn(8, 16), explain=["fp64"])
    table = result.table.set_index("site")
    for column in ("b_err_fp64", "a_err_fp64"):
        assert (table[column] > 0).all()  # float32 vs float64: rounding everywhere
        assert (table[column] < 1e-5).all()
    # before the source both runs are the same numbers, so equally far from the truth
    assert table.loc["2", "b_err_fp64"] == table.loc["2", "a_err_fp64"]
    assert table.loc["3", "b_err_fp64"] != table.loc["3", "a_err_fp64"]
    assert "neither run is clearly closer to the exact answer" in result.summary()
    assert next(chain.parameters()).dtype == torch.float32  # the user's model untouched


def test_fp64_truth_spots_the_wrong_run() -> None:
    class Sloppy(nn.Module):  # rounds to bfloat16 in the batched run only
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 1 and x.dtype == torch.float32:
                return x.bfloat16().float()
            return x

    model = nn.Sequential(models.OrderedLinear(16, 16), Sloppy()).eval()
    result = run(model, torch.randn(6, 16), explain=["fp64"])
    assert "the batched run is" in result.summary()
    assert "further from it than the split run" in result.summary()


def test_kernels_on_the_cpu_name_the_ops() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16), models.SwitchOp(16, 8)).eval()
    result = run(model, torch.randn(6, 16), explain=["kernels"])
    table = result.table.set_index("site")
    assert "aten::mul" in table.loc["0", "kernels_b"]
    assert not table.loc["0", "kernels_differ"]
    assert "aten::mm" in table.loc["1", "kernels_b"]
    assert "aten::mm" not in table.loc["1", "kernels_a"]
    assert table.loc["1", "kernels_differ"]
    assert table.loc["1", "role"] == "source"
    assert "'1' (SwitchOp): the batched run launched GEMM (mm), where the split run launched" in (
        result.summary())


def test_option_columns_only_with_their_option(chain: nn.Sequential) -> None:
    plain = run(chain, torch.randn(4, 16)).table
    assert tuple(plain.columns) == divtrace.COLUMNS
    full = run(chain, torch.randn(4, 16), explain=["local", "fp64", divtrace.Repeat(1)]).table
    extra = [c for c in full.columns if c not in divtrace.COLUMNS]
    expected = [*divtrace.EXPLAIN_COLUMNS["local"], *divtrace.EXPLAIN_COLUMNS["fp64"],
                *divtrace.EXPLAIN_COLUMNS["repeat"]]
    assert extra == expected


@pytest.mark.parametrize(("option", "message"), [
    ({"explain": ["fp32"]}, "explain= has no probe 'fp32'; the probes are independence, "
     "precision, local, fp64"),
    ({"explain": ["-local"]}, "turns off a default probe, but 'local' runs only when named"),
    ({"explain": ["local", divtrace.Local()]}, "explain= names 'local' twice"),
    ({"explain": ["-independence", "independence"]}, "names 'independence' twice"),
])
def test_bad_explain(chain: nn.Sequential, option: dict, message: str) -> None:
    with pytest.raises(divtrace.DivtraceValueError, match=message):
        run(chain, torch.randn(4, 16), **option)
    with pytest.raises(divtrace.DivtraceValueError, match="whole number >= 1; got -1"):
        divtrace.Repeat(-1)
    with pytest.raises(divtrace.DivtraceTypeError, match=r"Observer\(always=...\) must be True"):
        divtrace.Observer("yes")  # type: ignore[arg-type]


def test_plots_show_local_error_fp64_and_sources(chain: nn.Sequential) -> None:
    import matplotlib.pyplot as plt

    result = run(chain, torch.randn(8, 16), explain=["local", "fp64", "kernels"])
    fig, (top, bottom) = plt.subplots(2, 1)
    try:
        result.plot(ax=top)
        labels = [t.get_text() for t in top.get_legend().get_texts()]
        assert "local (replayed on identical input)" in labels
        assert "adds error of its own" in labels
        assert {"batched run vs float64", "split run vs float64"} <= set(labels)
        assert result.plot_sources(ax=bottom) is bottom
        ticks = [t.get_text() for t in bottom.get_yticklabels()]
        assert len(ticks) == 1
        assert ticks[0].startswith("3 (OrderedLinear)\nbatched run:")
    finally:
        plt.close(fig)


def test_the_snowball_takes_layers_not_replayed(chain: nn.Sequential) -> None:
    import matplotlib.pyplot as plt

    result = run(chain, torch.randn(8, 16), explain=[divtrace.Local(skip=["4"])])
    adds = result.table["adds_error"]
    assert adds.isna().any()
    assert (adds == True).any()  # noqa: E712
    fig, ax = plt.subplots()
    try:
        result.plot(ax=ax)
        assert ax.get_ylabel() == "rel_l2 (batched vs split)"
        circles = [c for c in ax.collections if c.get_label() == "adds error of its own"]
        assert len(circles[0].get_offsets()) == int(
            ((adds == True) & (result.table["rel_l2"] > 0) & result.table["leaf"]).sum())  # noqa: E712
    finally:
        plt.close(fig)


def test_the_model_input_is_not_recorded_again(chain: nn.Sequential) -> None:
    result = run(chain, torch.randn(8, 16))
    table = result.table
    # the split run keeps the output rows of every site and nothing else: the model's
    # own input is the same rows in both runs, so the first layer's input is not copied;
    # the model hands on its last layer's output as it is, so the two share their rows
    assert table["site"].iloc[-1] == "(model)"
    assert result.meta.stored_bytes == int(table["numel"].iloc[:-1].sum()) * 4
    assert table.set_index("site").loc["0", "input_mismatch"] == 0


def test_fp64_truth_with_inplace_ops() -> None:
    result = run(models.inplace_relu_model(), torch.randn(6, 16), explain=["fp64"])
    table = result.table
    assert (table["b_err_fp64"] < 1e-5).all()
    assert (table["a_err_fp64"] < 1e-5).all()


def test_a_module_passing_its_input_through_is_a_carrier() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16, variant_from=2), nn.Dropout(0.5),
                          nn.Identity()).eval()
    table = run(model, torch.randn(6, 16), explain=["local"]).table.set_index("site")
    assert list(table.loc[["0", "1", "2"], "role"]) == ["source", "carrier", "carrier"]
    assert table.loc["1", "local_rel_l2"] == 0


def test_kernel_families_are_short() -> None:
    from divtrace.explain.profiling import kernel_family

    assert kernel_family("void DSE::regular_fft_pad<0, 1, 128>(float2*, float*)") == "FFT"
    assert kernel_family("sm80_xmma_fprop_implicit_gemm_f32f32_tilesize256x64x8") == (
        "implicit GEMM")
    assert kernel_family("void at::native::elementwise_kernel<128, 2>(int, float)") == (
        "elementwise_kernel")
    assert kernel_family("aten::mkldnn_convolution") == "oneDNN convolution"
    # a family that names no algorithm keeps the kernel's own name: two runs read apart
    assert kernel_family("aten::_slow_conv2d_forward") == (
        "convolution (_slow_conv2d_forward)")
    assert kernel_family("aten::addmm") != kernel_family("aten::mm")
    # inductor's Triton kernels: the reduction strategy it chose, and the kernel
    assert kernel_family("triton_per_fused__softmax_0") == (
        "persistent reduction (triton_per_fused__softmax_0)")
    assert kernel_family("triton_red_fused__softmax_0") == (
        "looped reduction (triton_red_fused__softmax_0)")
    assert kernel_family("triton_poi_fused_add_0").startswith("pointwise")


@pytest.mark.slow
def test_kernels_on_the_cpu_print_no_profiler_noise() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch, divtrace\n"
            "divtrace.compare(torch.nn.Linear(3, 3), torch.randn(4, 3), explain=['kernels'],\n"
            "                 progress=False)\n"
            "print('done')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"
    assert "gpuGetDeviceCount" not in done.stderr
    assert "USDT" not in done.stderr
