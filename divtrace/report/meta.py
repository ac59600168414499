"""The settings and environment of a comparison, as a typed record that round-trips
through JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Meta"]

#: Fields written as they are; ``options`` is flattened in after ``torch``.
_BEFORE = ("batch_size", "chunk", "samples", "batch_dim", "split_passes", "stored_bytes",
           "rtol", "atol", "train_mode", "torch")
_AFTER = ("runs", "flips", "random_draws", "output_type", "graphed", "notes", "environment",
          "settings")


@dataclass(frozen=True)
class Meta:
    """What a comparison was run with.

    Attributes:
        batch_size: B, the rows of the batched run.
        chunk: The split run's batch size (B when the reference run is not chunked).
        samples: The compared rows.
        batch_dim: The batch dimension.
        split_passes: The reference run's passes.
        stored_bytes: Bytes of the reference run's rows that were kept.
        rtol: The given relative tolerance (None: the dtype's default).
        atol: The given absolute tolerance (None: the dtype's default).
        train_mode: The model ran with sample-mixing modules in train mode.
        torch: The torch version.
        options: The explain options (``local``, ``truth``, ``repeat``, ``kernels``).
        runs: The labels of runs a and b, when they were given (else None).
        flips: Per output site of 2-D logits: whether each sample's argmax differs.
        random_draws: A pass drew random numbers (allowed by ``allow_train=True``).
        output_type: The type of the model's output when it held no tensor (else None).
        graphed: Per chunked run (``a``, ``b``): ``requested`` (the ``graphs=`` option),
            ``passes``, ``replayed`` (passes replayed from a CUDA graph), ``lanes``
            (passes each replay ran side by side), ``pool_bytes`` (the graph's own
            memory), ``capture_s`` and ``reason`` (why passes ran eagerly, or None).
        notes: What probes found that is not a column, by probe.
        environment: divtrace, torch, CUDA, cuDNN, GPUs and driver versions.
        settings: Per run (``a``: the reference, the split run by default; ``b``: the
            compared one): its label, device, dtype and the backend flags in force.
    """

    batch_size: int
    chunk: int
    samples: tuple[int, ...]
    batch_dim: int
    split_passes: int
    stored_bytes: int
    rtol: float | None
    atol: float | None
    train_mode: bool
    torch: str
    options: Mapping[str, Any] = field(default_factory=dict)
    runs: tuple[str, str] | None = None
    flips: Mapping[str, tuple[bool, ...]] = field(default_factory=dict)
    random_draws: bool = False
    output_type: str | None = None
    graphed: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready dict (a fresh copy): the fields, options flattened in."""
        raw = {name: getattr(self, name) for name in _BEFORE}
        raw |= dict(self.options)
        raw |= {name: getattr(self, name) for name in _AFTER}
        return json.loads(json.dumps(raw))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Meta:
        """The record that :meth:`to_dict` wrote."""
        known = {f.name for f in dataclasses.fields(cls)}
        options = {k: v for k, v in data.items() if k not in known}
        runs = data.get("runs")
        return cls(
            **{name: data[name] for name in _BEFORE if name != "samples"},
            samples=tuple(data["samples"]), options=options,
            runs=None if runs is None else (runs[0], runs[1]),
            flips={k: tuple(v) for k, v in data.get("flips", {}).items()},
            random_draws=bool(data.get("random_draws", False)),
            output_type=data.get("output_type"), graphed=dict(data.get("graphed", {})),
            notes=dict(data.get("notes", {})),
            environment=dict(data.get("environment", {})),
            settings=dict(data.get("settings", {})))
