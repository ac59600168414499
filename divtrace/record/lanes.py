"""The passes of a CUDA graph as the graphed split run captures them (one per *lane*):
their input buffers and slots, loaded before each replay; and the check of what they wrote
against the eager passes, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from divtrace.record.cudagraph import Graph
from divtrace.record.stored import StoredRows

__all__ = ["Captured", "Lane", "first_difference", "rows_of"]


@dataclass
class Lane:
    """One captured pass of a graph: its input buffers, its slots and the sites it
    copies."""

    inputs: list[Any]
    slots: torch.Tensor
    steps: torch.Tensor  # 0, 1, ... for each row of the pass
    sites: list[StoredRows]

    def load(self, leaves: list[Any], first_slot: int) -> None:
        """Sets the next replay's input rows, and its slots: ``first_slot`` onwards (the
        rows of a replayed pass are all compared, so their slots follow each other)."""
        for buffer, leaf in zip(self.inputs, leaves, strict=True):
            if isinstance(buffer, torch.Tensor) and buffer is not leaf:
                buffer.copy_(leaf)
        torch.add(self.steps, first_slot, out=self.slots)  # no copy from the host


@dataclass
class Captured:
    """The captured passes, one per lane, replayed together."""

    graph: Graph
    lanes: list[Lane]
    pool_bytes: int = 0
    capture_s: float = 0.0

    def replay(self, group: list[list[Any]], first_slots: list[int]) -> None:
        """One replay over a group of chunks (their input leaves and first slots), one
        chunk per lane."""
        for lane, leaves, first_slot in zip(self.lanes, group, first_slots, strict=True):
            lane.load(leaves, first_slot)
        self.graph.replay()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, as integers of its width (floats compared bit for bit)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.is_floating_point():
        return tensor.view(_INTS[tensor.element_size()])
    return tensor


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def first_difference(snapshot: list[tuple[StoredRows, torch.Tensor]], lanes: list[Lane]
                     ) -> str | None:
    """The first site whose rows, as each lane wrote them to its slots, are not the
    eager pass's (``snapshot``) bit for bit, or that a lane did not copy (None: every lane
    wrote every site's rows the same). One comparison per site for all lanes."""
    copied = [{id(stored) for stored in lane.sites} for lane in lanes]
    unseen = [stored.site.key for stored, _ in snapshot
              if any(id(stored) not in sites for sites in copied)]
    if unseen or not snapshot:
        return unseen[0] if unseen else None
    slots = torch.cat([lane.slots for lane in lanes])  # on the device: no copy from the host
    differs = torch.stack([
        (_bits(rows_of(stored).index_select(0, slots)).view(len(lanes), *was.shape)
         != _bits(was)).any() for stored, was in snapshot])
    if bool(differs.any()):
        return snapshot[int(differs.nonzero()[0])][0].site.key
    return None


def rows_of(stored: StoredRows) -> torch.Tensor:
    """A held site's rows."""
    assert stored.rows is not None
    return stored.rows
