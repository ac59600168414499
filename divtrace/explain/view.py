"""What probes read while the table is filled: :class:`TableView`, and :class:`Sums` of
several parts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from divtrace.align.sites import CONSTANT, INPUT, site_key
from divtrace.measure.fields import INDEX
from divtrace.measure.measured import CallRecord
from divtrace.measure.scale import common_arrays
from divtrace.record.lineage import Origin

__all__ = ["Sums", "TableView", "sums"]


@dataclass(frozen=True)
class Sums:
    """Mismatch and norms summed over several parts (e.g. the inputs of a call)."""

    mismatch: float  # fraction of elements not bit-identical
    diff: float  # ‖batched − split‖ times 2**-scale
    ref: float  # ‖split‖ times 2**-scale
    scale: int = 0  # see divtrace.measure.scale


def sums(parts: list[tuple[np.ndarray, int]]) -> Sums:
    """:class:`Sums` over ``(per-sample fields, compared elements)`` parts."""
    count = sum(float(a[:, INDEX["mismatch"]].sum()) for a, _ in parts)
    numel = sum(n for _, n in parts)
    arrays, scale = common_arrays([a for a, _ in parts])  # their sums at one scale
    diff = math.sqrt(sum(float(a[:, INDEX["sq_diff"]].sum()) for a in arrays))
    ref = math.sqrt(sum(float(a[:, INDEX["sq_ref"]].sum()) for a in arrays))
    return Sums(count / numel if numel else 0.0, diff, ref, scale)


class TableView:
    """What probes read while the table is filled: every site's fields (on the host) and
    the leaf calls' lineage."""

    def __init__(self, fields: dict[str, tuple[np.ndarray, int]], calls: dict[str, CallRecord],
                 batch: int, n_samples: int, call_keys: Mapping[str, str] | None = None
                 ) -> None:
        self.fields = fields  # site key -> (per-sample fields, compared elements)
        self.calls = calls
        self.batch, self.n_samples = batch, n_samples
        self.call_keys = call_keys or {}  # site key -> key of its call, where it differs
        self._inputs: dict[str, Sums | None] = {}

    def call(self, row: Mapping[str, Any]) -> CallRecord | None:
        """The leaf call a row belongs to (None for other rows)."""
        return self.calls.get(self.call_key(row)) if row["leaf"] else None

    def call_key(self, row: Mapping[str, Any]) -> str:
        """The key of the call a row belongs to: a module call, or an op call."""
        found = self.call_keys.get(row["site"])
        return found if found is not None else site_key(row["module"], row["call"], "")

    def inputs(self, call_key: str) -> Sums | None:
        """The call's inputs taken together (None when one of them is not known); the
        model's own input counts as identical."""
        if call_key not in self._inputs:
            self._inputs[call_key] = self._input_sums(self.calls[call_key])
        return self._inputs[call_key]

    def _input_sums(self, call: CallRecord) -> Sums | None:
        parts: list[tuple[np.ndarray, int]] = []
        for origin, key, measured in call.inputs:
            if origin == Origin.SITE and key in (INPUT, CONSTANT):
                continue  # the model's own input, or no per-sample data: the same in both
            if origin == Origin.SITE and key in self.fields:
                parts.append(self.fields[key])
            elif origin == Origin.INPUT and measured is not None and measured.stats is not None:
                count = np.broadcast_to(measured.per_sample(self.batch), self.n_samples).sum()
                parts.append((measured.stats.get(), int(count)))
            else:
                return None
        return sums(parts)
