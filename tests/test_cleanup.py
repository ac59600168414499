"""The user's model, data and process come back as they were."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import divtrace
from divtrace import compat
from tests import models


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, state: dict[str, torch.Tensor],
                     hooks: list[int], training: list[bool]) -> None:
    assert hook_counts(model) == hooks
    assert [m.training for m in model.modules()] == training
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
        assert value.dtype == state[key].dtype
        assert value.device == state[key].device
    assert torch.is_grad_enabled()


def test_observer_check_hooked_batched_output_equals_a_plain_forward() -> None:
    model = models.variant_mlp()
    x = torch.randn(8, 16)
    with torch.no_grad():
        plain = model(x)
    captured: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda m, a, out: captured.append(out.clone()))
    try:
        divtrace.compare(model, x, progress=False, explain=["-independence", "-precision"])
    finally:
        handle.remove()
    batched = [t for t in captured if t.shape[0] == 8]
    assert len(batched) == 1
    torch.testing.assert_close(batched[0], plain, rtol=0, atol=0)


def test_model_and_input_untouched_after_success() -> None:
    model = models.ReusedActivation()
    model.fc1.train()  # a mixed mode must survive too
    x = torch.randn(6, 16)
    x_before = x.clone()
    state, hooks = snapshot(model), hook_counts(model)
    training = [m.training for m in model.modules()]
    fired: list[str] = []
    handle = model.act.register_forward_hook(lambda m, a, o: fired.append("act"))
    hooks = hook_counts(model)
    divtrace.compare(model, x, progress=False)
    assert fired  # the user's own hook fired during compare()
    n = len(fired)
    model(x)
    assert len(fired) == n + 2  # ... and still fires after it
    handle.remove()
    hooks_after = hook_counts(model)
    assert hooks_after == [h - (m is model.act) for h, m in zip(hooks, model.modules(),
                                                                 strict=True)]
    assert_untouched(model, state, hooks_after, training)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode_is_restored(grad: bool) -> None:
    with torch.set_grad_enabled(grad):
        divtrace.compare(models.variant_mlp(), torch.randn(4, 16), progress=False)
        assert torch.is_grad_enabled() is grad


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_held_during_the_call_and_put_back(enabled: bool) -> None:
    seen: list[bool] = []

    class Watched(nn.Module):  # notes the collector's state in every pass
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(gc.isenabled())
            return self.fc(x)

    before = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        divtrace.compare(Watched(), torch.randn(4, 16), progress=False)
        assert gc.isenabled() is enabled
        with pytest.raises(KeyError):  # a pass that raises puts it back too
            divtrace.compare(models.Exploding().eval(), torch.randn(4, 16), progress=False)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if before else gc.disable)()
    assert seen
    assert not any(seen)


def test_the_calls_reference_cycles_never_reach_the_old_generations() -> None:
    model, x = models.variant_mlp(), torch.randn(8, 16)
    divtrace.compare(model, x, progress=False)  # warm-up: lazily created state
    gc.collect()
    result = divtrace.compare(model, x, progress=False)
    assert gc.collect() == 0  # nothing left for a full collection to find
    assert result.verdict is not None


def test_user_exception_keeps_its_type_and_gains_a_note() -> None:
    model = models.Exploding().eval()
    state, hooks = snapshot(model), hook_counts(model)
    training = [m.training for m in model.modules()]
    with pytest.raises(KeyError, match="boom") as info:
        divtrace.compare(model, torch.randn(4, 16), a=divtrace.Run(chunk=2), progress=False)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "batched run (B=4)" in notes
    assert "last site reached: act" in notes
    assert_untouched(model, state, hooks, training)


def test_exception_in_the_split_run_names_the_samples() -> None:
    class FailsAlone(models.Exploding):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            if x.shape[0] == 1 and x[0, 0] > 100:
                raise RuntimeError("bad sample")
            return self.act(h)

    x = torch.randn(5, 16)
    x[3, 0] = 1000.0
    model = FailsAlone().eval()
    with pytest.raises(RuntimeError, match="bad sample") as info:
        divtrace.compare(model, x, progress=False)
    notes = "\n".join(info.value.__notes__)
    assert "split run, chunk of rows 3:4 (samples [3])" in notes
    assert "last site reached: fc" in notes
    assert hook_counts(model) == [0, 0, 0]


def test_progress_bar_goes_to_stderr_and_switches_off(capsys: pytest.CaptureFixture[str]) -> None:
    divtrace.compare(models.variant_mlp(), torch.randn(4, 16), progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "divtrace" in captured.err
    divtrace.compare(models.variant_mlp(), torch.randn(4, 16), progress=False)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some lazy torch objects warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def test_repeated_calls_do_not_grow_memory() -> None:
    model = models.variant_mlp()
    x = torch.randn(8, 16)
    divtrace.compare(model, x, progress=False)  # warm-up: lazily created state
    before = live_tensors()
    for _ in range(15):
        result = divtrace.compare(model, x, progress=False)
        del result
    assert live_tensors() <= before


def test_hooks_are_removed_when_a_pass_raises_and_follow_the_users_own() -> None:
    model = models.variant_mlp()
    seen: list[torch.Tensor] = []

    def replace(_m: nn.Module, _a: object, out: torch.Tensor) -> torch.Tensor:
        return out * 0  # the user's hook replaces the output: that is what is observed

    def ours(_m: nn.Module, _a: object, _k: object, out: torch.Tensor) -> None:
        seen.append(out)

    handle = model.register_forward_hook(replace)
    before = hook_counts(model)
    kwargs_hooks: list[int] = []

    def run() -> None:
        with compat.forward_hooks([(model, ours)]):
            kwargs_hooks.append(len(model._forward_hooks_with_kwargs))
            model(torch.randn(2, 16))
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        run()
    assert kwargs_hooks == [1]
    handle.remove()
    assert len(seen) == 1
    assert not seen[0].any()
    assert hook_counts(model) == [h - (m is model) for h, m in zip(before, model.modules(),
                                                                   strict=True)]
    assert not model._forward_hooks_with_kwargs


class _Tied(nn.Module):
    """Shared submodule and weight, a parameter set to None, a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.again = self.head  # the same module under a second name
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.register_parameter("unused", None)


class _OwnListing(_Tied):
    """Lists its parameters its own way (as wrappers such as FSDP do)."""

    def named_parameters(self, *args: object,
                         **kwargs: object):  # type: ignore[no-untyped-def,override]
        return iter([("only", self.embed.weight)])


@pytest.mark.parametrize("model", [_Tied(), _OwnListing(), models.ReusedActivation()],
                         ids=["tied", "own-listing", "reused"])
def test_the_walk_lists_what_torchs_walks_list(model: nn.Module) -> None:
    from divtrace.plan.walk import Walk
    walk = Walk.of(model)
    assert [(n, id(m)) for n, m in walk.named] == [
        (n, id(m)) for n, m in model.named_modules()]
    assert [(n, id(p)) for n, p in walk.parameters] == [
        (n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(b)) for n, b in walk.buffers] == [
        (n, id(b)) for n, b in model.named_buffers()]
    assert walk.modules == list(model.modules())


def test_a_tied_model_comes_back_untouched() -> None:
    model = _Tied().eval()
    x = torch.randint(0, 5, (6, 3))
    state, hooks = snapshot(model), hook_counts(model)
    training = [m.training for m in model.modules()]
    with torch.no_grad():
        model.scratch.fill_(2.0)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        model.scratch.add_(1.0)  # a buffer the pass changes in place
        return model.again(model.norm(model.embed(ids).transpose(1, 2)).transpose(1, 2))

    model.forward = forward  # type: ignore[method-assign]
    divtrace.compare(model, x, progress=False)
    assert model.scratch.tolist() == [2.0, 2.0, 2.0]
    del model.forward
    assert_untouched(model, state, hooks, training)
