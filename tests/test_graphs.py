"""The split run replayed from a CUDA graph: the capture, the bit-for-bit check, the
fallbacks. On the CPU a stand-in graph reruns the captured pass (same store, same slots);
the CUDA tests use real graphs."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

import pytest
import torch
from torch import nn
from torchvision.models import resnet18

import divtrace
from divtrace.errors import DivtraceValueError, DivtraceWarning
from divtrace.plan.inputs import prepare_input
from divtrace.plan.samples import chunks_for
from divtrace.plan.selection import select_modules
from divtrace.record.graphs import GraphedRun, GraphOutcome, lanes_for
from divtrace.record.hooks import ModuleHooks
from divtrace.record.loop import drive
from divtrace.record.rows import RowStore
from tests import models


class Rerun:
    """A stand-in for a CUDA graph on the CPU: replaying reruns the captured pass."""

    def __init__(self, _device: torch.device, warm_up: Callable[[], None]) -> None:
        self.warm_up = warm_up
        self.run: Callable[[], None] | None = None
        self.replays = 0
        self.released = False

    def capture(self, run: Callable[[], None]) -> int:
        self.warm_up()
        self.run = run
        run()
        return 0

    def lane(self, _index: int) -> AbstractContextManager[None]:
        return nullcontext()

    def replay(self) -> None:
        assert self.run is not None
        self.replays += 1
        self.run()

    def release(self) -> None:
        self.released = True


def _record(model: nn.Module, x: torch.Tensor, samples: list[int], chunk: int,
            graphed: GraphedRun | None) -> RowStore:
    batch = prepare_input(x)
    store = RowStore(samples, 0)
    recorder = ModuleHooks(select_modules(model, None))
    chunks = chunks_for(samples, chunk, batch.batch_size)
    with torch.no_grad():
        if graphed is None:
            drive(model, recorder, store, batch, chunks, lambda s, e: f"rows {s}:{e}")
        else:
            graphed.drive(model, recorder, store, batch, chunks, lambda s, e: f"rows {s}:{e}")
    return store


def _same_rows(a: RowStore, b: RowStore) -> None:
    assert list(a.rows) == list(b.rows)
    for key, stored in a.rows.items():
        other = b.rows[key]
        assert stored.filled == other.filled == len(a.samples), key
        assert stored.status == other.status, key
        if stored.rows is not None:
            assert torch.equal(stored.rows, other.rows), key


@pytest.mark.parametrize(("chunk", "samples"), [(1, list(range(9))), (2, list(range(10))),
                                                 (3, [*range(3, 12), 13])])
def test_replayed_passes_store_exactly_the_rows_of_the_eager_run(
        chunk: int, samples: list[int]) -> None:
    model = models.variant_mlp()
    x = torch.randn(14, 16)
    made: list[Rerun] = []
    graphed = GraphedRun(True, make_graph=lambda d, w: made.append(Rerun(d, w)) or made[-1])
    stored = _record(model, x, samples, chunk, graphed)
    _same_rows(stored, _record(model, x, samples, chunk, None))
    outcome = graphed.outcome
    assert outcome is not None
    assert outcome.passes == len(chunks_for(samples, chunk, 14))
    # the last chunk of [3..11, 13] in threes holds row 12, not compared: eager
    whole = [c for c in chunks_for(samples, chunk, 14)
             if c[1] - c[0] == chunk and set(range(*c)) <= set(samples)]
    assert outcome.lanes == lanes_for(len(whole))
    assert outcome.replayed == len(whole) - 1 > 0
    assert (outcome.reason is None) == (len(whole) == outcome.passes)
    # one replay checks every lane on the first chunk, then one per group of lanes (a
    # short last group takes chunks before it again); the graph is freed at the end
    assert made[0].replays == 1 + -(-outcome.replayed // outcome.lanes)
    assert made[0].released


@pytest.mark.parametrize(("chunk", "samples"), [(1, list(range(14))), (3, [*range(12), 13])])
def test_each_pass_counts_once_for_the_progress_bar(chunk: int, samples: list[int]) -> None:
    batch = prepare_input(torch.randn(14, 16))
    steps: list[int] = []
    graphed = GraphedRun(True, make_graph=Rerun)
    model = models.variant_mlp()
    with torch.no_grad():
        graphed.drive(model, ModuleHooks(select_modules(model, None)), RowStore(samples, 0),
                      batch, chunks_for(samples, chunk, 14), lambda s, e: f"rows {s}:{e}",
                      step=lambda: steps.append(1))
    assert graphed.outcome is not None
    assert graphed.outcome.replayed > 0
    assert len(steps) == graphed.outcome.passes == len(chunks_for(samples, chunk, 14))


def test_a_resnet_with_in_place_relus_replayed() -> None:
    model = resnet18(num_classes=10).eval()
    x = torch.randn(6, 3, 32, 32)
    graphed = GraphedRun(True, make_graph=Rerun)
    _same_rows(_record(model, x, list(range(6)), 1, graphed),
               _record(model, x, list(range(6)), 1, None))
    assert graphed.outcome is not None
    assert (graphed.outcome.passes, graphed.outcome.replayed) == (6, 5)
    assert graphed.outcome.reason is None


class Drifting(nn.Module):
    """Adds the number of passes so far: no two passes agree (a stand-in for a graph
    that does not run the eager pass's kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.passes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        return self.inner(x) + self.passes


def test_a_graph_that_differs_from_the_eager_pass_falls_back_with_a_warning() -> None:
    model = Drifting().eval()
    x = torch.randn(10, 4)
    graphed = GraphedRun("auto", make_graph=Rerun)
    with pytest.warns(DivtraceWarning,
                      match=r"differed from the eager pass at site '\(model\)'"):
        stored = _record(model, x, list(range(10)), 1, graphed)
    assert graphed.outcome is not None
    assert graphed.outcome.replayed == 0
    assert "differed" in (graphed.outcome.reason or "")
    # the eager rows of the first pass were put back; every pass ran eagerly after it
    # (pass 1 eager; 2: warm-up; 3, 4: the capture of two lanes; 5, 6: the check, both
    # lanes on the first chunk; then passes 7 to 15)
    assert lanes_for(10) == 2
    with torch.no_grad():
        expected = torch.cat([model.inner(x[i:i + 1]) + n
                              for i, n in zip(range(10), [1, *range(7, 16)],
                                              strict=True)])
    rows = stored.rows["(model)"].rows
    assert rows is not None
    assert torch.equal(rows, expected)
    with pytest.raises(DivtraceValueError, match=r"Resources\(graphs=True\), but .* differed"):
        _record(model, x, list(range(10)), 1, GraphedRun(True, make_graph=Rerun))


class Failing(Rerun):
    def capture(self, run: Callable[[], None]) -> int:
        raise RuntimeError("operation not permitted when stream is capturing\nmore")


def test_a_failed_capture_falls_back_with_a_warning() -> None:
    model = models.variant_mlp()
    x = torch.randn(10, 16)
    graphed = GraphedRun("auto", make_graph=Failing)
    with pytest.warns(DivtraceWarning, match=r"could not be captured \(RuntimeError: "
                                             r"operation not permitted when stream is "
                                             r"capturing\); the split run ran eagerly, with the "
                                             r"same figures \(Resources\(graphs=False\) skips"):
        stored = _record(model, x, list(range(10)), 1, graphed)
    _same_rows(stored, _record(model, x, list(range(10)), 1, None))


class Cramped(Rerun):
    """Runs out of memory when more than one lane is captured."""

    def __init__(self, device: torch.device, warm_up: Callable[[], None]) -> None:
        super().__init__(device, warm_up)
        self.lanes = 0

    def lane(self, index: int) -> AbstractContextManager[None]:
        self.lanes = max(self.lanes, index + 1)
        if index > 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return nullcontext()


def test_lanes_that_do_not_fit_in_memory_become_one() -> None:
    model = models.variant_mlp()
    x = torch.randn(16, 16)
    made: list[Cramped] = []
    graphed = GraphedRun("auto", make_graph=lambda d, w: made.append(Cramped(d, w))
                         or made[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stored = _record(model, x, list(range(16)), 1, graphed)
    _same_rows(stored, _record(model, x, list(range(16)), 1, None))
    assert [graph.lanes for graph in made] == [2, 1]  # four asked, the second failed
    assert made[0].released
    assert graphed.outcome is not None
    assert (graphed.outcome.lanes, graphed.outcome.replayed) == (1, 15)
    assert graphed.outcome.reason is None


class Branching(nn.Module):
    """Takes another path after its first pass (a site the first pass did not show)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.extra = nn.Tanh()
        self.passes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        y = self.inner(x)
        return self.extra(y) if self.passes > 1 else y


def test_a_site_the_first_pass_did_not_show_stops_the_graph() -> None:
    model = Branching().eval()
    x = torch.randn(10, 4)
    graphed = GraphedRun("auto", make_graph=Rerun)
    with pytest.warns(DivtraceWarning, match="site 'extra' is not a batched tensor"):
        stored = _record(model, x, list(range(10)), 1, graphed)
    assert graphed.outcome is not None
    assert graphed.outcome.replayed == 0
    rows = stored.rows["(model)"].rows
    assert rows is not None
    with torch.no_grad():  # the first pass's rows as it made them, put back
        assert torch.equal(rows[0], model.inner(x[0:1])[0])
        assert torch.equal(rows[1:], torch.cat([torch.tanh(model.inner(x[i:i + 1]))
                                                for i in range(1, 10)]))


def test_too_few_passes_stay_eager_under_auto_but_not_under_true() -> None:
    model = models.variant_mlp()
    x = torch.randn(8, 16)
    auto = GraphedRun("auto", make_graph=Rerun)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _record(model, x, [0, 1, 2], 1, auto)
    assert auto.outcome == GraphOutcome("auto", 3, 0, reason="2 pass(es) to replay, too "
                                                             "few to pay for a capture")
    assert auto.outcome.capture_s == 0
    forced = GraphedRun(True, make_graph=Rerun)
    _record(model, x, [0, 1, 2], 1, forced)
    assert forced.outcome is not None
    assert forced.outcome.replayed == 2


def test_graphs_on_the_cpu_are_eager_and_say_why() -> None:
    model = models.variant_mlp()
    x = torch.randn(8, 16)
    result = divtrace.compare(model, x, progress=False)
    assert result.meta.graphed["a"]["replayed"] == 0
    assert result.meta.graphed["a"]["reason"] == "the input is not on a CUDA device"
    eager = divtrace.compare(model, x, resources=divtrace.Resources(graphs=False),
                             progress=False)
    assert result.table.equals(eager.table)
    with pytest.raises(DivtraceValueError,
                       match=r"Resources\(graphs=True\), but .* not on a CUDA device"):
        divtrace.compare(model, x, resources=divtrace.Resources(graphs=True), progress=False)
    with pytest.raises(DivtraceValueError, match="graphs must be 'auto'"):
        divtrace.compare(model, x, resources=divtrace.Resources(graphs="yes"), progress=False)
    with pytest.raises(DivtraceValueError, match="op sites"):
        divtrace.compare(model, x, resources=divtrace.Resources(graphs=True), ops=True,
                         progress=False)


# -- on CUDA -------------------------------------------------------------------------


def _tables_equal(graphed: divtrace.Comparison, eager: divtrace.Comparison) -> None:
    assert graphed.table.equals(eager.table)
    assert graphed.per_sample.equals(eager.per_sample)
    assert graphed.summary() == eager.summary()


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["alexnet", "resnet18", "mlp"])
def test_a_graphed_split_run_gives_exactly_the_eager_table(name: str) -> None:
    from torchvision.models import alexnet

    torch.manual_seed(0)
    model = {"alexnet": lambda: alexnet(num_classes=10),
             "resnet18": lambda: resnet18(num_classes=10),
             "mlp": models.variant_mlp}[name]().eval().cuda()
    x = (torch.randn(14, 16) if name == "mlp" else torch.rand(14, 3, 96, 96)).cuda()
    # per sample: 3 lanes, the last group of two takes one chunk again
    for chunk, samples in ((1, None), (2, None), (3, list(range(3, 12)))):
        graphed = divtrace.compare(model, x, a=divtrace.Run(chunk=chunk),
                                   resources=divtrace.Resources(graphs=True), samples=samples,
                                   progress=False)
        eager = divtrace.compare(model, x, a=divtrace.Run(chunk=chunk),
                                 resources=divtrace.Resources(graphs=False), samples=samples,
                                 progress=False)
        _tables_equal(graphed, eager)
        run = graphed.meta.graphed["a"]
        assert run["lanes"] == lanes_for(run["passes"]) == (3 if chunk == 1 else 1)
        assert run["replayed"] == run["passes"] - 1
        assert run["reason"] is None
        assert run["pool_bytes"] > 0


class Syncing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y * float(y.abs().max())  # a host synchronisation


@pytest.mark.cuda
def test_a_model_that_synchronises_falls_back_on_cuda() -> None:
    model = Syncing().eval().cuda()
    x = torch.randn(16, 8, device="cuda")
    with pytest.warns(DivtraceWarning, match="could not be captured") as caught:
        graphed = divtrace.compare(model, x, progress=False)
    assert caught[0].filename == __file__  # points at the call of compare()
    _tables_equal(graphed, divtrace.compare(model, x, resources=divtrace.Resources(graphs=False),
                                            progress=False))
    with pytest.raises(DivtraceValueError,
                       match=r"Resources\(graphs=True\), but .* could not be captured"):
        divtrace.compare(model, x, resources=divtrace.Resources(graphs=True), progress=False)
    # CUDA, and random draws on it, still work after the failed capture
    assert torch.equal(model(x), model(x))
    assert torch.randn(3, device="cuda").isfinite().all()


@pytest.mark.cuda
def test_a_graph_left_to_the_garbage_collector_does_not_break_a_capture() -> None:
    model = models.variant_mlp().cuda()
    x = torch.randn(16, 16, device="cuda")
    old, static = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    with torch.cuda.graph(old):
        static.add_(1)
    cycle: list[object] = [old]
    cycle.append(cycle)  # only the cyclic collector frees it
    del old, cycle
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at almost every allocation
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DivtraceWarning)
            result = divtrace.compare(model, x, resources=divtrace.Resources(graphs=True),
                                      progress=False)
    finally:
        gc.set_threshold(*threshold)
    assert result.meta.graphed["a"]["replayed"] == 15


@pytest.mark.cuda
def test_graphs_under_deterministic_algorithms() -> None:
    from torchvision.models import vgg11

    model = vgg11().features[:8].eval().cuda()
    x = torch.rand(6, 3, 32, 32, device="cuda")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        graphed = divtrace.compare(model, x, resources=divtrace.Resources(graphs=True),
                                   progress=False)
        eager = divtrace.compare(model, x, resources=divtrace.Resources(graphs=False),
                                 progress=False)
    finally:
        torch.use_deterministic_algorithms(was)
    _tables_equal(graphed, eager)
    assert graphed.meta.graphed["a"]["replayed"] == 5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(("dtype", "shape", "offset"), [
    (torch.float32, (3, 5), 0), (torch.float32, (3, 4, 6), 0), (torch.float32, (3, 4), 1),
    (torch.bfloat16, (3, 3), 0), (torch.float64, (3, 2, 2), 0), (torch.bool, (3, 7), 0),
    (torch.float16, (3, 2, 4), 3), (torch.int64, (3, 9), 0)])
def test_slot_copy_writes_each_row_to_its_slot_bit_for_bit(
        device: str, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> None:
    from divtrace.record.cudagraph import slot_copy

    base = torch.randn(torch.Size(shape).numel() + offset, device=device)
    source = (base * 1e3).to(dtype)[offset:offset + torch.Size(shape).numel()].view(shape)
    source.view(-1)[0] = float("nan") if dtype.is_floating_point else 1
    target = torch.zeros((6, *shape[1:]), dtype=dtype, device=device)
    slots = torch.tensor([4, 0, 2], device=device)
    slot_copy(target, slots, source)
    expected = torch.zeros_like(target)
    expected[slots] = source
    assert torch.equal(target.view(-1).view(torch.uint8)
                       if dtype.is_floating_point else target,
                       expected.view(-1).view(torch.uint8)
                       if dtype.is_floating_point else expected)


@pytest.mark.cuda
@pytest.mark.parametrize("options", [{"explain": ["local"]}, {"explain": ["fp64"]},
                                     {"explain": [divtrace.Repeat(1)]},
                                     {"modules": ["layer1.*"]},
                                     {"a": divtrace.Run(chunk=2), "samples": [2, 3, 4, 5, 6, 7]}])
def test_graphs_with_explain_options(options: dict[str, object]) -> None:
    torch.manual_seed(0)
    model = resnet18(num_classes=10).eval().cuda()
    x = torch.rand(8, 3, 64, 64, device="cuda")
    graphed = divtrace.compare(model, x, resources=divtrace.Resources(graphs=True), progress=False,
                               **options)
    _tables_equal(graphed, divtrace.compare(model, x, resources=divtrace.Resources(graphs=False),
                                            progress=False,
                                            **options))
    assert graphed.meta.graphed["a"]["replayed"] > 0


@pytest.mark.cuda
def test_graphs_for_two_chunked_runs_and_a_language_model() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = models.variant_mlp().cuda()
    x = torch.randn(16, 16, device="cuda")
    a, b = divtrace.Run(chunk=1), divtrace.Run(chunk=4)
    graphed = divtrace.compare(model, x, a=a, b=b, resources=divtrace.Resources(graphs=True),
                               progress=False)
    _tables_equal(graphed, divtrace.compare(model, x, a=a, b=b,
                                            resources=divtrace.Resources(graphs=False),
                                            progress=False))
    assert [graphed.meta.graphed[run]["replayed"] for run in "ab"] == [15, 3]
    assert [graphed.meta.graphed[run]["lanes"] for run in "ab"] == [4, 1]
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     vocab_size=300)
    bert = transformers.BertModel(config).eval().cuda()
    ids = torch.randint(0, 300, (16, 12), device="cuda")
    mask = torch.ones_like(ids)
    mask[::3, 9:] = 0  # padded rows: the mask is an input of every lane
    inputs = {"input_ids": ids, "attention_mask": mask}
    graphed = divtrace.compare(bert, inputs, resources=divtrace.Resources(graphs=True),
                               progress=False)
    _tables_equal(graphed, divtrace.compare(bert, inputs, progress=False,
                                            resources=divtrace.Resources(graphs=False)))
    run = graphed.meta.graphed["a"]
    assert (run["replayed"], run["lanes"]) == (15, 4)  # the last group of three takes one again


def test_the_html_page_says_how_the_split_run_ran() -> None:
    from divtrace.report.html import page

    result = divtrace.compare(models.variant_mlp(), torch.randn(8, 16), progress=False)
    html = page(result, "graphs")
    assert "passes eager (the input is not on a CUDA device)" in html
    assert ">graphed<" not in html  # in the runs' rows, not among the settings

    def replayed(outcome: GraphOutcome) -> str:
        info = replace(result.meta, graphed={"a": outcome.to_dict()})
        return page(divtrace.Comparison(result.table, result.per_sample, info, {}), "graphs")

    assert ("63 of 64 passes replayed from a CUDA graph, 4 side by side (pool 96 MiB), each "
            "checked bit for bit against the eager first pass"
            ) in replayed(GraphOutcome("auto", 64, 63, 4, 96 << 20))
    assert ("7 of 9 passes replayed from a CUDA graph (pool 2 MiB), checked bit for bit "
            "against the eager first pass") in replayed(GraphOutcome("auto", 9, 7, 1, 2 << 20))
