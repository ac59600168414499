"""The settings and environment of a comparison, as a typed record that round-trips
through JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from divtrace.errors import moved

__all__ = ["Meta"]


@dataclass(frozen=True)
class Meta:
    """What a comparison was run with.

    Attributes:
        batch_size: B, the rows of the batch.
        a_chunk: Run a's batch size (B when it takes the whole batch).
        samples: The compared rows.
        batch_dim: The batch dimension.
        a_passes: Run a's passes.
        stored_bytes: Bytes of run a's rows that were kept.
        rtol: The given relative tolerance (None: the dtype's default).
        atol: The given absolute tolerance (None: the dtype's default).
        train_mode: The model ran with sample-mixing modules in train mode.
        mixing: Those modules, each as ``"name (Type)"`` (empty in files saved before it).
        torch: The torch version.
        explain: The probes that ran, by name, each with its settings (``{"repeat":
            {"times": 2}, ...}``).
        ops: Op sites: False, True or ``"only"``.
        resources: ``keep``, ``offload`` and ``graphs``, as given (:class:`Resources`).
        names: How sentences name runs a and b (``"split run"``, ``"batched run"`` for
            the default pair).
        runs: The labels of runs a and b, when they were given (else None).
        flips: Per output site of 2-D logits: whether each sample's argmax differs.
        random_draws: A pass drew random numbers (allowed by ``allow_train=True``).
        output_type: The type of the model's output when it held no tensor (else None).
        graphed: Per chunked run (``a``, ``b``): ``requested`` (the ``graphs`` resource),
            ``passes``, ``replayed`` (passes replayed from a CUDA graph), ``lanes``
            (passes each replay ran side by side), ``pool_bytes`` (the graph's own
            memory), ``capture_s`` and ``reason`` (why passes ran eagerly, or None).
        notes: What probes found that is not a column, by probe.
        environment: divtrace, torch, CUDA, cuDNN, GPUs and driver versions.
        settings: Per run (``a``, ``b``): its label, device, dtype and the backend flags
            in force.
        kind: The kind of comparison, by name (:attr:`divtrace.Kind.name`: ``"batched"``,
            ``"prompts"``, ``"two models"``, ``"sharded"``, ``"on ranks"``, ...; ``"batched"``
            in files saved before it).
    """

    batch_size: int
    a_chunk: int
    samples: tuple[int, ...]
    batch_dim: int
    a_passes: int
    stored_bytes: int
    rtol: float | None
    atol: float | None
    train_mode: bool
    torch: str
    explain: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    ops: bool | str = False
    resources: Mapping[str, Any] = field(default_factory=dict)
    names: tuple[str, str] = ("split run", "batched run")
    runs: tuple[str, str] | None = None
    flips: Mapping[str, tuple[bool, ...]] = field(default_factory=dict)
    random_draws: bool = False
    output_type: str | None = None
    graphed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    mixing: tuple[str, ...] = ()
    kind: str = "batched"

    def mixers(self) -> str:
        """What ran in train mode, in words: the modules when they are known."""
        if not self.mixing:
            return "BatchNorm or Dropout"
        shown = ", ".join(self.mixing[:4])
        return shown + (f" and {len(self.mixing) - 4} more" if len(self.mixing) > 4 else "")

    def __getattr__(self, name: str) -> Any:
        raise moved(self, name, {
            "get": "the attribute itself (meta.batch_size), or meta.to_dict().get(...)",
            "info": "the attributes themselves (meta.batch_size), or meta.to_dict()",
            "keys": "meta.to_dict().keys()"})

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready dict (a fresh copy) of the fields."""
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.loads(json.dumps(raw))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Meta:
        """The record that :meth:`to_dict` wrote."""
        known = {f.name for f in dataclasses.fields(cls)}
        raw = {k: v for k, v in data.items() if k in known}
        runs = raw.get("runs")
        return cls(**raw | {
            "samples": tuple(raw["samples"]), "names": tuple(raw.get("names", cls.names)),
            "runs": None if runs is None else (runs[0], runs[1]),
            "mixing": tuple(raw.get("mixing", ())),
            "flips": {k: tuple(v) for k, v in raw.get("flips", {}).items()}})
