"""The independence test's passes: which samples each holds, the rows they hold, what
moved between two passes; the figures of a measured pass (the precision test's too)."""

from __future__ import annotations

import itertools
import math

import torch

from divtrace.align.status import Status
from divtrace.devices import upload
from divtrace.measure.figures import FIGURES, many_site_figures
from divtrace.measure.host import Deferred, Host
from divtrace.measure.meter import Meter
from divtrace.record.rows import RowStore
from divtrace.record.stored import StoredRows

__all__ = ["READS", "REL_READS", "TWO", "differing", "figures_of", "groups", "held_store",
           "moved_in_calls"]


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


#: The two figures the tests read of a measured pass.
TWO = tuple(f for f in FIGURES if f.name in ("mismatch", "rel_l2"))
#: The fields those two figures read (rel_l2's sums and what says it was lost): a pass
#: measured only for :func:`figures_of` computes no others (``Meter.reads``).
READS = frozenset({"mismatch", "nonfinite", "max_abs", "sq_diff", "sq_ref", "scale"})
#: The fields rel_l2 alone reads: a pass measured only for its rel_l2 (the precision
#: test's) computes no others on the eager paths, where its mismatch is then NaN.
REL_READS = READS - {"mismatch"}


def figures_of(meter: Meter, batch: int) -> dict[str, tuple[float, float]]:
    """Per site of a measured pass: ``(mismatch, rel_l2)`` (after its host fetched), the
    sites' figures computed together as the table's are (each the number the site alone
    gives; every site holds the same compared samples)."""
    measured = [m for m in meter.sites if m.stats is not None]
    if not measured:
        return {}
    found = many_site_figures([m.stats.get() for m in measured],  # type: ignore[union-attr]
                              [m.per_sample(batch) for m in measured], TWO)[0]
    return {m.site.key: (site["mismatch"], site["rel_l2"])
            for m, site in zip(measured, found, strict=True)}


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



def moved_in_calls(meter: Meter, first: RowStore, again: RowStore, rows: list[int],
                   host: Host) -> dict[str, Deferred]:
    """Where run b is recorded over several forward calls (a token layout's): per site,
    whether the compared samples ``rows`` moved between the measured pass (``meter``'s
    sites, their fingerprints) and another pass recorded into ``again`` (its parts cut
    to the tokens measured against run a's, whose store ``first`` says where each began):
    1.0 or 0.0 after ``host`` fetched."""
    at = torch.tensor([meter.store.samples.index(s) for s in rows])
    index: dict[torch.device, torch.Tensor] = {}  # one upload per device
    found: dict[str, Deferred] = {}
    for measured in meter.sites:
        stored, reference = again.rows.get(measured.site.key), first.rows.get(
            measured.site.key)
        if measured.prints is None or measured.part_shapes is None or stored is None or (
                reference is None or not again.complete(stored)):
            continue
        cuts = _cut_as(stored, reference.firsts, measured.part_shapes)
        if cuts is None:
            continue
        now = meter.fingerprints([cut.unsqueeze(0) for cut in cuts])
        if now.shape != measured.prints.shape:
            continue
        device = measured.prints.device
        if device not in index:
            index[device] = upload(at, device)
        moved = now.to(device).index_select(0, index[device]) != (
            measured.prints.index_select(0, index[device]))
        found[measured.site.key] = host.add(moved.any().double().reshape(1))
    return found


def _cut_as(stored: StoredRows, firsts: list[int] | None,
            shapes: tuple[tuple[int, ...], ...]) -> list[torch.Tensor] | None:
    """Each part of ``stored`` cut to the tokens of ``shapes`` from ``firsts`` (None: a
    part does not hold them)."""
    parts, begun = stored.parts, stored.firsts
    if parts is None or len(parts) != len(shapes):
        return None
    cuts = []
    for slot, (part, shape) in enumerate(zip(parts, shapes, strict=True)):
        if part is None or not shape:
            return None
        offset = (firsts[slot] if firsts else 0) - (begun[slot] if begun else 0)
        if offset < 0 or offset + shape[0] > part.shape[0] or tuple(part.shape[1:]) != (
                tuple(shape[1:])):
            return None
        cuts.append(part.narrow(0, offset, shape[0]))
    return cuts
