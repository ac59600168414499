"""Fingerprints of a pass's sites computed together after the pass, not one site at a time
in its hook.

A site's hook hands over the rows to fingerprint, copied (a later in-place op cannot
change them) and a tag of its own; at the end of the pass — or sooner, when the copies
waiting hold ``budget`` bytes — every waiting site's rows get their fingerprints in one
:meth:`~divtrace.measure.prints.Fingerprints.of_many` (one Triton launch over a table of
rows on CUDA; on the CPU a product and a sum per row width), and ``done`` is handed them
all with each tag's span, so that what follows is a few operations for all the sites.
Sums modulo 2**64 do not depend on the grouping, so a site's fingerprints are those it
would get alone. On the CPU a site of long rows gets them at once, in its hook: there a
copy would cost more than the operations it saves. Sites on different devices (a model
split over them) are summed device by device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from divtrace.measure.measured import Measured
from divtrace.measure.prints import Fingerprints

__all__ = ["PrintBatch", "SitePrints"]

#: On the CPU, a site's rows of more elements than this get their fingerprints at once,
#: in its hook: copying them would cost more than the operations it saves.
_AT_ONCE = 1 << 14
#: Told of a flush: every waiting site's fingerprints (``[rows]`` int64, end to end) and
#: per site its tag and the span ``(start, stop)`` of its rows among them.
Done = Callable[[torch.Tensor, list[tuple[Any, int, int]]], None]


@dataclass
class PrintBatch:
    """Waiting sites' rows, fingerprinted together (see the module)."""

    printer: Fingerprints
    budget: int
    done: Done
    #: per waiting site: its rows (copies) or, made at once, their fingerprints; its tag
    _waiting: list[tuple[list[torch.Tensor] | torch.Tensor, Any]] = field(
        default_factory=list)
    _bytes: int = 0

    def add(self, blocks: list[torch.Tensor], tag: Any, copies: bool = False) -> None:
        """Waits with ``blocks`` (``[k, ...]`` each, one after the other) until
        :meth:`flush`: ``copies``: blocks nothing writes before then, else views of the
        pass's tensors, copied here — or, on the CPU where a site's rows are long enough
        that a copy costs more than the operations it saves, fingerprinted at once."""
        if not copies and blocks[0].device.type == "cpu" and sum(
                b.numel() for b in blocks) > _AT_ONCE:
            self._waiting.append((self._of(blocks), tag))
            return
        if not copies:
            blocks = [b.clone(memory_format=torch.contiguous_format) for b in blocks]
        self._waiting.append((blocks, tag))
        self._bytes += sum(b.numel() * b.element_size() for b in blocks)
        if self._bytes > self.budget:
            self.flush()

    def flush(self) -> None:
        """Every waiting site's fingerprints, in one sum over all their rows per device
        (``done`` is told once per device)."""
        waiting, self._waiting, self._bytes = self._waiting, [], 0
        by_device: dict[torch.device, list[tuple[list[torch.Tensor] | torch.Tensor, Any]]] = {}
        for entry in waiting:
            found = entry[0]
            by_device.setdefault((found[0] if isinstance(found, list) else found).device,
                                 []).append(entry)
        for entries in by_device.values():
            self._flush(entries)

    def _flush(self, waiting: list[tuple[list[torch.Tensor] | torch.Tensor, Any]]) -> None:
        """The fingerprints of waiting sites on one device, handed to ``done``."""
        blocks = [b for found, _ in waiting if isinstance(found, list) for b in found]
        made = self._of(blocks) if blocks else None
        spans, at = [], 0
        for found, tag in waiting:
            n = sum(b.shape[0] for b in found) if isinstance(found, list) else len(found)
            spans.append((tag, at, at + n))
            at += n
        if made is not None and len(made) == at:  # every site's made together
            self.done(made, spans)
            return
        parts, taken = [], 0  # in the sites' order: made together, or at once
        for found, _ in waiting:
            if isinstance(found, list):  # its rows' span of the ones made together
                assert made is not None
                n = sum(b.shape[0] for b in found)
                parts.append(made[taken:taken + n])
                taken += n
            else:
                parts.append(found)
        self.done(torch.cat(parts), spans)

    def _of(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        return self.printer.of_many(blocks) if len(blocks) > 1 else self.printer.of(blocks[0])


class SitePrints:
    """The measured pass's sites: each site's ``Measured.prints`` set after the pass (or
    when the copies waiting fill ``budget``), a view of the pass's fingerprints."""

    def __init__(self, printer: Fingerprints, budget: int) -> None:
        self._batch = PrintBatch(printer, budget, self._printed)
        #: per waiting site (by id), the sites that take its fingerprints
        self._tags: dict[int, list[Measured]] = {}

    def add(self, measured: Measured, picked: torch.Tensor | None,
            earlier: Measured | None, views: Callable[[], list[torch.Tensor]]) -> None:
        """``measured``'s fingerprints: those of ``earlier`` (a site whose very rows it
        hands on) when they are still to come, else of ``picked`` (a copy of its rows) or
        of ``views()`` (views of them, asked for only when needed)."""
        waiting = self._tags.get(id(earlier)) if earlier is not None else None
        if waiting is not None:
            waiting.append(measured)
            return
        tag = self._tags[id(measured)] = [measured]
        if picked is not None:
            self._batch.add([picked], tag, copies=True)
        else:
            self._batch.add(views(), tag)

    def flush(self) -> None:
        """Every waiting site's fingerprints now."""
        self._batch.flush()

    def _printed(self, prints: torch.Tensor, spans: list[tuple[Any, int, int]]) -> None:
        for tag, start, stop in spans:
            for measured in tag:
                measured.prints = prints[start:stop]
        self._tags.clear()
