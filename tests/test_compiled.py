"""Compiled code module by module (``compare_compiled``): the model compiled region by
region on inductor's C++ backend, every region a site; each finding checked against the
same regions compiled and run by hand."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

import divtrace
from divtrace.compiled import compare_compiled

WIDE = 14336  # on the CPU, a static compile's reduction over this many columns depends
# on the batch shape (torch 2.14, C++ backend); eager's does not


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, -1)


class Blocks(nn.Module):
    """Eager code around a list of blocks: a scale before, a sum after."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Identity()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.scale(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _wide() -> torch.Tensor:
    return torch.randn(64, WIDE, generator=torch.Generator().manual_seed(0)) * 4


def _row0_apart(module: nn.Module, x: torch.Tensor, dynamic: bool) -> bool:
    """By hand: ``module`` compiled, its row 0 at the whole batch against alone."""
    torch._dynamo.reset_code(type(module).forward.__code__)  # compiled afresh, here
    compiled = torch.compile(copy.deepcopy(module), dynamic=dynamic)
    with torch.no_grad():
        return not torch.equal(compiled(x)[:1], compiled(x[:1]))


@pytest.mark.parametrize(("block", "dynamic"), [(RMSNorm(WIDE), False), (Softmax(), True)],
                         ids=["rmsnorm-static", "softmax-dynamic"])
def test_compiled_code_that_depends_on_the_batch_shape_is_found_at_its_module(
        block: nn.Module, dynamic: bool) -> None:
    model = Blocks(nn.Identity(), block).eval()
    x = _wide()
    assert _row0_apart(block, x, dynamic)  # the case exists: compiled code parts row 0
    eager = divtrace.compare(model, x, samples=[0], progress=False)
    assert eager.verdict == "identical"  # and eager code does not
    result = compare_compiled(model, x, samples=[0], dynamic=dynamic, progress=False)
    assert result.meta.kind == "compiled"
    assert result.meta.names == ("run a (compiled split)", "run b (compiled batched)")
    first = result.first_divergence
    assert first is not None
    assert first["site"] == "layers.1"
    table = result.table.set_index("site")
    assert table.loc["scale", "mismatch"] == 0  # eager code before it: bit-identical
    assert table.loc["layers.0", "mismatch"] == 0  # a compiled region that does not part
    assert result.verdict == "rounding"  # and it shrinks in float64, compiled as it ran


def test_down_to_the_module_whose_compiled_code_parts_the_runs() -> None:
    class Block(nn.Module):  # eager code of its own around two children
        def __init__(self) -> None:
            super().__init__()
            self.scale, self.norm = nn.Identity(), RMSNorm(WIDE)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.scale(x)) + 0.0

    model = Blocks(nn.Identity(), Block()).eval()
    x = _wide()
    assert _row0_apart(model.layers[1].norm, x, dynamic=False)  # by hand: it parts alone
    result = compare_compiled(model, x, samples=[0], narrow=True, progress=False)
    assert result.first_divergence["site"] == "layers.1"  # the view stays region by region
    assert result.meta.notes["regions"]["narrowed"] == [["layers.1", "layers.1.norm"]]
    assert ("Down to the module: 'layers.1.norm', compiled on its own (the rest of 'layers.1' "
            "eager), parts the runs") in result.summary()


def test_the_kernels_probe_names_the_compiled_graph_each_run_called() -> None:
    model = Blocks(nn.Identity(), RMSNorm(WIDE)).eval()
    result = compare_compiled(model, _wide(), samples=[0], explain=["kernels"],
                              progress=False)
    row = result.table.set_index("site").loc["layers.1"]
    # each batch shape its own compiled graph: another one in each run, by its hash
    assert "CompiledFxGraph" in row["kernels_a"]
    assert "CompiledFxGraph" in row["kernels_b"]
    assert bool(row["kernels_differ"])


def test_eager_against_compiled_names_the_first_region_that_parts() -> None:
    model = Blocks(nn.Identity(), RMSNorm(WIDE)).eval()
    x = _wide()
    result = compare_compiled(model, x, samples=[0, 1], against="eager", progress=False)
    assert result.meta.names == ("run a (eager)", "run b (compiled)")
    # by hand: the eager block's output against the compiled block's on the same input
    with torch.no_grad():
        apart = not torch.equal(model.layers[1](x), torch.compile(
            copy.deepcopy(model.layers[1]), dynamic=False)(x))
    first = result.first_divergence
    if apart:
        assert first is not None
        assert first["site"] == "layers.1"
        assert result.verdict == "rounding"
    else:
        assert result.verdict == "identical"


def test_a_model_compiled_by_its_user_gets_the_view_per_module() -> None:
    model = Blocks(nn.Identity(), RMSNorm(WIDE)).eval()
    x = _wide()
    whole = torch.compile(model)
    result = compare_compiled(whole, x, samples=[0], progress=False)
    assert set(result.table["site"]) >= {"scale", "layers.0", "layers.1"}
    assert result.first_divergence["site"] == "layers.1"
    child = Blocks(nn.Identity(), RMSNorm(WIDE)).eval()
    child.layers[1] = torch.compile(child.layers[1])  # a compiled child in an eager model
    result = compare_compiled(child, x, samples=[0], regions=[], progress=False)
    assert "layers.1" in set(result.table["site"])  # named as the eager module, a region
    assert result.first_divergence["site"] == "layers.1"
    assert type(child.layers[1]).__name__ == "OptimizedModule"  # the user's model as given


def test_nothing_is_left_compiled_and_no_recompile_is_asked_for() -> None:
    from torch._dynamo import reset_code
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    code = RMSNorm.forward.__code__
    reset_code(code)  # what other tests compiled of it
    model = Blocks(nn.Identity(), RMSNorm(WIDE), RMSNorm(WIDE), RMSNorm(WIDE)).eval()
    before = copy.deepcopy(model.state_dict())
    graphs = counters["stats"]["unique_graphs"]
    result = compare_compiled(model, _wide(), samples=[0, 5], chunk=4, progress=False)
    # one graph per shape and dtype, shared by the three layers: 4 and 64 rows, in the
    # model's float32 (and the precision test's float64), not one per layer and pass
    dtypes = 2 if result.meta.notes["precision"]["ran"] else 1
    assert counters["stats"]["unique_graphs"] - graphs == 2 * dtypes
    assert result.meta.notes["regions"]["graphs"] == 2 * dtypes  # and the summary says so
    assert f"It compiled {2 * dtypes} graphs in " in result.summary()
    assert not _debug_get_cache_entry_list(code)  # what it compiled, dropped
    users = torch.compile(model.layers[1], dynamic=False)
    with torch.no_grad():
        users(_wide())
    held = len(_debug_get_cache_entry_list(code))
    compare_compiled(model, _wide(), samples=[0], progress=False)
    assert len(_debug_get_cache_entry_list(code)) >= held  # the user's compiled code kept
    assert "forward" not in vars(model.layers[1])  # the user's modules: as they were

    class Norm(RMSNorm):
        pass

    mine = Blocks(Norm(WIDE)).eval()
    result = compare_compiled(mine, _wide(), samples=[0], progress=False)
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, Norm)]
    assert alive == [mine.layers[0]]  # the user's own, no compiled copy kept
    assert result.verdict in ("rounding", "identical")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_function_past_its_recompile_limit_is_still_compared_compiled() -> None:
    from torch._dynamo import config

    class Capped(nn.Module):  # a forward of its own: its own code object
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, WIDE))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    model = Blocks(nn.Identity(), Capped()).eval()
    x = _wide()
    users = torch.compile(Capped.forward, dynamic=False)
    with config.patch(recompile_limit=1), torch.no_grad():
        users(model.layers[1], x)
        users(model.layers[1], x[:1])  # past the limit: from now on only 64 rows compiled
    result = compare_compiled(model, x, samples=[0], progress=False)
    assert result.meta.notes["regions"]["graphs"] >= 2  # it compiled its own code
    first = result.first_divergence  # compiled code at both shapes, as by hand
    assert first is not None
    assert first["site"] == "layers.1"


def test_bad_input_is_refused_with_the_fix() -> None:
    model = Blocks(nn.Identity(), RMSNorm(8)).eval()
    x = torch.randn(4, 8)
    with pytest.raises(divtrace.DivtraceValueError, match="'split' or 'eager'"):
        compare_compiled(model, x, against="batched", progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match=r"no module 'layers\.7'"):
        compare_compiled(model, x, regions=["layers.7"], progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="inside a compiled region"):
        compare_compiled(model, x, modules=["layers.1.weight", "layers.0"],
                         regions=["layers"], progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="no block to compile"):
        compare_compiled(nn.Linear(8, 8), x, progress=False)


def _llama(layers: int = 4) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
        attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def _layer_outputs(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(
        lambda _m, _a, out: found.append((out[0] if isinstance(out, tuple) else out).clone()))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return found


def test_eager_against_compiled_on_a_small_llama_against_its_regions_by_hand() -> None:
    model = _llama()
    ids = torch.randint(0, 100, (8, 12), generator=torch.Generator().manual_seed(0))
    result = compare_compiled(model, {"input_ids": ids, "use_cache": False},
                              against="eager", progress=False)
    # by hand: each decoder layer wrapped by torch.compile itself, in a copy
    by_hand = copy.deepcopy(model)
    for index, layer in enumerate(by_hand.model.layers):
        by_hand.model.layers[index] = torch.compile(layer, dynamic=False)
    eager, compiled = _layer_outputs(model, ids), _layer_outputs(by_hand, ids)
    apart = [i for i, (e, c) in enumerate(zip(eager, compiled, strict=True))
             if not torch.equal(e, c)]
    first = result.first_divergence
    if apart:
        assert first is not None
        assert first["site"] == f"model.layers.{apart[0]}"
        assert result.verdict == "rounding"
    else:
        assert first is None or not first["site"].startswith("model.layers.")
    sites = set(result.table["site"])
    assert {f"model.layers.{i}" for i in range(4)} <= sites
    assert not any(s.startswith("model.layers.0.") for s in sites)  # inside: no site
    hidden = sum(1 for name, _ in model.named_modules()
                 if name.startswith("model.layers.") and name.count(".") >= 3)
    assert (f"'model.layers.0', 'model.layers.1', 'model.layers.2' and 1 more (4 in all) "
            f"each ran torch.compile'd code, its output a site; the {hidden} modules inside "
            f"them ran compiled code") in result.summary()


def test_the_precision_test_replays_the_compiled_run_compiled() -> None:
    model = _llama(layers=2).to(torch.bfloat16)
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    result = compare_compiled(model, {"input_ids": ids, "use_cache": False},
                              against="eager", progress=False)
    assert result.meta.notes["precision"]["ran"]
    # a graph in bfloat16 and one in float64: the float64 replay of run b ran compiled
    # code too, not the eager model (whose float64 output would equal run a's exactly)
    assert result.meta.notes["regions"]["graphs"] == 2
    assert float(result.table.iloc[-1]["fp64_rel_l2"]) > 0


def test_compiled_batched_against_split_on_prompts() -> None:
    model = _llama(2)
    generator = torch.Generator().manual_seed(1)
    prompts = divtrace.Prompts([torch.randint(1, 100, (n,), generator=generator)
                                for n in (5, 9, 7)])
    result = compare_compiled(model, prompts, progress=False)
    assert result.meta.names == ("run a (compiled split)", "run b (compiled batched)")
    assert {"model.layers.0", "model.layers.1"} <= set(result.table["site"])
    assert result.verdict in ("rounding", "identical")
    assert model.config.use_cache  # the user's model as it was


def test_a_compiled_comparison_saves_and_loads(tmp_path: object) -> None:
    model = Blocks(nn.Identity(), RMSNorm(WIDE)).eval()
    result = compare_compiled(model, _wide(), samples=[0], progress=False)
    again = divtrace.load(result.save(tmp_path / "compiled.json"))  # type: ignore[operator]
    assert again.meta.kind == "compiled"
    assert again.verdict == result.verdict
    assert again.summary() == result.summary()
    assert "Compiled region by region: 'layers.0', 'layers.1' (2 in all)" in again.summary()


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [8, 512])
def test_a_compiled_softmax_that_depends_on_the_batch_shape_on_cuda(batch: int) -> None:
    model = Blocks(nn.Identity(), Softmax()).eval().cuda()
    x = torch.randn(512, WIDE, generator=torch.Generator().manual_seed(0)).mul(4)[:batch].cuda()
    rows = [0, 1, 2, 3]
    assert divtrace.compare(model, x, samples=rows, progress=False).verdict == "identical"
    static = compare_compiled(model, x, samples=rows, progress=False)
    torch._dynamo.reset_code(Softmax.forward.__code__)  # by hand, compiled afresh
    by_hand = torch.compile(Softmax(), dynamic=False)
    with torch.no_grad():
        whole = by_hand(x)
        apart = [i for i in rows if not torch.equal(whole[i:i + 1], by_hand(x[i:i + 1]))]
    samples = static.per_sample
    assert sorted(set(samples.loc[samples["mismatch"] > 0, "sample"])) == apart
    if apart:
        assert static.first_divergence["site"] == "layers.1"
        assert static.verdict == "rounding"
    else:
        assert static.verdict == "identical"
    dynamic = compare_compiled(model, x, samples=rows, dynamic=True, progress=False)
    assert dynamic.verdict == "identical"  # one kernel for every batch size


def test_remedies_of_compiled_code_are_compiled_under_them_verified_and_costed() -> None:
    from torch._inductor import config

    class Norm(RMSNorm):
        pass

    model = Blocks(nn.Identity(), Norm(WIDE)).eval()
    x = _wide()
    threads = config.cpp.threads
    result = compare_compiled(model, x, samples=[0], progress=False)
    assert result.verdict == "rounding"
    found = result.remedies(candidates=["inductor", "float64", "deterministic", "dynamic",
                                        "eager-region"], repeats=1, progress=False)
    assert config.cpp.threads == threads  # inductor's config as it was
    table = found.table.set_index("kind")
    # by hand: the norm compiled statically under the setting, row 0 against alone
    with divtrace.remedies.InductorSettings({"cpp.threads": 1}).applied(model):
        agrees = not _row0_apart(model.layers[1], x, dynamic=False)
    assert bool(table.loc["inductor", "identical"]) == agrees
    assert table.loc["inductor", "cost"] > 0
    assert table.loc["float64", "note"].startswith("not tried: it acts through hooks")
    # the region left eager: the eager norm computes row 0 alike at any batch; dynamic
    # shapes: as the norm compiled with dynamic=True by hand does
    assert table.loc["eager-region", "remedy"] == "eager in layers.1"
    assert bool(table.loc["eager-region", "identical"])
    assert bool(table.loc["dynamic", "identical"]) == (
        not _row0_apart(model.layers[1], x, dynamic=True))
    gc.collect()
    assert [o for o in gc.get_objects() if isinstance(o, Norm)] == [model.layers[1]]


def test_the_inductor_candidates_are_settings_of_this_torch() -> None:
    from divtrace.remedies.inductor import InductorSettings

    cpu, cuda = InductorSettings.defaults(False), InductorSettings.defaults(True)
    assert [r.settings for r in cpu] == [{"cpp.threads": 1}]
    assert [r.settings for r in cuda] == [{"split_reductions": False},
                                          {"triton.persistent_reductions": False}]
    assert all(r.missing is None for r in cpu + cuda)  # this torch's inductor has them


def _by_hand(kind: str, remedy: Any, block: nn.Module, x: torch.Tensor,
             rows: list[int]) -> bool:
    """A remedy applied by hand in a plain loop: ``block`` compiled as the remedy says,
    the whole batch, then each compared row alone; whether every row is bit-identical."""
    from contextlib import nullcontext

    from torch._inductor import config

    settings = config.patch(remedy.settings) if kind == "inductor" else nullcontext()
    torch._dynamo.reset_code(type(block).forward.__code__)  # compiled afresh, so
    with settings, torch.no_grad():
        run = block if kind == "eager-region" else torch.compile(
            copy.deepcopy(block), dynamic=kind == "dynamic")
        whole = run(x)
        return all(torch.equal(whole[i:i + 1], run(x[i:i + 1])) for i in rows)


@pytest.mark.cuda
def test_a_remedy_called_identical_is_bit_identical_by_hand_on_cuda() -> None:
    model = Blocks(nn.Identity(), Softmax()).eval().cuda()
    x = torch.randn(512, WIDE, generator=torch.Generator().manual_seed(0)).mul(4).cuda()
    rows = [0, 1, 2, 3]
    result = compare_compiled(model, x, samples=rows, explain=["kernels"], progress=False)
    table = result.table.set_index("site")
    # the region's kernels: inductor's Triton kernels, named by their strategy, in at
    # least one run (at one shape inductor may call ATen's own kernel instead)
    assert "triton_" in table.loc["layers.1", "kernels_a"] + table.loc["layers.1", "kernels_b"]
    if result.verdict == "identical":
        pytest.skip("this GPU's compiled softmax computes the rows alike at batch 512")
    found = result.remedies(candidates=["inductor", "dynamic", "eager-region"], repeats=1,
                            progress=False)
    tried = [(row, remedy) for row, remedy in zip(
        found.table.itertuples(), found.candidates, strict=True) if not pd.isna(row.identical)]
    assert any(row.kind == "dynamic" and row.identical for row, _ in tried)  # one kernel
    for row, remedy in tried:  # what the table says of each, a plain loop says too
        assert _by_hand(row.kind, remedy, Softmax(), x, rows) == bool(row.identical), row.remedy
