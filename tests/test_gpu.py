"""Behaviour on a CUDA device (skipped without one)."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch
from torch import nn

import divtrace
from divtrace.explain.held import groups
from divtrace.measure.stats import block_stats
from tests import models

pytestmark = pytest.mark.cuda


@pytest.fixture
def vgg_features() -> nn.Module:
    from torchvision.models import vgg11

    return vgg11().features.eval().cuda()


def test_observer_check_on_cuda(vgg_features: nn.Module) -> None:
    x = torch.rand(16, 3, 64, 64, device="cuda")
    with torch.no_grad():
        plain = vgg_features(x)
    captured: list[torch.Tensor] = []
    handle = vgg_features.register_forward_hook(lambda m, a, o: captured.append(o.clone()))
    try:
        divtrace.compare(vgg_features, x, a=divtrace.Run(chunk=2), samples=[0, 1], progress=False)
    finally:
        handle.remove()
    batched = [t for t in captured if t.shape[0] == 16]
    torch.testing.assert_close(batched[0], plain, rtol=0, atol=0)


def test_split_rows_are_what_a_chunked_loop_gives(vgg_features: nn.Module) -> None:
    x = torch.rand(16, 3, 64, 64, device="cuda")
    result = divtrace.compare(vgg_features, x, a=divtrace.Run(chunk=2),
                              resources=divtrace.Resources(keep=True), samples=[0, 1, 5],
                              progress=False)
    with torch.no_grad():
        split = torch.cat([vgg_features(x[0:2]), vgg_features(x[4:6])[1:]])
        batched = vgg_features(x)[[0, 1, 5]]
    got_split, got_batched = result.pair("(model)")
    torch.testing.assert_close(got_split, split, rtol=0, atol=0)
    torch.testing.assert_close(got_batched, batched, rtol=0, atol=0)
    row = result.table.set_index("site").loc["(model)"]
    assert row["mismatch"] == pytest.approx((batched != split).float().mean().item())


def _sync_warnings(model: nn.Module, x: torch.Tensor, graphs: bool,
                   independence: bool = False, precision: bool = False) -> int:
    explain = [*([] if independence else ["-independence"]),
               *([] if precision else ["-precision"])]
    resources = divtrace.Resources(graphs=graphs)
    divtrace.compare(model, x, explain=explain, resources=resources, progress=False)  # warm-up
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            divtrace.compare(model, x, explain=explain, resources=resources, progress=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("graphs", [False, True])
def test_host_synchronisations_do_not_grow_with_depth(graphs: bool) -> None:
    x = torch.randn(8, 16, device="cuda")
    shallow = nn.Sequential(nn.Linear(16, 16)).cuda().eval()
    deep = nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)]).cuda().eval()
    few, many = _sync_warnings(shallow, x, graphs), _sync_warnings(deep, x, graphs)
    assert few == many
    assert many <= 3 + graphs  # the graph's check against the eager pass waits once
    # the independence test adds a few (its replaced input, its one fetch), never one per
    # site
    tested = (_sync_warnings(shallow, x, graphs, True), _sync_warnings(deep, x, graphs, True))
    assert tested[0] == tested[1]
    passes = len(groups(list(range(8))))  # the held groups: 5
    assert tested[0] <= many + 2 * passes + 1
    # the precision test too: whether the runs differ (one wait), its one fetch
    both = (_sync_warnings(shallow, x, graphs, True, True),
            _sync_warnings(deep, x, graphs, True, True))
    assert both[0] == both[1]
    assert both[0] <= tested[0] + 4


def test_offload_gives_the_same_table_on_cuda() -> None:
    model = models.variant_mlp().cuda()
    x = torch.randn(8, 16, device="cuda")
    on_device = divtrace.compare(model, x, progress=False).table
    offloaded = divtrace.compare(model, x, resources=divtrace.Resources(offload=True),
                                 progress=False).table
    assert on_device.equals(offloaded)
    assert on_device.set_index("site").loc["3", "mismatch"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cuda_statistics_match_the_cpu_path(dtype: torch.dtype) -> None:
    b = torch.randn(4, 5000, dtype=torch.float64)
    r = b + torch.randn_like(b) * 1e-3
    b[0, 0], r[0, 0] = 0.0, -0.0
    b[1, :10] = -r[1, :10]  # opposite signs
    b, r = b.to(dtype), r.to(dtype)
    cpu = block_stats(b, r, 1e-3, 1e-5)
    gpu = block_stats(b.cuda(), r.cuda(), 1e-3, 1e-5).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)


def test_cosine_through_the_fused_kernel_resolves_rounding_level_divergence() -> None:
    import math

    from divtrace.measure import fused
    from divtrace.measure.figures import site_figures
    from tests.test_metrics import _exact_one_minus_cosine

    generator = torch.Generator().manual_seed(0)
    r = torch.randn(30000, generator=generator)
    b = r.clone()
    for _ in range(2):  # a step or two in the last bit, up or down at random
        away = torch.where(torch.rand(30000, generator=generator) < 0.5, -math.inf, math.inf)
        b = torch.nextafter(b, away)
    expected = _exact_one_minus_cosine(b, r)
    fields = fused.fused_stats(b.cuda()[None], r.cuda()[None], 0.0, 0.0).cpu().numpy()
    got = 1 - site_figures(fields, b.numel())["cosine"]
    assert abs(got - expected) <= 0.05 * expected + math.ulp(1.0)


def test_explain_options_on_cuda() -> None:
    model = nn.Sequential(*models.variant_mlp(), models.Scale(4.0)).eval().cuda()
    result = divtrace.compare(model, torch.randn(8, 16, device="cuda"), progress=False,
                              explain=["local", "fp64", divtrace.Repeat(1), "kernels"])
    table = result.table.set_index("site")
    assert list(result.sources["site"]) == ["3"]
    assert table.loc["3", "local_rel_l2"] == table.loc["3", "rel_l2"]
    assert table.loc["4", "local_rel_l2"] == 0
    assert table.loc["6", "amplification"] == 4.0
    assert (table.loc[["0", "3", "6"], "noise_mismatch"] == 0).all()
    assert (table["b_err_fp64"] < 1e-5).all()
    assert table.loc["3", "kernels_b"]  # CUDA kernel names were found


def test_kernels_of_a_convolution_on_cuda(vgg_features: nn.Module) -> None:
    x = torch.rand(16, 3, 64, 64, device="cuda")
    result = divtrace.compare(vgg_features, x, explain=["kernels"], a=divtrace.Run(chunk=2),
                              samples=[0, 1],
                              progress=False)
    conv = result.table.set_index("site").loc["0"]
    assert conv["kernels_b"]
    assert conv["kernels_a"]


def test_cpu_against_cuda() -> None:
    model = models.variant_mlp(variant_from=100)  # batch-invariant: only the device differs
    result = divtrace.compare(model, torch.randn(8, 16), a=divtrace.Run(),
                              b=divtrace.Run(device="cuda"), progress=False)
    assert (result.table["status"] == "ok").all()
    assert (result.table["rel_l2"] < 1e-5).all()
    assert next(model.parameters()).device.type == "cpu"  # the user's model stays put


def test_flags_reach_cuda_runs_and_come_back() -> None:
    before = (torch.backends.cudnn.enabled, torch.backends.cuda.matmul.allow_tf32)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(4)).cuda().eval()
    x = torch.rand(4, 3, 16, 16, device="cuda")
    model(x)  # materialise the lazy layer
    result = divtrace.compare(model, x, a=divtrace.Run(cudnn=True),
                              b=divtrace.Run(cudnn=False), explain=["kernels"], progress=False)
    conv = result.table.set_index("site").loc["0"]
    assert conv["kernels_differ"]  # cuDNN kernels against the native convolution
    assert (torch.backends.cudnn.enabled, torch.backends.cuda.matmul.allow_tf32) == before


needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


class Placed(nn.Module):
    """Layers on the given devices, the activations moved between them."""

    def __init__(self, layers: list[nn.Module], devices: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer.to(d) for layer, d in zip(layers, devices, strict=True))
        self.devices = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, device in zip(self.layers, self.devices, strict=True):
            x = layer(x.to(device))
        return x


FIGURES = ["site", "status", "mismatch", "rel_l2", "max_abs", "role"]


@needs_two
def test_a_model_split_over_two_gpus_gives_the_figures_of_one_gpu() -> None:
    import copy

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)]
    one = Placed(copy.deepcopy(layers), ["cuda:0"] * 8).eval()
    two = Placed(layers, ["cuda:0"] * 4 + ["cuda:1"] * 4).eval()
    x = torch.randn(16, 512, device="cuda:0")
    alone, split = (divtrace.compare(m, x, progress=False).table for m in (one, two))
    assert alone[FIGURES].equals(split[FIGURES])
    assert (alone["rel_l2"] < 1e-4).all()


@needs_two
def test_a_llama_dispatched_over_two_gpus_with_accelerate() -> None:
    import copy

    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=512, max_position_embeddings=64)
    torch.manual_seed(0)
    one = transformers.LlamaForCausalLM(config).eval().to("cuda:0")
    two = copy.deepcopy(one)
    device_map = {"lm_head": 1}
    for name, _child in two.model.named_children():
        if name == "layers":
            device_map |= {f"model.layers.{i}": int(i >= 4) for i in range(8)}
        else:
            device_map[f"model.{name}"] = 0 if name == "embed_tokens" else 1
    two = accelerate.dispatch_model(two, device_map=device_map)
    ids = torch.randint(0, 512, (16, 12), device="cuda:0")
    x = {"input_ids": ids, "use_cache": False}
    alone, split = (divtrace.compare(m, x, samples=range(4), progress=False).table
                    for m in (one, two))
    assert alone[FIGURES].equals(split[FIGURES])
    assert (alone.loc[alone["status"] == "ok", "rel_l2"] < 1e-3).all()


def test_the_observer_check_of_a_transformer_layer_on_cuda() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval().cuda()
    result = divtrace.compare(layer, torch.randn(8, 16, 64, device="cuda"), a=divtrace.Run(chunk=2),
                              samples=[0, 1], progress=False)
    note = result.meta.notes["observer"]
    said = "Observer effect" in result.summary()
    assert said == (not note["identical"])
    assert note["identical"] or note["differs"]["(model)"] > 0


def test_an_input_on_another_device_is_named_before_the_model_runs() -> None:
    model = nn.Linear(4, 4).cuda().eval()
    with pytest.raises(divtrace.DivtraceValueError, match=r"x is on cpu .* x\.to\('cuda:0'\)"):
        divtrace.compare(model, torch.randn(4, 4), progress=False)


def test_op_sites_on_cuda_match_the_ops_run_by_hand() -> None:
    torch.manual_seed(0)
    model, x = models.Attention().eval().cuda(), torch.randn(8, 16, 32, device="cuda")
    result = divtrace.compare(model, x, ops=True, explain=["local", "kernels"],
                              resources=divtrace.Resources(keep=True),
                              progress=False)
    table = result.table.set_index("site")
    ops = table[table["op"] != ""]
    assert ops["status"].eq("ok").all()
    sdpa = next(s for s in ops.index if "scaled_dot_product" in s and s.endswith("/0"))
    with torch.no_grad():
        q, k, v = model.qkv(x).view(8, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        expected = nn.functional.scaled_dot_product_attention(q, k, v)
        alone = torch.cat([nn.functional.scaled_dot_product_attention(
            q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(8)])
    _split, batched = result.pair(sdpa)
    torch.testing.assert_close(batched, expected, rtol=0, atol=0)
    assert ops.loc[sdpa, "kernels_b"]  # a CUDA kernel named for the op itself
    assert ops["local_status"].eq("ok").all()
    if torch.equal(model.qkv(x)[:1], model.qkv(x[:1])):  # identical inputs: the op's own
        assert ops.loc[sdpa, "mismatch"] == (expected != alone).double().mean().item()


def test_generation_on_cuda_gives_generate_tokens_and_aligned_steps() -> None:
    transformers = pytest.importorskip("transformers")
    from divtrace.plan.prompts import pad

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=500)
    model = transformers.LlamaForCausalLM(config).eval().cuda()
    prompts = [torch.randint(3, 500, (n,), device="cuda") for n in (7, 2, 11)]
    found = divtrace.compare_generate(model, prompts, max_new_tokens=6, eos_token_id=None,
                                      progress=False)
    inputs, layout = pad(found.prompts, 0, 3)
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=6, do_sample=False,
                                **found.settings)[:, layout.length:]
    for prompt in range(3):
        mine = found.table[found.table["prompt"] == prompt].sort_values("step")
        assert list(mine["token_batched"]) == tokens[prompt].tolist()
    table = found.at(3).table
    assert (table["status"] == "ok").all()
    assert table.set_index("site").loc["model.embed_tokens", "numel"] == 3 * 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.bool])
def test_fingerprints_on_cuda_are_those_of_the_cpu(dtype: torch.dtype) -> None:
    from divtrace.measure.prints import Fingerprints

    rows = (torch.randn(5, 3, 70_001) * 5).to(dtype)  # beyond a period, and odd lengths
    for width in (1 << 16, 1 << 20):
        on_cpu = Fingerprints().of(rows, width)
        on_cuda = Fingerprints().of(rows.cuda(), width)
        assert torch.equal(on_cuda.cpu(), on_cpu)
    odd = rows[:, :, 1:]  # rows that do not start on a word
    assert torch.equal(Fingerprints().of(odd.cuda()).cpu(), Fingerprints().of(odd))


@pytest.mark.parametrize("exponent", [-565, 664, -990])
def test_float64_beyond_its_squares_on_cuda(exponent: int) -> None:
    import math

    scale = math.ldexp(1.0, exponent)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False)).double().eval().cuda()
    x = torch.randn(32, 64, dtype=torch.float64, device="cuda") * scale
    result = divtrace.compare(model, x, a=divtrace.Run(chunk=2), samples=[0, 1], progress=False)
    with torch.no_grad():
        batched, split = model(x)[:2] / scale, model(x[:2]) / scale
    row = result.table.set_index("site").loc["0"]
    if torch.equal(batched, split):
        assert row["rel_l2"] == 0
    else:
        expected = ((batched - split).norm() / split.norm()).item()
        assert row["rel_l2"] == pytest.approx(expected, rel=1e-6)
    assert math.isfinite(row["cosine"])


def test_remedies_on_cuda_are_what_a_plain_loop_gives(vgg_features: nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.rand(128, 3, 128, 128, device="cuda")
    with divtrace.Run(deterministic=True, benchmark=False, tf32_cudnn=False).flags():
        result = divtrace.compare(vgg_features, x, a=divtrace.Run(chunk=2), samples=[0, 1],
                                  progress=False)
        assert result.verdict == "rounding"  # the seed case (docs/results/h200)
        remedies = result.remedies(progress=False)
        table = remedies.table.set_index("remedy")
        assert bool(table.loc["cuDNN off everywhere", "identical"])  # the ground truth
        assert not bool(table.loc["deterministic algorithms", "identical"])
        assert remedies.best is not None
        for remedy, row in zip(remedies.candidates, remedies.table.itertuples(), strict=True):
            if pd.isna(row.identical):
                continue
            with torch.no_grad(), remedy.applied(vgg_features):
                whole = vgg_features(x)[:2]
                split = vgg_features(x[:2])
            assert torch.equal(whole, split) is bool(row.identical), remedy.name
