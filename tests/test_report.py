"""Summary, HTML, files and plots."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from matplotlib.colors import to_rgba

import divtrace
from tests import models


@pytest.fixture
def diverging() -> divtrace.Comparison:
    return divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False)


@pytest.fixture
def identical() -> divtrace.Comparison:
    return divtrace.compare(models.elementwise_model(), torch.randn(6, 16), progress=False)


def test_summary_names_the_first_divergence_and_the_output(diverging) -> None:
    text = diverging.summary()
    assert "Divergence first appears at '3' (OrderedLinear), after 3 bit-identical" in text
    assert "At the output, rel_l2 is" in text
    assert "4 of 7 compared sites are bit-identical" not in text  # 3 before, none after
    assert "3 of 7 compared sites are bit-identical" in text
    assert "passes the closeness test at torch.testing.assert_close's default float32" in text
    assert re.search(r"argmax differs between the runs for \d of 6 samples", text)


def test_summary_counts_argmax_flips() -> None:
    class Logits(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # class 0 wins in the batch, class 1 when alone
            if x.shape[0] > 1:
                return torch.stack([x[:, 0] + 1, x[:, 0]], 1)
            return torch.stack([x[:, 0], x[:, 0] + 1], 1)

    result = divtrace.compare(Logits(), torch.randn(5, 2), progress=False)
    assert "argmax differs between the runs for 5 of 5 samples" in result.summary()
    assert "fails the closeness test" in result.summary()


def test_summary_when_identical(identical) -> None:
    assert "All 6 compared sites are bit-identical" in identical.summary()
    assert identical.first_divergence is None


def test_repr_is_short(diverging, identical) -> None:
    assert repr(diverging).startswith("<divtrace.Comparison: 7 sites, first divergence at '3'")
    assert "no divergence" in repr(identical)
    assert "\n" not in repr(diverging)


def test_html_shows_roles_and_the_options_columns() -> None:
    result = divtrace.compare(models.variant_mlp(), torch.randn(6, 16), progress=False,
                              explain=["local", divtrace.Repeat(1)])
    page = result._repr_html_()
    assert ">role</th>" in page
    assert ">source</td>" in page
    assert ">local_rel_l2</th>" in page
    assert ">adds_error</th>" in page
    assert ">noise_mismatch</th>" in page
    compact = page.split("<details>")[0]
    assert "b_err_fp64" not in compact  # truth was not asked for


def row_kinds(html: str) -> list[str]:
    """The kind of each table row: the class of its first cell."""
    return re.findall(r'<td[^>]*class="data row\d+ col0 (\w+)"', html)


def test_html_folds_identical_runs_and_highlights_the_first(diverging) -> None:
    page = diverging._repr_html_()
    compact, full = page.split("<details>")
    assert row_kinds(compact) == ["collapsed", "first", "diverged", "diverged", "diverged"]
    assert "⋯ 3 bit-identical sites: 0 … 2" in compact
    assert row_kinds(full) == ["identical"] * 3 + ["first"] + ["diverged"] * 3
    assert "All 7 sites, every column" in full
    assert 'class="verdict rounding"' in page
    assert "Divergence first appears" in page


def test_html_falls_back_to_text(diverging, monkeypatch) -> None:
    from divtrace.report import html

    def broken(*_args: object) -> str:
        raise RuntimeError("no")

    monkeypatch.setattr(html, "fragment", broken)
    assert diverging._repr_html_().startswith("<pre>Verdict: rounding")


def test_files(diverging, tmp_path: Path) -> None:
    csv = diverging.to_csv(tmp_path / "t.csv")
    back = pd.read_csv(csv)
    assert list(back.columns) == list(divtrace.COLUMNS)
    assert list(back["site"].astype(str)) == list(diverging.table["site"])
    saved = diverging.save(tmp_path / "t.json")
    doc = json.loads(saved.read_text())  # one JSON: the saved format, readable as it is
    assert doc["meta"]["batch_size"] == 6
    assert doc["summary"] == diverging.summary()
    table = dict(zip(doc["table"]["columns"], doc["table"]["data"], strict=True))
    assert table["site"][3] == "3"
    assert table["mismatch"][3] > 0
    assert len(doc["samples"]["data"][0]) == 7 * 6
    assert divtrace.load(saved).table.equals(diverging.table)
    page = diverging.to_html(tmp_path / "t.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3  # snowball, per-sample heatmap, where error enters
    assert base64.b64decode(images[0]).startswith(b"\x89PNG")
    assert "http" not in page.replace("charset", "")  # nothing fetched from outside
    for shown in (">torch</td>", ">divtrace</td>", "matmul_precision="):
        assert shown in page  # the environment and each run's flags (a CPU run: no CUDA's)
    assert "tf32_matmul=" not in page
    assert doc["meta"]["environment"]["torch"] == torch.__version__
    assert set(doc["meta"]["settings"]) == {"a", "b"}


def lane_of(ax) -> object:
    """The lane of bit-identical sites drawn beside ``ax``."""
    return next(a for a in ax.figure.axes if a is not ax and "bit-identical" in
                [t.get_text() for t in (*a.get_yticklabels(), *a.get_xticklabels())])


def test_snowball_plot(diverging) -> None:
    fig, ax = plt.subplots()
    try:
        assert diverging.plot(ax=ax) is ax
        assert ax.get_yscale() == "log"
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert {"OrderedLinear", "Hardtanh", "Scale"} <= set(labels)
        assert "first divergence: 3" in labels
        values = [y for c in ax.collections for _, y in c.get_offsets()]
        assert len(values) == 3  # the diverged leaves, all above zero
        assert min(values) > 0
        lane = lane_of(ax)
        identical = [y for c in lane.collections for _, y in c.get_offsets()]
        assert identical == [0, 0, 0]  # the bit-identical leaves: in the lane, not as numbers
        assert [t.get_text() for t in lane.get_xticklabels()] == ["0", "1", "2", "3", "4", "5"]
    finally:
        plt.close(fig)
    with pytest.raises(divtrace.DivtraceValueError, match="choose one of rel_l2"):
        diverging.plot(metric="cosine")


def test_an_identical_comparison_says_so_in_its_plot(identical) -> None:
    fig, ax = plt.subplots()
    try:
        identical.plot(ax=ax)
        assert ax.get_yscale() == "linear"  # no number drawn for zero
        assert any("bit-identical in both runs" in t.get_text() for t in ax.texts)
        assert sum(len(c.get_offsets()) for c in lane_of(ax).collections) == 5
    finally:
        plt.close(fig)


def test_sample_heatmap(diverging) -> None:
    fig, ax = plt.subplots()
    try:
        assert diverging.plot_samples(ax=ax) is ax
        image = ax.get_images()[0]
        assert image.get_array().shape == (6, 6)  # samples × leaf sites
        grey = to_rgba("0.88")
        assert image.cmap.get_under() == pytest.approx(grey)
        low, high = image.get_clim()
        assert high - low >= 2  # at least two decades: noise is not stretched over the scale
    finally:
        plt.close(fig)


def test_overlay(diverging, identical) -> None:
    fig, ax = plt.subplots()
    try:
        assert divtrace.overlay([diverging, identical], ["mlp", "elementwise"], ax=ax) is ax
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert f"mlp (6 sites; {diverging.verdict})" in labels
        assert "elementwise (5 sites; identical)" in labels
        assert len(ax.get_lines()) == 2
        rows = sorted({y for c in lane_of(ax).collections for _, y in c.get_offsets()})
        assert rows == [0, 1]  # each curve's identical sites in a row of the lane
    finally:
        plt.close(fig)
    with pytest.raises(divtrace.DivtraceValueError, match="one label per comparison"):
        divtrace.overlay([diverging], ["a", "b"])


@pytest.mark.slow
def test_the_demo_runs_and_writes_its_files(tmp_path: Path) -> None:
    from divtrace import demo

    assert demo.main(["--out", str(tmp_path), "--batch", "8", "--size", "32",
                      "--device", "cpu"]) == 0
    written = {p.name for p in tmp_path.iterdir()}
    assert {"summary.txt", "snowball.png", "vgg11.json", "vgg11_features.html"} <= written
    summary = (tmp_path / "summary.txt").read_text()
    assert "Verdict:" in summary
    assert "local=True" not in summary  # sentences name explain=, not removed keywords
