"""The recipes of docs/architecture.md, each done once: a column, a probe, a recorder and
an output format added from outside the package, through the seams the pipeline has."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

import divtrace
from divtrace.align.sites import Site, site_key
from divtrace.assembly import parts_for
from divtrace.measure.figures import Figure, SiteFields
from divtrace.pipeline import execute
from divtrace.plan.make import make_plan
from divtrace.record.recorder import Recorder, Sink, Tracker
from divtrace.report.meta import Meta
from tests import models

# -- a column ---------------------------------------------------------------------------


def rms_abs(fields: SiteFields) -> float:
    return math.sqrt(fields.sum("sq_diff") / fields.numel) if fields.numel else 0.0


def test_a_column_is_one_figure() -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)
    plan = make_plan(model, x, progress=False, resources=divtrace.Resources(keep=True))
    figure = Figure("rms_abs", rms_abs, "root mean square of |batched - split|")
    parts = parts_for(plan, model)
    result = execute(plan, model, replace(parts, figures=(*parts.figures, figure)))
    columns = list(result.table.columns)
    assert columns.index("rms_abs") == columns.index("nonfinite") + 1
    table = result.table.set_index("site")
    for site in ("3", "4", "5"):
        split, batched = result.pair(site)
        expected = (batched.double() - split.double()).square().mean().sqrt().item()
        assert expected > 0
        assert table.loc[site, "rms_abs"] == pytest.approx(expected, rel=1e-12)
    assert table.loc["0", "rms_abs"] == 0


# -- a probe ----------------------------------------------------------------------------


class BatchedNorm(divtrace.Probe):
    """The norm of run b's compared rows at every site: a column and a sentence."""

    spec = divtrace.Spec(columns=("b_norm",), shown=("b_norm",))

    def __init__(self) -> None:
        self.found: dict[str, divtrace.Deferred] = {}

    def hooks(self) -> divtrace.Hooks:
        return divtrace.Hooks(site=self.norm)

    def norm(self, ctx: divtrace.Context, measured: divtrace.Measured, tensor: torch.Tensor,
             rows: torch.Tensor) -> None:
        norm = torch.linalg.vector_norm(ctx.pick(tensor).double()).reshape(1)
        self.found[measured.site.key] = ctx.later(norm)  # fetched with the rest

    def fill(self, rows: list[dict[str, Any]], view: divtrace.TableView) -> None:
        for row in rows:
            if row["site"] in self.found:
                row["b_norm"] = float(self.found[row["site"]].get()[0])

    @classmethod
    def explain(cls, result: divtrace.Judged) -> divtrace.Explained:
        top = result.table.loc[result.table["b_norm"].idxmax()]
        return divtrace.Explained(
            (f"The largest norm in run b is {top['b_norm']:.3g}, at '{top['site']}'.",))


def test_a_probe_adds_its_column_and_its_sentence() -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)
    probe = BatchedNorm()
    result = divtrace.compare(model, x, samples=[1, 6], explain=["local", probe],
                              resources=divtrace.Resources(keep=True), progress=False)
    assert list(result.table.columns)[-1] == "b_norm"
    assert result.meta.explain == {"independence": {}, "precision": {},
                                   "local": {"skip": []}, "BatchedNorm": {}}
    table = result.table.set_index("site")
    for site in table.index:
        _, batched = result.pair(site)
        expected = torch.linalg.vector_norm(batched.double()).item()
        assert table.loc[site, "b_norm"] == pytest.approx(expected, rel=1e-12)
    top = table["b_norm"].idxmax()
    assert f"The largest norm in run b is {table.loc[top, 'b_norm']:.3g}, at '{top}'." in (
        result.summary())
    assert ">b_norm</th>" in result._repr_html_()
    assert not probe.found  # the given probe stays fresh: each run works on a copy
    again = divtrace.compare(model, x, samples=[1, 6], explain=[BatchedNorm], progress=False)
    assert again.table["b_norm"].equals(result.table["b_norm"])  # a class is made for you


def test_a_probe_checks_the_model_first() -> None:
    class ForConvolutions(BatchedNorm):
        def check(self, model: nn.Module) -> bool:  # nothing to do without a convolution
            return any(isinstance(m, nn.Conv1d) for m in model.modules())

    x = torch.randn(8, 16)
    assert "b_norm" not in divtrace.compare(models.variant_mlp(), x,
                                            explain=[ForConvolutions()], progress=False).table
    conv = nn.Sequential(nn.Unflatten(1, (1, 16)), nn.Conv1d(1, 2, 3)).eval()
    assert "b_norm" in divtrace.compare(conv, x, explain=[ForConvolutions()],
                                        progress=False).table


# -- a recorder -------------------------------------------------------------------------


class LinearCalls(Recorder):
    """Observes every call of ``torch.nn.functional.linear``: sites ``linear``,
    ``linear#1``, ... in call order."""

    @contextmanager
    def observe(self, sink: Sink) -> Iterator[Tracker]:
        tracker = Tracker()

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if func is F.linear and not tracker.replaying:
                    call = tracker.calls["linear"]
                    tracker.calls["linear"] = call + 1
                    site = Site(site_key("linear", call, ""), "linear", "linear", call, "",
                                True)
                    tracker.last_site = site.key
                    sink.on_tensor(site, out)
                    tracker.produced(site.key, out)
                return out

        with Mode():
            yield tracker


def test_a_recorder_plugs_into_the_pipeline() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    x = torch.randn(12, 16)
    plan = make_plan(model, x, progress=False)
    parts = replace(parts_for(plan, model), recorder=lambda _model, _modules: LinearCalls())
    result = execute(plan, model, parts)
    assert list(result.table["site"]) == ["linear", "linear#1"]
    with torch.no_grad():
        first = model[0](x), torch.cat([model[0](x[i:i + 1]) for i in range(12)])
        second = model(x), torch.cat([model(x[i:i + 1]) for i in range(12)])
    table = result.table.set_index("site")
    for site, (batched, split) in (("linear", first), ("linear#1", second)):
        assert table.loc[site, "mismatch"] == (batched != split).double().mean().item()
        assert table.loc[site, "max_abs"] == (batched - split).abs().max().item()


# -- an output format -------------------------------------------------------------------


def write_markdown(result: divtrace.Comparison, path: Path) -> Path:
    """The summary's first line and the table's main columns, as Markdown."""
    lines = [f"# {result.summary().splitlines()[0]}", "",
             "| site | status | mismatch | rel_l2 |", "|---|---|---|---|"]
    lines += [f"| {r.site} | {r.status} | {r.mismatch:.3g} | {r.rel_l2:.3g} |"
              for r in result.table.itertuples()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_output_format_reads_the_public_result(tmp_path: Path) -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)
    text = write_markdown(result, tmp_path / "result.md").read_text().splitlines()
    assert text[0] == "# " + result.summary().splitlines()[0]
    rows = text[4:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(result.table.site)
    assert rows[3] == f"| 3 | ok | {result.table.mismatch[3]:.3g} | {result.table.rel_l2[3]:.3g} |"


# -- the typed meta ----------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"a": divtrace.Run(), "b": divtrace.Run(chunk=2),
                                          "explain": ["fp64"]}])
def test_meta_round_trips_through_json(options: dict[str, Any]) -> None:
    model = nn.Sequential(*models.variant_mlp(), nn.Flatten()).eval()
    result = divtrace.compare(model, torch.randn(6, 16), progress=False, **options)
    back = Meta.from_dict(json.loads(json.dumps(result.meta.to_dict())))
    assert back == result.meta
    assert back.to_dict() == result.meta.to_dict()
    assert isinstance(back.flips["(model)"], tuple)


def test_the_probe_of_the_architecture_notes_runs_as_written() -> None:
    notes = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    recipe = notes[notes.index("### A probe"):notes.index("### A recorder")]
    code = recipe[recipe.index("```python\n") + 10:recipe.index("```\n", recipe.index(
        "```python"))]
    assert 15 <= len(code.strip().splitlines()) <= 25  # about 20 lines
    namespace: dict[str, Any] = {"divtrace": divtrace, "torch": torch,
                                 "model": models.variant_mlp(), "x": torch.randn(8, 16)}
    exec(code, namespace)  # the notes' own example
    result = namespace["result"]
    assert list(result.table.columns)[-1] == "b_norm"
    assert "The largest norm in run b is" in result.summary()


def test_a_probe_of_ones_own_can_overrule_rounding() -> None:
    class Budgeted(divtrace.Probe):
        """The output's rel_l2 must stay under 1e-9, whatever floating point allows."""

        @classmethod
        def explain(cls, result: divtrace.Judged) -> divtrace.Explained:
            worst = float(divtrace.output_rows(result.table)["rel_l2"].max())
            return divtrace.Explained(findings=divtrace.Findings(
                beyond=f"the output parts by {worst:.3g}, over 1e-9" if worst > 1e-9 else None))

    model, x = models.variant_mlp(), torch.randn(8, 16)
    assert divtrace.compare(model, x, progress=False).verdict == "rounding"
    judged = divtrace.compare(model, x, explain=[Budgeted()], progress=False)
    assert judged.verdict == "not rounding"
    assert "over 1e-9" in judged.summary().splitlines()[0]


# -- a kind of comparison ---------------------------------------------------------------


class Autocast(divtrace.Kind):
    """The model under bfloat16 autocast (run b) against float32 (run a), both on the
    whole batch: the recipe of docs/architecture.md, written outside the package."""

    name: ClassVar[str] = "autocast"
    cannot: ClassVar[dict[str, str]] = {"precision": "run b computes in bfloat16 by design"}

    def runs(self, a: Any, b: Any) -> tuple[divtrace.Run, divtrace.Run]:
        return divtrace.Run(name="float32"), divtrace.Run(name="autocast bf16")

    def around(self, which: str) -> Any:
        return torch.autocast("cpu", torch.bfloat16) if which == "b" else nullcontext()


def test_a_kind_of_ones_own_runs_through_the_pipeline(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    x = torch.randn(6, 32)
    result = divtrace.compare(model, x, kind=Autocast, progress=False)
    table = result.table.set_index("site")
    with torch.no_grad():  # the two runs made by hand: float32 and autocast
        by_hand = model(x).double()
        with torch.autocast("cpu", torch.bfloat16):
            autocast = model(x).double()
    assert table.loc["(model)", "rel_l2"] == pytest.approx(
        float((autocast - by_hand).norm() / by_hand.norm()), rel=1e-6)
    assert table.loc["0", "rel_l2"] > 1e-4  # bfloat16's rounding, not float32's
    assert result.meta.kind == "autocast"
    assert result.meta.names == ("run a (float32)", "run b (autocast bf16)")
    assert result.meta.notes["independence"]["ran"]  # the independence test ran ...
    assert not result.table["depends_on_others"].any()
    assert result.meta.notes["precision"]["why"] == "run b computes in bfloat16 by design"
    said = result.summary()
    assert "run b computes in bfloat16 by design" in said  # ... this did not
    assert ("so what parts run b (autocast bf16) and run a (float32) is how each run "
            "computes, not the other samples' values") in said  # runs of the same shape
    assert ("so that the difference is rounding in how each run computes, not one by "
            "design, rests on the size of the error alone") in said
    result.to_html(tmp_path / "autocast.html")
    assert "autocast bf16" in (tmp_path / "autocast.html").read_text()
    compact = result.sites
    assert list(compact["site"]) == ["0", "1", "2", "(model)"]
    assert "depends_on_others" in compact
    result.save(tmp_path / "autocast.json")
    again = divtrace.load(tmp_path / "autocast.json")
    assert again.meta.kind == "autocast"
    assert again.table["rel_l2"].equals(result.table["rel_l2"])
    assert again.verdict == result.verdict


def test_a_kind_for_a_plain_batch_refuses_prompts() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=50)
    model = transformers.LlamaForCausalLM(config).eval()
    prompts = divtrace.Prompts([torch.tensor([3, 4, 5]), torch.tensor([6, 7])],
                               pad_token_id=0)
    with pytest.raises(divtrace.DivtraceValueError, match="derive the kind from divtrace"):
        divtrace.compare(model, prompts, kind=Autocast, progress=False)


def test_the_command_line_takes_a_kind(tmp_path: Path, capsys: Any) -> None:
    from divtrace.cli import main

    target = tmp_path / "autocast.py"
    target.write_text(
        "import contextlib, torch, divtrace\n"
        "def pair():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 4)).eval(), torch.randn(4, 8)\n"
        "class Autocast(divtrace.Kind):\n"
        "    name = 'autocast'\n"
        "    def runs(self, a, b):\n"
        "        return divtrace.Run(name='float32'), divtrace.Run(name='autocast')\n"
        "    def around(self, which):\n"
        "        return (torch.autocast('cpu', torch.bfloat16) if which == 'b'\n"
        "                else contextlib.nullcontext())\n")
    saved = tmp_path / "out.json"
    assert main(["compare", f"{target}:pair", "--kind", f"{target}:Autocast", "--no-progress",
                 "--json", str(saved)]) == 0
    assert divtrace.load(saved).meta.kind == "autocast"
    assert main(["compare", f"{target}:pair", "--kind", f"{target}:pair"]) == 2
    assert "must give a divtrace.Kind; got tuple" in capsys.readouterr().err


def test_a_probe_written_for_the_old_seam_is_refused_with_the_fix() -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match=r"columns: spec = Spec\(columns=") as e:
        class Old(divtrace.Probe):
            columns = ("b_norm",)

            def on_site(self, ctx: Any, measured: Any, tensor: Any, rows: Any) -> None:
                pass
    assert "on_site: hooks() returns Hooks(site=...)" in str(e.value)
    with pytest.raises(divtrace.DivtraceValueError, match=r"needs=.*'whole_batch'"):
        divtrace.Spec(needs=frozenset({"whole batch"}))
    with pytest.raises(divtrace.DivtraceValueError, match=r"shown=.*among its columns"):
        divtrace.Spec(columns=("a",), shown=("b",))


class Again(divtrace.Probe):
    """Run b once more, from outside the package: are its compared rows the same at every
    site? A column, through the public Context only (pick, later, rows)."""

    spec = divtrace.Spec(columns=("b_again_same",))

    def __init__(self) -> None:
        self.first: dict[str, torch.Tensor] = {}
        self.same: dict[str, bool] = {}

    def hooks(self) -> divtrace.Hooks:
        return divtrace.Hooks(site=self.keep, after=self.again, passes=1)

    def keep(self, ctx: divtrace.Context, measured: divtrace.Measured, tensor: torch.Tensor,
             rows: torch.Tensor) -> None:
        self.first[measured.site.key] = ctx.pick(tensor).clone()

    def again(self, ctx: divtrace.Context) -> None:
        for key, rows in ctx.rows(label="run b again").items():
            if key in self.first:
                self.same[key] = bool(torch.equal(rows, self.first[key]))

    def fill(self, rows: list[dict[str, Any]], view: divtrace.TableView) -> None:
        for row in rows:
            if row["site"] in self.same:
                row["b_again_same"] = self.same[row["site"]]


def test_a_probe_reruns_run_b_through_the_context() -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)
    result = divtrace.compare(model, x, samples=[2, 5], explain=[Again()], progress=False)
    table = result.table
    assert table["b_again_same"].notna().all()
    assert table["b_again_same"].all()

    class Other(Again):  # the other rows given other values: a mixing model's rows move
        def again(self, ctx: divtrace.Context) -> None:
            batch, _ = ctx.plan.batch.replaced([2, 5])
            for key, rows in ctx.rows(batch).items():
                if key in self.first:
                    self.same[key] = bool(torch.equal(rows, self.first[key]))

    class Centred(nn.Module):  # each row less the batch's mean: rows depend on the others
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h - h.mean(0, keepdim=True)

    mixing = nn.Sequential(nn.Linear(16, 8), Centred()).eval()
    moved = divtrace.compare(mixing, x, samples=[2, 5], explain=[Other()],
                             progress=False).table.set_index("site")
    assert bool(moved.loc["0", "b_again_same"])  # the Linear's rows are their own
    assert not bool(moved.loc["1", "b_again_same"])  # the centred ones moved with the others


class Zeroed(divtrace.Kind):
    """The batched run against the split run, the independence test's other samples set
    to zero (the kind lays out the test's passes)."""

    name = "zeroed"

    def held(self, plan: Any, group: list[int]) -> Any:
        (x,) = plan.batch.leaves
        x = x.clone()
        x[[row for row in range(len(x)) if row not in group]] = 0
        return replace(plan.batch, leaves=(x,)), []


def test_a_kind_lays_out_the_independence_tests_passes() -> None:
    class Centred(nn.Module):  # each row less the batch's mean: rows depend on the others
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h - h.mean(0, keepdim=True)

    torch.manual_seed(0)
    x = torch.randn(6, 16)
    mixing = nn.Sequential(nn.Linear(16, 8), Centred()).eval()
    seen: list[torch.Tensor] = []
    hook = mixing.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    try:
        result = divtrace.compare(mixing, x, samples=[2, 5], kind=Zeroed, progress=False)
    finally:
        hook.remove()
    held = [t for t in seen if len(t) == 6 and t.dtype == x.dtype and not t.equal(x)]
    assert held, "no pass of the independence test ran on the kind's input"
    for batch in held:  # the held rows kept (a compared sample's), every other row zero
        kept = [row for row in range(6) if batch[row].any()]
        assert kept, "every row zero"
        assert set(kept) <= {2, 5}
        assert batch[kept].equal(x[kept])
    table = result.table.set_index("site")
    assert not bool(table.loc["0", "depends_on_others"])
    assert bool(table.loc["1", "depends_on_others"])
    assert result.meta.kind == "zeroed"
    assert result.verdict == "not rounding"
