"""Sites that hand on the very tensor of the site before them (a container and its last
child): copied and measured once, with exactly the figures each would get alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divtrace
from divtrace.errors import DivtraceWarning
from divtrace.plan.inputs import prepare_input
from divtrace.plan.samples import chunks_for
from divtrace.plan.selection import select_modules
from divtrace.record.graphs import GraphedRun
from divtrace.record.hooks import ModuleHooks
from divtrace.record.loop import drive
from divtrace.record.rows import RowStore
from tests import models
from tests.test_graphs import Rerun


def _nested() -> nn.Sequential:
    """Containers that hand on their last child's output; ``1.1`` (Identity) hands on
    ``1.0``'s; the batch-variant layer is ``1.0``."""
    return nn.Sequential(
        nn.Sequential(models.OrderedLinear(16, 32), nn.Hardtanh(-1.0, 1.0)),
        nn.Sequential(models.OrderedLinear(32, 8, variant_from=2), nn.Identity()),
    ).eval()


class Handing(nn.Module):
    """A layer, then what the model returns: the layer's output as it is while ``keep``
    says so for the batch (per pass), else the output plus one (a new tensor), or the
    output changed in place (``in_place``)."""

    def __init__(self, keep: object, in_place: bool = False) -> None:
        super().__init__()
        self.fc = models.OrderedLinear(4, 4, variant_from=2)
        self.keep, self.in_place = keep, in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.in_place:
            return h.add_(1.0)
        return h if self.keep(x) else h + 1.0  # type: ignore[operator]


def _record(model: nn.Module, x: torch.Tensor, samples: list[int], chunk: int = 1,
            graphed: GraphedRun | None = None) -> RowStore:
    store = RowStore(samples, 0)
    chunks = chunks_for(samples, chunk, len(x))
    recorder = ModuleHooks(select_modules(model, None))
    with torch.no_grad():
        if graphed is None:
            drive(model, recorder, store, prepare_input(x), chunks, lambda s, e: "pass")
        else:
            graphed.drive(model, recorder, store, prepare_input(x), chunks,
                          lambda s, e: "pass")
    return store


def _outputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every module's output on ``x``, copied in its hook (an independent recorder)."""
    found: dict[str, torch.Tensor] = {}
    handles = [module.register_forward_hook(
        lambda _m, _a, out, name=name: found.__setitem__(name or "(model)", out.clone()))
        for name, module in model.named_modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _expected_max_abs(model: nn.Module, x: torch.Tensor, samples: list[int]
                      ) -> dict[str, float]:
    """Per site, max |batched - split| over the compared samples, worked out alone."""
    batched = _outputs(model, x)
    alone = [_outputs(model, x[i:i + 1]) for i in samples]
    return {site: max(float((batched[site][i] - per[site][0]).abs().max())
                      for i, per in zip(samples, alone, strict=True))
            for site in batched}


def test_containers_share_the_rows_of_the_child_they_hand_on() -> None:
    model, x = _nested(), torch.randn(6, 16)
    store = _record(model, x, [0, 1, 4])
    assert store.aliases == {"0": "0.1", "1.1": "1.0", "1": "1.1", "(model)": "1"}
    rows = {key: stored.rows for key, stored in store.rows.items()}
    assert rows["(model)"] is rows["1"] is rows["1.1"] is rows["1.0"]
    assert rows["0"] is rows["0.1"] is not rows["0.0"]
    assert store.stored_bytes == 3 * (32 + 32 + 8) * 4  # the rows of 0.0, 0.1 and 1.0
    # the rows are each site's own, sample by sample
    for slot, sample in enumerate([0, 1, 4]):
        alone = _outputs(model, x[sample:sample + 1])
        for key, stored in store.rows.items():
            assert stored.rows is not None
            assert torch.equal(stored.rows[slot], alone[key][0]), key


def test_sites_handing_on_a_tensor_get_exactly_their_own_figures() -> None:
    model, x = _nested(), torch.randn(6, 16)
    result = divtrace.compare(model, x, samples=[0, 1, 4], progress=False,
                              resources=divtrace.Resources(keep=True))
    table = result.table.set_index("site")
    expected = _expected_max_abs(model, x, [0, 1, 4])
    assert table["max_abs"].to_dict() == pytest.approx(expected, rel=0, abs=0)
    assert table.loc["1.0", "max_abs"] > 0  # the batch-variant layer, handed on
    figures = [c for c in table.columns if c.startswith(("mismatch", "rel_l2", "max_"))]
    for key in ("1.1", "1", "(model)"):
        assert table.loc[key, figures].equals(table.loc["1.0", figures]), key
        for kept, alone in zip(result.pair(key), result.pair("1.0"), strict=True):
            assert torch.equal(kept, alone)


@pytest.mark.parametrize("chunk", [1, 2])
def test_a_site_that_stops_handing_on_gets_rows_of_its_own(chunk: int) -> None:
    # rows 0-1 hand the layer's output on, rows 2-3 do not, rows 4-5 do again; the
    # batched run does not (its rows are not all negative)
    model = Handing(lambda x: bool((x[:, 0] < 0).all())).eval()
    x = torch.randn(6, 4)
    x[:, 0] = torch.tensor([-1.0, -2.0, 1.0, 2.0, -1.0, -3.0])
    samples = list(range(6))
    store = _record(model, x, samples, chunk)
    assert "(model)" not in store.aliases
    held = store.rows["(model)"].rows
    assert held is not None
    assert held is not store.rows["fc"].rows
    with torch.no_grad():
        layer = torch.cat([model.fc(x[i:i + chunk]) for i in range(0, 6, chunk)])
    assert store.rows["fc"].rows is not None
    assert torch.equal(store.rows["fc"].rows, layer)
    assert torch.equal(held, layer + torch.tensor([0, 0, 1, 1, 0, 0])[:, None])
    table = divtrace.compare(model, x, a=divtrace.Run(chunk=chunk),
                             progress=False).table.set_index("site")
    expected = _expected_max_abs(model, x, samples) if chunk == 1 else None
    if expected is not None:
        assert table["max_abs"].to_dict() == pytest.approx(expected, rel=0, abs=0)
    assert table.loc["(model)", "max_abs"] > table.loc["fc", "max_abs"]


def test_a_tensor_handed_on_in_one_run_only_is_measured_on_its_own() -> None:
    # per sample the model hands its layer's output on; the whole batch gets a new tensor
    model = Handing(lambda x: len(x) == 1).eval()
    x = torch.randn(5, 4)
    assert _record(model, x, [0, 2]).aliases == {"(model)": "fc"}
    table = divtrace.compare(model, x, samples=[0, 2], progress=False).table
    expected = _expected_max_abs(model, x, [0, 2])
    assert table.set_index("site")["max_abs"].to_dict() == pytest.approx(expected, rel=0,
                                                                         abs=0)
    assert expected["(model)"] > 0.5  # the batched run's +1


def test_a_tensor_changed_in_place_is_not_handed_on() -> None:
    model = Handing(None, in_place=True).eval()
    x = torch.randn(4, 4)
    store = _record(model, x, [0, 1, 2])
    assert store.aliases == {}
    with torch.no_grad():
        layer = torch.cat([model.fc(x[i:i + 1]) for i in range(3)])
    assert torch.equal(store.rows["fc"].rows, layer)  # type: ignore[arg-type]
    assert torch.equal(store.rows["(model)"].rows, layer + 1)  # type: ignore[arg-type]


class HandsOnOnce(nn.Module):
    """Hands its layer's output on in its first pass only (a graph's capture sees it
    make a new tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.passes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        h = self.fc(x)
        return h if self.passes == 1 else h + 1.0


def test_a_captured_pass_that_stops_handing_on_stops_the_graph() -> None:
    model = HandsOnOnce().eval()
    x = torch.randn(10, 4)
    graphed = GraphedRun("auto", make_graph=Rerun)
    with pytest.warns(DivtraceWarning, match="no longer hands on the tensor"):
        store = _record(model, x, list(range(10)), graphed=graphed)
    assert graphed.outcome is not None
    assert graphed.outcome.replayed == 0
    with torch.no_grad():
        layer = torch.cat([model.fc(x[i:i + 1]) for i in range(10)])
    assert torch.equal(store.rows["fc"].rows, layer)  # type: ignore[arg-type]
    # the first pass's rows as it handed them on, the others its own, put back eagerly
    assert torch.equal(store.rows["(model)"].rows,  # type: ignore[arg-type]
                       torch.cat([layer[:1], layer[1:] + 1]))
