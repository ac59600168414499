"""The compared run in chunks too: its recorded rows measured against the reference's."""

from __future__ import annotations

from divtrace.align.status import Status
from divtrace.measure.measured import CallRecord, Measured
from divtrace.measure.meter import Meter
from divtrace.record.lineage import Origin
from divtrace.record.rows import RowStore

__all__ = ["compare_stores"]


def compare_stores(meter: Meter, second: RowStore, batch: int) -> None:
    """Measures ``second``'s rows (a chunked compared run's) against ``meter``'s store,
    into ``meter``'s sites and calls."""
    measure = meter.of_stored(second, batch)
    for stored in second.rows.values():
        if stored.site.input is not None:
            continue
        measured = measure(stored) if second.complete(stored) else None
        if measured is None:
            status = Status.PARTIAL_IN_SPLIT if stored.held else stored.status
            meter.sites.append(Measured(stored.site, status, stored.shape, stored.dtype))
            continue
        meter.sites.append(measured)
    for key, parts in second.lineage.items():
        inputs: list[tuple[Origin, str | None, Measured | None]] = []
        for origin, part_key in parts:
            own = second.rows.get(part_key) if part_key is not None else None
            found = None
            if origin == Origin.INPUT and own is not None:
                found = measure(own)
            inputs.append((origin, part_key, found))
        meter.calls[key] = CallRecord(inputs)
