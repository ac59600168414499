"""A meter driven by the reference run's pass, over the measured run's stored rows.

The precision test replays both runs in float64. Measured the usual way, run a's chunks
are stored first and run b's batched pass is measured against them: the stored rows,
twice the bytes of the comparison's own in float64, are all held while the batched pass
makes its largest activations. When one pass of run a holds every compared sample, the
batched pass can be stored first instead (its rows fill as its activations are freed)
and run a's pass measured against them, each site's rows released as it is measured.

:class:`ReversedMeter` measures that pass with the roles of :class:`Meter`: the stored
rows are the measured run's, the pass's the reference run's. Every pair reaches the
same fields with the same rows in the same places as :class:`Meter` would give it the
other way round, so the figures are the same bit for bit.
"""

from __future__ import annotations

import torch

from divtrace.measure.meter import Meter
from divtrace.record.rows import RowStore

__all__ = ["ReversedMeter", "within_pass"]


def within_pass(store: RowStore, start: int) -> RowStore:
    """``store``'s rows (the measured run's, of the compared samples), read as the rows of
    a pass over the batch's rows from ``start`` on: each compared sample at its place in
    that pass. The rows are ``store``'s own (released as they are measured)."""
    return RowStore([s - start for s in store.samples], store.batch_dim, False,
                    learn_lineage=False, rows=store.rows, aliases=store.aliases)


class ReversedMeter(Meter):
    """A :class:`Meter` over the measured run's stored rows, driven by a pass of the
    reference run (``batch``: its rows; ``store``: see :func:`within_pass`)."""

    def _roles(self, live: torch.Tensor, stored: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored rows first: they are the measured run's."""
        return stored, live
