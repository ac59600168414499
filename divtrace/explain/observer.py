"""The observer check: does observing the model change what it computes?"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from divtrace.align.sites import ROOT, flatten_output, site_key
from divtrace.align.status import Status, comparable
from divtrace.errors import DivtraceTypeError
from divtrace.explain.context import Context
from divtrace.explain.probe import Explained, Hooks, Judged, Probe, Spec
from divtrace.measure.block import bit_equal
from divtrace.measure.measured import Measured

__all__ = ["HOOK_SENSITIVE", "Observer"]

#: Modules whose code path changes when a module has hooks: PyTorch turns the fast path
#: of ``nn.TransformerEncoderLayer`` off whenever any of its modules has a hook.
HOOK_SENSITIVE: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer,)


class Observer(Probe):
    """``"observer"`` (by default for models with :data:`HOOK_SENSITIVE` modules): one
    more pass of the measured run without any hook; its output must be bit-identical to
    the observed one, else the figures describe another code path than the plain one."""

    spec: ClassVar[Spec] = Spec(name="observer", default=True)

    def __init__(self, always: bool = True) -> None:
        """``always``: check every model (False, the default probe: only models with
        :data:`HOOK_SENSITIVE` modules)."""
        if not isinstance(always, bool):
            raise DivtraceTypeError(f"Observer(always=...) must be True or False; got "
                                    f"{always!r}")
        self.always = always
        self.hooked: dict[str, torch.Tensor] = {}
        self.found: dict[str, Any] | None = None

    def check(self, model: nn.Module) -> bool:
        return self.always or any(isinstance(m, HOOK_SENSITIVE) for m in model.modules())

    def settings(self) -> dict[str, Any]:
        return {"always": self.always}

    def _on_site(self, ctx: Context, measured: Measured, tensor: torch.Tensor,
                rows: torch.Tensor) -> None:
        if measured.site.is_output and measured.status == Status.OK:
            self.hooked[measured.site.key] = ctx.store.pick(tensor).clone()

    def _after(self, ctx: Context) -> None:
        ctx.progress.stage("observer check (no hooks)")
        if self.hooked:  # the measured run took the whole batch: compare its output
            runner = ctx.b
            args, kwargs = runner.feed(*ctx.plan.batch.whole(copy=True))
            with runner.run.flags():
                output = runner.model(*args, **kwargs)
            plain = {site_key(ROOT, 0, path): ctx.store.pick(usable)
                     for path, t, opaque in flatten_output(output) if opaque is None
                     and not isinstance(usable := comparable(t), Status)}
            self.found = {"identical": True, "differs": {}}
            for key, hooked in self.hooked.items():
                other = plain.get(key)
                if other is not None and not bit_equal(hooked, other):
                    error = torch.linalg.vector_norm((hooked - other).double())
                    scale = torch.linalg.vector_norm(other.double())
                    self.found["identical"] = False
                    self.found["differs"][key] = float(error / scale) if scale > 0 else (
                        float("inf"))
        ctx.progress.advance()

    def hooks(self) -> Hooks:
        return Hooks(site=self._on_site, after=self._after, passes=1)

    @classmethod
    def explain(cls, result: Judged) -> Explained:
        return Explained(tuple(cls._sentences(result)))

    def note(self) -> Any:
        return self.found

    @classmethod
    def _sentences(cls, result: Judged) -> list[str]:
        found = result.meta.notes.get("observer")
        if found is None:
            return []
        if found["identical"]:
            return ["Observer check: with divtrace's hooks the model's output is "
                    "bit-identical to a plain forward pass."]
        site, error = next(iter(found["differs"].items()))
        return [f"Observer effect: with divtrace's hooks the model's output differs from a "
                f"plain forward pass (rel_l2 {error:.3g} at '{site}'). Hooks change this "
                f"model's code path (PyTorch turns off the fast path of "
                f"nn.TransformerEncoderLayer when any of its modules has a hook), so the "
                f"figures describe the hooked path, not the kernels a plain forward runs; "
                f"modules= naming only modules outside such layers keeps their fast path."]
