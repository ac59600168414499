"""``divtrace.load``: a saved result of any sort (comparison, backward comparison,
generation, sweep, batch sweep, remedies), back."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from divtrace.errors import DivtraceValueError, DivtraceWarning
from divtrace.explain.probe import Probe
from divtrace.explain.registry import PROBES
from divtrace.report import saved
from divtrace.report.comparison import Comparison
from divtrace.report.meta import Meta
from divtrace.report.result import Result

if TYPE_CHECKING:
    from divtrace.backward.result import Backward
    from divtrace.batch_sweep import BatchSweep
    from divtrace.generate.result import Generation
    from divtrace.remedies.result import Remedies
    from divtrace.sweep import Sweep

__all__ = ["load"]


def _probes(names: list[str]) -> tuple[type[Probe], ...]:
    """The probe classes of a saved comparison (its summary's sentences); probes that
    this divtrace does not know are left out, with a warning."""
    known = {probe.__name__: probe for probe in PROBES}
    missing = [name for name in names if name not in known]
    if missing:
        warnings.warn(f"the saved comparison was explained by probes this divtrace does not "
                      f"have ({', '.join(missing)}); their sentences are left out",
                      DivtraceWarning, stacklevel=3)
    return tuple(known[name] for name in names if name in known)


def _comparison(doc: dict[str, Any]) -> Comparison:
    """The comparison of a saved document (its tensors were not saved: no ``pair``)."""
    return Comparison(saved.frame_from_json(doc["table"]),
                      saved.frame_from_json(doc["samples"]), Meta.from_dict(doc["meta"]),
                      {}, _probes(doc["probes"]))


def load(path: str | Path
         ) -> Comparison | Sweep | BatchSweep | Generation | Remedies | Backward:
    """Reads a file that ``.save(path)`` wrote: the same table (every column and dtype),
    per-sample figures, meta, summary and plots. Kept tensors and models are not saved:
    ``pair()`` and ``Generation.at()`` need a fresh run.

    Example:
        >>> import tempfile, torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
        >>> result = divtrace.compare(net, torch.randn(6, 4), progress=False)
        >>> path = result.save(tempfile.mkdtemp() + "/run.json")
        >>> divtrace.load(path).table.equals(result.table)
        True
    """
    doc = saved.read(path)
    kind = doc.get("kind")
    sort = _sorts().get(str(kind))
    if sort is None:
        raise DivtraceValueError(f"{path} holds a divtrace {kind!r}, which this divtrace does "
                                 f"not know; upgrade divtrace")
    return sort._restored(doc, _comparison)  # type: ignore[return-value]


def _sorts() -> dict[str, type[Result]]:
    """Each sort of result by the name its saved files give (``kind``)."""
    from divtrace.backward.result import Backward
    from divtrace.batch_sweep import BatchSweep
    from divtrace.generate.result import Generation
    from divtrace.remedies.result import Remedies
    from divtrace.sweep import Sweep

    return {sort.document: sort for sort in (Comparison, Sweep, BatchSweep, Remedies,
                                             Backward, Generation)}
