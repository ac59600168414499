"""The order of the table: the measured run's sites, with those only the other run had."""

from __future__ import annotations

__all__ = ["merge"]


def merge(measured: list[str], reference: list[str]) -> list[str]:
    """Site keys in execution order: ``measured``'s, with the keys that only ``reference``
    has (data-dependent control flow) placed after the key that preceded them there.

    Example:
        >>> merge(["a", "c"], ["a", "b", "c", "d"])
        ['a', 'b', 'c', 'd']
    """
    merged = list(measured)
    seen = set(measured)
    for i, key in enumerate(reference):
        if key in seen:
            continue
        before = next((k for k in reversed(reference[:i]) if k in seen), None)
        merged.insert(0 if before is None else merged.index(before) + 1, key)
        seen.add(key)
    return merged
