"""The independence test's passes: which samples each holds, the rows they hold, what
moved between two passes; the figures of a measured pass (the precision test's too)."""

from __future__ import annotations

import itertools
import math

import torch

from divtrace.align.status import Status
from divtrace.devices import upload
from divtrace.measure.figures import site_figures
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows

__all__ = ["differing", "figures_of", "groups", "held_store"]


def groups(samples: list[int]) -> list[list[int]]:
    """The rows held fixed in each pass, so that every compared sample is held once while
    any other one is replaced: each sample gets its own set of ``k // 2`` of ``k`` passes
    (``k`` the fewest with ``C(k, k // 2) >= len(samples)``, Sperner's bound: the fewest
    passes that part every ordered pair), and pass ``t`` holds the samples whose set has
    ``t``. One sample: one pass; 2: 2; 8: 5; 128: 10."""
    if len(samples) < 2:
        return [list(samples)]
    k = 2
    while math.comb(k, k // 2) < len(samples):
        k += 1
    codes = itertools.islice(itertools.combinations(range(k), k // 2), len(samples))
    held: list[list[int]] = [[] for _ in range(k)]
    for sample, code in zip(samples, codes, strict=False):
        for t in code:
            held[t].append(sample)
    return [group for group in held if group]


def held_store(store: RowStore, group: list[int]) -> RowStore:
    """The rows of the samples in ``group`` (some of ``store``'s samples, in order) kept
    by ``store``, as a row store of their own."""
    at = [store.samples.index(s) for s in group]
    kept = RowStore(list(group), store.batch_dim, False, learn_lineage=False, pinned=True)
    for key, stored in store.rows.items():
        if stored.status != Status.OK or not store.complete(stored):
            continue
        if stored.rows is not None:
            index = upload(torch.tensor(at), stored.rows.device)
            kept.put(stored.site, stored.shape, stored.rows.index_select(0, index))
        elif stored.parts is not None:  # prompts of different lengths
            kept.rows[key] = StoredRows(stored.site, stored.shape, None, (), stored.dtype,
                                        filled=len(at), parts=[stored.parts[i] for i in at])
    return kept


def figures_of(meter: Meter, batch: int) -> dict[str, tuple[float, float]]:
    """Per site of a measured pass: ``(mismatch, rel_l2)`` (after its host fetched)."""
    found: dict[str, tuple[float, float]] = {}
    for measured in meter.sites:
        if measured.stats is None:
            continue
        figures = site_figures(measured.stats.get(), measured.per_sample(batch))
        found[measured.site.key] = (figures["mismatch"], figures["rel_l2"])
    return found



def differing(one: RowStore, two: RowStore, meter: Meter) -> list[str]:
    """The sites whose rows differ between two row stores of the same samples, by their
    fingerprints (one wait for the device)."""
    found, host = {}, Host()
    for key, first in one.rows.items():
        second = two.rows.get(key)
        if first.rows is None or second is None or second.rows is None or (
                not one.complete(first) or not two.complete(second)):
            continue
        if first.rows.shape == second.rows.shape:
            found[key] = host.add((meter.fingerprints(first.rows) != meter.fingerprints(
                second.rows)).any().double().reshape(1))
    host.fetch()
    return [key for key, moved in found.items() if moved.get().any()]
