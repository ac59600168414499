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
    rows_meter = Meter(meter.store.as_batch(), len(second.samples), meter.host,
                       meter.rtol, meter.atol)
    for stored in second.rows.values():
        if stored.site.input is not None:
            continue
        if stored.rows is None or not second.complete(stored):
            status = stored.status if stored.rows is None else Status.PARTIAL_IN_SPLIT
            meter.sites.append(Measured(stored.site, status, stored.shape, stored.dtype))
            continue
        measured = rows_meter.measure(stored.site, stored.rows)
        measured.shape = (batch, *stored.row_shape)
        meter.sites.append(measured)
    for key, parts in second.lineage.items():
        inputs: list[tuple[Origin, str | None, Measured | None]] = []
        for origin, part_key in parts:
            own = second.rows.get(part_key) if part_key is not None else None
            found = None
            if origin == Origin.INPUT and own is not None and own.rows is not None:
                found = rows_meter.measure(own.site, own.rows)
                found.shape = (batch, *own.row_shape)
            inputs.append((origin, part_key, found))
        meter.calls[key] = CallRecord(inputs)
