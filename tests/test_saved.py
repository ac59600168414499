"""Saved results, diffs, the CI assertions and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import divtrace
import divtrace.testing
from tests import models


def test_a_comparison_round_trips_exactly(tmp_path: Path) -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)
    result = divtrace.compare(model, x, explain=["local", "fp64", divtrace.Repeat(1), "kernels"],
                              ops=True, progress=False)
    loaded = divtrace.load(result.save(tmp_path / "run.json"))
    assert isinstance(loaded, divtrace.Comparison)
    assert loaded.table.equals(result.table)
    assert list(loaded.table.dtypes) == list(result.table.dtypes)
    assert loaded.per_sample.equals(result.per_sample)
    assert loaded.meta == result.meta
    assert loaded.summary() == result.summary()
    assert loaded.verdict == result.verdict
    assert len(loaded.plot().lines) == len(result.plot().lines)
    raw = (tmp_path / "run.json").read_text()
    assert "NaN" not in raw.replace('"NaN"', "")  # strict JSON: specials are strings
    doc = json.loads(raw)
    assert (doc["format"], doc["version"], doc["kind"]) == ("divtrace", 2, "comparison")


def test_sweeps_and_generations_round_trip(tmp_path: Path) -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)
    found = divtrace.sweep(model, x, {"dtype": [torch.float64]}, a=divtrace.Run(),
                           progress=False)
    back = divtrace.load(found.save(tmp_path / "sweep.json"))
    assert isinstance(back, divtrace.Sweep)
    assert back.table.equals(found.table)
    assert back.comparisons["dtype=float64"].table.equals(
        found.comparisons["dtype=float64"].table)
    sizes = divtrace.sweep_batch(model, x, progress=False)
    again = divtrace.load(sizes.save(tmp_path / "sizes.json"))
    assert isinstance(again, divtrace.BatchSweep)
    assert again.table.equals(sizes.table)
    assert again.onset.equals(sizes.onset)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    lm = transformers.GPT2LMHeadModel(config).eval()
    generation = divtrace.compare_generate(lm, [torch.tensor([1, 2, 3]), torch.tensor([4])],
                                           max_new_tokens=3, eos_token_id=None,
                                           progress=False)
    loaded = divtrace.load(generation.save(tmp_path / "generation.json"))
    assert isinstance(loaded, divtrace.Generation)
    assert loaded.table.equals(generation.table)
    assert loaded.summary() == generation.summary()
    with pytest.raises(divtrace.DivtraceValueError, match="without its model"):
        loaded.at(0)


def _results(tmp_path: Path) -> list[divtrace.Result]:
    """One result of every sort, each made on the smallest case that has it."""
    model, x = models.variant_mlp(), torch.randn(8, 16)
    found = divtrace.compare(model, x, progress=False)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    pair = (torch.randn(8, 4), torch.randn(8, 1))
    mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    results: list[divtrace.Result] = [
        found, found.remedies(progress=False),
        divtrace.sweep(model, x, {"dtype": [torch.float64]}, a=divtrace.Run(), progress=False),
        divtrace.sweep_batch(model, x, progress=False),
        divtrace.compare_backward(net, pair, mse, chunk=2, progress=False)]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)).eval()
    results.append(divtrace.compare_generate(
        lm, [torch.tensor([1, 2, 3]), torch.tensor([4])], max_new_tokens=3,
        eos_token_id=None, progress=False))
    return results


def test_every_result_is_one_family(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    results = _results(tmp_path)
    assert len({type(r) for r in results}) == 6
    for result in results:
        sort = type(result)
        assert isinstance(result, divtrace.Result)
        # the shared faces are written once, in Result: no sort writes its own
        assert not {"save", "to_html", "_repr_html_", "diff"} & set(vars(sort)), sort
        back = divtrace.load(result.save(tmp_path / f"{sort.document}.json"))
        assert type(back) is sort
        assert back.summary() == result.summary()
        assert back.rows().equals(result.rows()), sort
        assert list(back.rows().columns) == list(divtrace.report.result.ROWS)
        assert back.rows()["site"].is_unique, sort
        same = result.diff(back)
        assert same.changed.empty, (sort, same.changed)
        assert len(same.table) == len(result.rows())
        assert same.plot() is not None
        page = result.to_html(tmp_path / f"{sort.document}.html").read_text()
        assert page.startswith("<!DOCTYPE html>")
        assert f"<h1>{sort.title}</h1>" in page
        shown = result._repr_html_()
        assert result.summary().splitlines()[0][:40].replace("'", "&#x27;") in shown
    with pytest.raises(divtrace.DivtraceTypeError, match="of one sort"):
        divtrace.diff(results[0], results[2])
    assert all(str(c).endswith("×") for c in results[2].sites["cost"])  # a sweep's costs


def test_a_diff_of_two_backward_comparisons_names_what_moved(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    pair = (torch.randn(8, 4), torch.randn(8, 1))
    mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    before = divtrace.compare_backward(net, pair, mse, chunk=2, progress=False)
    doubled = lambda m, b: 2 * torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    after = divtrace.compare_backward(net, pair, doubled, chunk=2,
                                      weight=lambda part: 1.0, progress=False)
    found = divtrace.diff(before, after)
    assert not found.changed.empty
    said = found.summary()
    assert "b: verdict not rounding" in said
    assert "the first is 'loss:loss': rel_l2 ×" in said  # no module type, no "()"
    assert "execution order" not in said  # a backward comparison's rows are not executed
    assert found.plot().get_title().startswith("divtrace: rel_l2 by row, 2 results")
    assert set(found.table["site"]) == set(before.rows()["site"])


def test_files_that_are_not_divtraces_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(divtrace.DivtraceValueError, match="not a file divtrace saved"):
        divtrace.load(other)
    newer = tmp_path / "newer.json"
    newer.write_text('{"format": "divtrace", "version": 99, "kind": "comparison"}')
    with pytest.raises(divtrace.DivtraceValueError, match="newer divtrace"):
        divtrace.load(newer)


def test_a_diff_names_the_first_site_that_changed(tmp_path: Path) -> None:
    x = torch.randn(8, 16)
    before = divtrace.compare(models.variant_mlp(variant_from=100), x, progress=False)
    after = divtrace.compare(models.variant_mlp(variant_from=2), x, progress=False)
    assert before.verdict == "identical"
    found = divtrace.diff(divtrace.load(before.save(tmp_path / "a.json")), after)
    table = found.table.set_index("site")
    assert table.loc["3", "change"] == "now diverges"
    assert table.loc["0", "change"] == ""
    assert found.changed["site"].iloc[0] == "3"
    assert "the first in execution order is '3'" in found.summary()
    assert before.diff(before).changed.empty
    ax = found.plot()
    assert ax.get_legend() is not None
    other = divtrace.compare(models.ReusedActivation().eval(), torch.randn(8, 16),
                             progress=False)
    apart = divtrace.diff(before, other).table
    assert {"only in a", "only in b"} <= set(apart["change"])


def test_assert_batch_invariant() -> None:
    torch.manual_seed(0)
    invariant = divtrace.testing.assert_batch_invariant(models.variant_mlp(100),
                                                        torch.randn(8, 16), exact=True)
    assert invariant.verdict == "identical"
    rounding = models.variant_mlp(2)
    assert divtrace.testing.assert_batch_invariant(rounding, torch.randn(8, 16)).verdict == (
        "rounding")
    with pytest.raises(AssertionError, match=r"expected bit-identical runs, got rounding"
                                             r"(.|\n)*First offending site: '3'"):
        divtrace.testing.assert_batch_invariant(rounding, torch.randn(8, 16), exact=True)
    with pytest.raises(AssertionError, match="got not rounding"):
        divtrace.testing.assert_batch_invariant(models.BranchOnBatch().eval(),
                                                torch.randn(8, 16))


class WithTable(torch.nn.Module):
    """A layer, and an embedding of fixed positions: a site without the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.table = torch.nn.Embedding(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.table(torch.arange(3)).sum(0)


def test_a_site_compared_in_neither_run_is_no_change(tmp_path: Path) -> None:
    result = divtrace.compare(WithTable().eval(), torch.randn(6, 4), progress=False)
    table = result.table.set_index("site")
    assert table.loc["table", "status"] == "unbatched"
    found = divtrace.diff(result, result).table.set_index("site")
    assert found.loc["table", "change"] == ""
    assert found["rel_l2_ratio"].isna().loc["table"]
    divtrace.testing.assert_matches_saved(result, result.save(tmp_path / "same.json"))


def test_assert_matches_saved(tmp_path: Path) -> None:
    x = torch.randn(8, 16)
    saved = divtrace.compare(models.variant_mlp(100), x, progress=False).save(
        tmp_path / "before.json")
    divtrace.testing.assert_matches_saved(
        divtrace.compare(models.variant_mlp(100), x, progress=False), saved)
    with pytest.raises(AssertionError, match=r"'3': now diverges"):
        divtrace.testing.assert_matches_saved(
            divtrace.compare(models.variant_mlp(2), x, progress=False), saved)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "divtrace", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "target.py").write_text(textwrap.dedent("""
        import torch
        def build():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()).eval()
            return model, torch.randn(8, 256)
        def invariant():
            return torch.nn.Sequential(torch.nn.Tanh()).eval(), torch.randn(8, 4)
    """))
    done = cli("compare", "target.py:build", "--json", "a.json", "--csv", "a.csv",
               "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Verdict: ")
    assert (tmp_path / "a.csv").exists()
    assert isinstance(divtrace.load(tmp_path / "a.json"), divtrace.Comparison)
    strict = cli("compare", "target.py:build", "--fail-on", "divergence", "--no-progress",
                 cwd=tmp_path)
    assert strict.returncode == (0 if "Verdict: identical" in done.stdout else 1)
    quiet = cli("compare", "target.py:invariant", "--fail-on", "divergence",
                "--no-progress", cwd=tmp_path)
    assert quiet.returncode == 0
    assert "Verdict: identical" in quiet.stdout
    cli("compare", "target.py:invariant", "--json", "b.json", "--no-progress", cwd=tmp_path)
    shown = cli("show", "a.json", cwd=tmp_path)
    assert shown.returncode == 0
    assert shown.stdout.splitlines()[0] == done.stdout.splitlines()[0]
    same = cli("diff", "a.json", "a.json", "--fail-on-change", cwd=tmp_path)
    assert same.returncode == 0
    assert "No site changed" in same.stdout
    changed = cli("diff", "a.json", "b.json", "--fail-on-change", cwd=tmp_path)
    assert changed.returncode == 1
    env = cli("env", cwd=tmp_path)
    assert json.loads(env.stdout)["torch"] == torch.__version__
    missing = cli("compare", "nowhere.py:build", cwd=tmp_path)
    assert missing.returncode == 2
    assert "no such file" in missing.stderr
    bad = cli("compare", "target.py", cwd=tmp_path)
    assert bad.returncode == 2
    assert "path/to/file.py:function" in bad.stderr
    helped = cli("compare", "--help", cwd=tmp_path)
    assert "--fail-on" in helped.stdout
    eager = cli("compare", "target.py:build", "--graphs", "false", "--json", "c.json",
                "--no-progress", cwd=tmp_path)
    assert eager.returncode == 0, eager.stderr
    assert divtrace.load(tmp_path / "c.json").meta.resources["graphs"] is False
    untested = cli("compare", "target.py:build", "--explain=-independence,-precision",
                   "--json", "d.json",
                   "--no-progress", cwd=tmp_path)
    assert untested.returncode == 0, untested.stderr
    assert divtrace.load(tmp_path / "d.json").meta.explain.get("independence") is None
    assert "rests on the size of the error alone" in untested.stdout.splitlines()[0]
    forced = cli("compare", "target.py:build", "--graphs", "true", cwd=tmp_path)
    assert forced.returncode == 2
    assert "Resources(graphs=True), but the split run cannot be replayed" in forced.stderr


@pytest.mark.slow
def test_the_guides_ci_example_runs_under_pytest(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    start = readme.index("# test_batch_invariance.py")
    example = readme[start:readme.index("```", start)]
    (tmp_path / "test_batch_invariance.py").write_text(example)
    (tmp_path / "mypackage.py").write_text(textwrap.dedent("""
        import torch
        def build_model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1))
    """))
    (tmp_path / "tests" / "data").mkdir(parents=True)
    sys.path.insert(0, str(tmp_path))
    try:
        from mypackage import build_model  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    torch.manual_seed(1)
    divtrace.compare(build_model().eval(), torch.randn(32, 3, 64, 64), progress=False).save(
        tmp_path / "tests" / "data" / "before-upgrade.json")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_batch_invariance.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
