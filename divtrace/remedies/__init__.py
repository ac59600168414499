"""Remedies: settings that may make the two runs agree, each verified bit for bit by
running the comparison again under it, and costed (:meth:`divtrace.Comparison.remedies`).

Every remedy applies in production code the same way::

    with remedy.applied(model):
        y = model(x)
"""

from divtrace.remedies.catalog import (
    CudnnOff,
    Deterministic,
    FixedBatch,
    Float64,
    MathAttention,
    PrecisionOff,
)
from divtrace.remedies.head import Float32Head, Float32Router
from divtrace.remedies.inductor import DynamicShapes, EagerRegions, InductorSettings
from divtrace.remedies.remedy import Custom, Remedy, Scoped, Situation
from divtrace.remedies.result import Remedies
from divtrace.remedies.search import NAMES

__all__ = ["NAMES", "CudnnOff", "Custom", "Deterministic", "DynamicShapes", "EagerRegions",
           "FixedBatch", "Float32Head", "Float32Router", "Float64", "InductorSettings",
           "MathAttention",
           "PrecisionOff", "Remedies", "Remedy", "Scoped", "Situation"]
