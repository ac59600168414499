"""A new user's first hour: common mistakes get the right fix, the command line keeps up
with compare()."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import divtrace
from divtrace.cli import main, parser
from divtrace.compare import KEYWORDS
from divtrace.words import sci
from tests import models


def _compare(x: object, **options: object) -> divtrace.Comparison:
    return divtrace.compare(torch.nn.Linear(4, 2).eval(), x, progress=False, **options)


def test_a_batch_from_a_tensor_dataset_is_a_list_of_one() -> None:
    batch = next(iter(DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8)))
    with pytest.raises(divtrace.DivtraceTypeError, match=r"x is a list of one tensor of "
                       r"shape \(8, 4\) .*: pass the tensor itself, x\[0\]"):
        _compare(batch)


def test_inputs_and_labels_from_a_loader() -> None:
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    batch = next(iter(DataLoader(data, batch_size=8)))
    with pytest.raises(divtrace.DivtraceTypeError, match=r"all with 8 rows \(a DataLoader's "
                       r"\[inputs, labels\]\?\): pass the model's input, x\[0\]"):
        _compare(batch)
    with pytest.raises(divtrace.DivtraceTypeError, match=r"x is a DataLoader; divtrace "
                       r"compares one batch: pass x=next\(iter\(loader\)\)"):
        _compare(DataLoader(data, batch_size=8))
    with pytest.raises(divtrace.DivtraceTypeError, match=r"x is a TensorDataset, a dataset"):
        _compare(data)
    with pytest.raises(divtrace.DivtraceTypeError, match=r"stack them into one batch"):
        _compare([torch.randn(4), torch.randn(4)])  # samples alike: a batch to stack


def test_a_cut_along_the_wrong_dimension_is_named() -> None:
    with pytest.raises(RuntimeError, match="channels") as found:
        divtrace.compare(torch.nn.Conv2d(3, 4, 3).eval(), torch.randn(8, 3, 16, 16),
                         batch_dim=1, progress=False)
    assert any("the inputs were cut along batch_dim=1 (B=3 there)" in note and
               "batch_dim=0 for [B, C, H, W] images" in note for note in found.value.__notes__)


def test_a_misspelt_keyword_gets_the_way_to_give_it() -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match=r"chunks= is given as "
                       r"chunk=...; sample= is not one \(did you mean "
                       r"samples=\?\)\. It takes samples, chunk, batch_dim"):
        _compare(torch.randn(3, 4), chunks=2, sample=[1])
    with pytest.raises(TypeError, match=r"keep= is given as resources=divtrace.Resources"):
        _compare(torch.randn(3, 4), keep=True)
    signature = inspect.signature(divtrace.compare)
    named = [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert tuple(named) == KEYWORDS


def test_the_command_line_has_each_of_compares_options() -> None:
    run = parser()._subparsers._group_actions[0].choices["compare"]  # type: ignore[union-attr]
    flags = {flag for action in run._actions for flag in action.option_strings}
    ways = {"samples": "--samples", "batch_dim": "--batch-dim", "modules": "--modules",
            "ops": "--ops", "explain": "--explain", "rtol": "--rtol", "atol": "--atol",
            "allow_train": "--allow-train", "a": "--a", "b": "--b", "chunk": "--chunk",
            "resources": "--offload", "progress": "--no-progress", "kind": "--kind"}
    assert set(ways) == set(KEYWORDS)
    assert set(ways.values()) <= flags
    assert {"--graphs", "--remedies", "--device", "--dtype"} <= flags


@pytest.fixture
def target(tmp_path: Path) -> str:
    (tmp_path / "target.py").write_text(textwrap.dedent("""
        import torch
        from tests import models
        def build():
            torch.manual_seed(0)
            return models.variant_mlp(), torch.randn(6, 16)
        def conv():
            torch.manual_seed(0)
            return torch.nn.Conv2d(3, 4, 3).eval(), torch.randn(4, 3, 8, 8)
        def other():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(16, 4)).eval(), \\
                torch.randn(6, 16)
    """))
    return str(tmp_path / "target.py")


def test_usage_errors_exit_2_with_the_fix(target: str, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    assert main(["compare", f"{target}:build", "--dtype", "fp17", "--no-progress"]) == 2
    assert "--dtype must name a floating dtype (float32, float, fp32, float16" in (
        capsys.readouterr().err)
    assert main(["compare", f"{target}:build", "--device", "nowhere", "--no-progress"]) == 2
    assert "is not a device name" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["compare", f"{target}:build", "--device", "cuda", "--no-progress"]) == 2
        assert "this machine has 0 CUDA devices" in capsys.readouterr().err
    assert main(["compare", f"{target}:build", "--dtype", "fp64", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("Verdict: ")


def test_a_model_that_raises_exits_3_and_spellings_are_named(
        target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", f"{target}:conv", "--batch-dim", "1", "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "divtrace: the inputs were cut along batch_dim=1 (B=3 there)" in err
    assert err.rstrip().splitlines()[-1].startswith("divtrace: error: the model raised ")
    assert main(["compare", f"{target}:build", "--a", "chunks=2", "--no-progress"]) == 2
    assert ("--a: Run() got unexpected keyword argument(s): chunks= is not one (did you "
            "mean chunk=?). It takes chunk, device, dtype") in capsys.readouterr().err
    with pytest.raises(divtrace.DivtraceTypeError, match=r"keep_rows= is not one \(did you "
                       r"mean keep=\?\)\. It takes keep, offload, graphs"):
        divtrace.Resources(keep_rows=True)
    with pytest.raises(SystemExit) as exited:
        main(["compare", f"{target}:build", "--chunks", "2", "--train"])
    assert exited.value.code == 2
    assert ("unrecognized arguments: --chunks 2 --train (--chunks is spelt --chunk N; "
            "--train is spelt --allow-train)") in capsys.readouterr().err


def test_chunk_is_spelt_one_way_in_every_face(target: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model, x = models.variant_mlp(variant_from=2), torch.randn(8, 16)
    given = divtrace.compare(model, x, a=divtrace.Run(chunk=2), progress=False)
    spelt = divtrace.compare(model, x, chunk=2, progress=False)
    assert spelt.table.equals(given.table)
    assert spelt.meta.a_chunk == given.meta.a_chunk == 2
    both = divtrace.compare(model, x, chunk=2, a=divtrace.Run(dtype=torch.float64),
                            progress=False)
    assert both.meta.a_chunk == 2
    assert str(both.meta.settings["a"]["dtype"]).endswith("float64")
    with pytest.raises(divtrace.DivtraceValueError, match=r"chunk=2 and a=Run\(chunk=4\) "
                       r"give run a two batch sizes"):
        divtrace.compare(model, x, chunk=2, a=divtrace.Run(chunk=4), progress=False)
    swept = divtrace.sweep(model, x, [divtrace.Run(dtype=torch.float64)], chunk=2,
                           a=divtrace.Run(), progress=False)
    assert next(iter(swept.comparisons.values())).meta.a_chunk == 2
    assert main(["compare", f"{target}:build", "--chunk", "2", "--no-progress",
                 "--json", str(tmp_path / "c.json")]) == 0
    assert divtrace.load(tmp_path / "c.json").meta.a_chunk == 2
    capsys.readouterr()


def test_a_batch_dim_no_site_has_is_questioned() -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), batch_dim=1,
                              progress=False)
    said = result.summary()
    assert ("Status unbatched: the tensor has no dimension of size B=16 at batch_dim=1; no "
            "site had one: is batch_dim right?") in said
    assert "no compared site could be tested, so it says nothing about the samples" in said
    assert "differ because" not in said


def test_the_independence_sentence_explains_only_a_difference_there_is() -> None:
    same = divtrace.compare(models.elementwise_model(), torch.randn(6, 16), progress=False)
    assert same.verdict == "identical"
    assert "No sample's result showed a dependence on the other samples." in same.summary()
    assert "differ" not in same.summary().split("Independence test")[1].split("\n")[0]
    apart = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)
    assert ("so what parts the batched run and the split run is the batch's shape, not the "
            "other samples' values") in apart.summary()


def test_train_mode_sentences_name_the_modules() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5),
                                torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.0))
    with pytest.raises(ValueError, match="more than 1 value per channel") as raised:
        divtrace.compare(model, torch.randn(6, 4), allow_train=True, progress=False)
    assert ("divtrace: '2' (BatchNorm1d) is in train mode, where a batch statistic needs two "
            "rows or more: split in chunks of 2 or more (a=divtrace.Run(chunk=2))") in (
        raised.value.__notes__[-1])
    result = divtrace.compare(model, torch.randn(6, 4), allow_train=True, progress=False,
                              a=divtrace.Run(chunk=2))
    assert result.meta.mixing == ("1 (Dropout)", "2 (BatchNorm1d)")  # p=0 draws nothing
    assert result.summary().startswith("Verdict: not rounding — the model ran in train mode "
                                       "(allow_train=True): 1 (Dropout), 2 (BatchNorm1d) make")
    assert "BatchNorm or Dropout" not in result.summary()
    assert divtrace.load(result.save(_tmp_json())).meta.mixing == result.meta.mixing


def _tmp_json() -> Path:
    import tempfile
    return Path(tempfile.mkdtemp()) / "train.json"


def test_diff_says_what_it_left_out_and_when_models_differ(
        target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = torch.randn(8, 16)
    wide = torch.nn.Sequential(*[models.OrderedLinear(16, 16, variant_from=2)
                                 for _ in range(24)]).eval()
    a = divtrace.compare(wide, x, progress=False).save(tmp_path / "a.json")
    narrow = torch.nn.Sequential(*[models.OrderedLinear(16, 16) for _ in range(24)]).eval()
    b = divtrace.compare(narrow, x, progress=False).save(tmp_path / "b.json")
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "(20 of the 25 changed sites shown; --all shows every one)" in out
    assert "two different models" not in out  # the same layers, other settings
    assert main(["diff", str(a), str(b), "--all"]) == 0
    assert "changed sites shown" not in capsys.readouterr().out
    main(["compare", f"{target}:other", "--json", str(tmp_path / "c.json"), "--no-progress"])
    capsys.readouterr()
    main(["diff", str(a), str(tmp_path / "c.json")])
    assert ("These look like comparisons of two different models: 2 shared site(s) hold "
            "another module type (first: '0', OrderedLinear in a, Tanh in b)") in (
        capsys.readouterr().out)


def test_the_sites_view_reads_as_figures_not_zeros() -> None:
    torch.manual_seed(0)
    result = divtrace.compare(models.variant_mlp(), torch.randn(8, 16), explain=["local"],
                              progress=False)
    view = result.sites
    assert list(view.columns[:8]) == ["site", "module_type", "status", "role", "mismatch",
                                      "rel_l2", "max_abs", "growth"]
    assert "local_rel_l2" in view.columns
    assert "depends_on_others" in view.columns
    assert "module" not in view.columns
    assert "scope" not in view.columns
    diverged = result.table["mismatch"] > 0
    for text, value in zip(view.loc[diverged, "rel_l2"], result.table.loc[diverged, "rel_l2"],
                           strict=True):
        assert text == f"{value:.2e}"  # never 0.000000
    assert all(t.endswith("%") and t != "0%" for t in view.loc[diverged, "mismatch"])
    assert len(result.table.columns) > len(view.columns)


def test_a_sweep_says_what_it_found() -> None:
    torch.manual_seed(0)
    found = divtrace.sweep(models.variant_mlp(), torch.randn(8, 16),
                           {"dtype": [torch.float32, torch.bfloat16, torch.float64]},
                           progress=False)
    assert repr(found) == (f"<divtrace.Sweep: 3 settings, "
                           f"{int((found.table['verdict'] == 'identical').sum())} bit-identical>")
    lines = found.summary().splitlines()
    same = (found.table["verdict"] == "identical").sum()
    assert lines[0].startswith(
        f"3 setting(s); bit-identical at every compared site under {same}: " if same else
        "3 setting(s); under none of them are the runs bit-identical")
    parted = found.table[found.table["verdict"] != "identical"]
    for row in parted.itertuples():
        assert any(line.startswith(f"{row.setting}: {row.verdict}") for line in lines)
    assert lines[-1].startswith("dtype=bfloat16: both runs compute in reduced precision")
    assert (found.table["cost"] > 0).all()
    float64 = found.table.set_index("setting").loc["dtype=float64"]
    if float64["verdict"] != "identical":
        assert f"its passes take {float64['cost']:.3g}× as long" in found.summary()
    shown = found._repr_html_()
    assert "<table" in shown
    for row in parted.itertuples():  # a tiny figure never reads 0 in the HTML
        assert f"<td>{sci(row.output_rel_l2)}</td>" in shown
        assert row.output_max_abs == 0 or f"<td>{sci(row.output_max_abs)}</td>" in shown
    import matplotlib

    matplotlib.use("Agg")
    assert found.plot().get_title().startswith("Sequential: the output's rel_l2 per setting")


def test_the_snowball_says_what_it_shows_and_keeps_each_types_colour() -> None:
    import matplotlib

    matplotlib.use("Agg")
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    first = divtrace.compare(models.variant_mlp(), x, progress=False)
    ax = first.plot()
    assert ax.get_title() == ("Sequential: rel_l2 by depth — batch of 8 vs passes of 1; "
                              f"verdict: {first.verdict}")
    labels = [line.get_label() for line in ax.get_lines()]
    assert "rounding budget (6.2e-05)" in labels
    assert "float32 unit roundoff (6e-08)" in labels

    def colours(axes: object) -> dict[str, tuple[float, ...]]:
        return {c.get_label(): tuple(c.get_facecolor()[0]) for c in axes.collections  # type: ignore[attr-defined]
                if c.get_label() and not c.get_label().startswith("_")
                and len(c.get_facecolor())}

    other = torch.nn.Sequential(torch.nn.Tanh(), models.OrderedLinear(16, 16, variant_from=2),
                                torch.nn.Hardtanh()).eval()
    second = colours(divtrace.compare(other, x, progress=False).plot())
    assert colours(ax)["OrderedLinear"] == second["OrderedLinear"]


def test_the_report_names_the_runs_and_the_flags_that_apply(tmp_path: Path) -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)
    page = result.to_html(tmp_path / "report.html").read_text()
    assert "a: split run (chunk=1)" in page
    assert "b: batched run (as is)" in page
    runs = page[page.index("<h2>Runs</h2>"):page.index("<h2>Environment</h2>")]
    assert "cudnn=" not in runs  # a CPU run: no cuDNN flags
    assert "matmul_precision=" in runs
    if not torch.cuda.is_available():
        assert "what torch was built with; no GPU on this machine" in page
    assert "the dtype&#x27;s default" in page or "the dtype's default" in page


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_readmes_python_blocks_run_and_print_what_it_says() -> None:
    import contextlib
    import io
    import re

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 3
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)
    shown = re.search(r"```text\n(.*?)```", readme, re.S)
    assert shown is not None
    first = shown.group(1).split("\n")[0]
    assert printed.getvalue().startswith(first.split(" — ")[0])  # "Verdict: ..."


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    import re

    for name in ("README.md", "docs/guide.md", "docs/verdict.md", "docs/gpu-results.md"):
        text = (ROOT / name).read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if not target.startswith("http"):
                assert ((ROOT / name).parent / target).exists(), (name, target)
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    prose = [line for line in readme.splitlines() if not line.startswith(("|", "  ", "Verdict"))]
    assert max(len(line) for line in prose) <= 100
    assert "seed" not in readme.replace("manual_seed", "")


def test_the_command_line_prints_figures_that_never_read_zero(
        target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    saved = tmp_path / "a.json"
    assert main(["compare", f"{target}:build", "--json", str(saved), "--no-progress"]) == 0
    for printed in (capsys.readouterr().out, (main(["show", str(saved)]),
                                              capsys.readouterr().out)[1]):
        lines = printed.splitlines()
        header = next(i for i, line in enumerate(lines) if line.split()[:3] == [
            "site", "module_type", "status"])
        rows = [line.split() for line in lines[header + 1:] if line.strip()]
        diverged = [row for row in rows if row[3] != "0%"]
        assert diverged  # the variant layer and after
        for row in diverged:
            assert row[3].endswith("%")  # mismatch as a percentage
            assert re.fullmatch(r"\d\.\d\de-\d\d", row[4])  # rel_l2 in scientific notation


def test_numpy_input_and_a_dtype_mismatch_get_the_fix() -> None:
    import numpy as np

    with pytest.raises(divtrace.DivtraceTypeError, match=r"x is a NumPy array of shape "
                       r"\(6, 4\); pass a tensor: torch.from_numpy\(x\)"):
        _compare(np.zeros((6, 4)))
    with pytest.raises(RuntimeError) as found:
        _compare(torch.randn(6, 4, dtype=torch.float64))
    assert ("divtrace: the input is float64 and the model's parameters are float32: cast "
            "one to the other (e.g. x.to(torch.float32))") in found.value.__notes__


def test_the_html_table_and_ratios_never_read_zero() -> None:
    from divtrace.report.html import styled
    from divtrace.words import readable

    frame = pd.DataFrame({"site": ["a"], "mismatch": [4e-5], "rel_l2": [3e-9],
                          "growth": [2.0712], "amplification": [float("inf")]})
    html = styled(frame, ["diverged"])
    assert "0.004%" in html
    assert "3.00e-09" in html
    assert "0.0%" not in html
    shown = readable(frame).iloc[0]
    assert (shown["growth"], shown["amplification"]) == ("2.07×", "inf")


def test_a_diff_names_the_settings_the_two_comparisons_differ_in() -> None:
    x = torch.randn(8, 16)
    per_sample = divtrace.compare(models.variant_mlp(), x, progress=False)
    in_fours = divtrace.compare(models.variant_mlp(), x, a=divtrace.Run(chunk=4),
                                progress=False)
    assert ("The two comparisons were made with other settings (run a's passes of 1 vs 4): "
            "some changes below may come from them.") in divtrace.diff(
        per_sample, in_fours).summary()
    again = divtrace.compare(models.variant_mlp(), x, progress=False)
    assert "other settings" not in divtrace.diff(per_sample, again).summary()
