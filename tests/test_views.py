"""The measured run's compared rows read in place (views, not copies) for small queued
sites: the figures of copies, and a pass measured again when a viewed tensor changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divtrace
from divtrace.measure import queue, views
from divtrace.measure.views import PassViews
from tests import models

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(autouse=True)
def _views_on_the_cpu_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Views are taken on CUDA only by default; here on the CPU too."""
    monkeypatch.setattr(views, "VIEW_DEVICES", frozenset({"cpu", "cuda"}))


class ChangesInBatch(nn.Module):
    """``fc1``'s output is changed in place after its hook, in passes of more than
    ``limit`` rows only (the batched run, not the split run): its rows, viewed, go
    stale."""

    def __init__(self, limit: int = 4) -> None:
        super().__init__()
        self.fc1 = models.OrderedLinear(8, 8, variant_from=2)
        self.fc2 = models.OrderedLinear(8, 8, variant_from=2)
        self.limit, self.calls = limit, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc1(x)
        y = self.fc2(torch.relu(h))
        if x.shape[0] > self.limit:
            h.mul_(2.0)
        return y + h


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each queued site's rows were viewed."""
    seen: list[bool] = []
    view = PassViews.view

    def counting(self: PassViews, *args: object) -> object:
        found = view(self, *args)  # type: ignore[arg-type]
        seen.append(found is not None)
        return found

    monkeypatch.setattr(PassViews, "view", counting)
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 2])
def test_viewed_rows_give_the_figures_of_copies(monkeypatch: pytest.MonkeyPatch,
                                                device: str, chunk: int) -> None:
    model = models.inplace_relu_model().to(device)
    x = torch.randn(8, 16, device=device)
    copied = divtrace.compare(model, x, samples=[0, 1], chunk=chunk, keep=True,
                              progress=False)  # (kept rows: copies)
    seen = _counted(monkeypatch)
    viewed = divtrace.compare(model, x, samples=[0, 1], chunk=chunk, progress=False)
    assert any(seen)
    assert not all(seen)
    assert viewed.table.equals(copied.table)
    assert viewed.samples.equals(copied.samples)


#: The queue's budget in bytes, and the batched passes: with 1 byte every site is measured
#: as it is queued (before the change: one pass); with 1 200 the queue is flushed at the
#: model's output, after the change (found there); by default at the end of the pass.
BUDGETS = [(1, 1), (1200, 2), (None, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("budget", "batched"), BUDGETS, ids=["each", "flush", "end"])
def test_a_viewed_tensor_changed_in_place_measures_the_pass_again(
        monkeypatch: pytest.MonkeyPatch, device: str, budget: int | None,
        batched: int) -> None:
    if budget is not None:
        monkeypatch.setattr(queue, "_MIN_BUDGET", budget)
    model = ChangesInBatch().to(device).eval()
    x = torch.randn(8, 8, device=device)
    copied = divtrace.compare(model, x, samples=[0, 1], keep=True, progress=False)
    assert model.calls == 3  # two split passes, one batched pass
    model.calls = 0
    seen = _counted(monkeypatch)
    viewed = divtrace.compare(model, x, samples=[0, 1], progress=False)
    assert model.calls == 2 + batched  # measured again, with copies, after a change
    assert seen.count(True) >= 1
    assert seen[-1] is (batched == 1)  # the last pass copied, after a change
    assert viewed.table.equals(copied.table)
    assert viewed.samples.equals(copied.samples)
    fc1 = viewed.table.set_index("site").loc["fc1"]
    assert fc1["status"] == "ok"
    assert fc1["mismatch"] > 0


@pytest.mark.parametrize("where", ["not one run", "on the CPU", "over the bytes"])
def test_no_views(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    if where == "on the CPU":
        monkeypatch.setattr(views, "VIEW_DEVICES", frozenset({"cuda"}))
    if where == "over the bytes":  # rows of 8 × 16 float32 at the first site
        monkeypatch.setattr(views, "VIEW_BYTES", 8 * 16 * 4 - 1)
    seen = _counted(monkeypatch)
    divtrace.compare(models.variant_mlp(), torch.randn(8, 16),
                     samples=[1, 3] if where == "not one run" else [0, 1], progress=False)
    assert seen
    assert not any(seen)
