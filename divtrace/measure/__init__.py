"""Measure: compare the measured run with the stored rows, site by site, on the device.

- :mod:`~divtrace.measure.fields`: the registry of per-sample fields (the statistics'
  layout, read by the eager path and the fused kernel alike).
- :mod:`~divtrace.measure.figures`: the registry of figures, the table's numeric columns.
- :mod:`~divtrace.measure.block`, :mod:`~divtrace.measure.stats`: the eager statistics.
- :mod:`~divtrace.measure.fused`: the fused Triton kernel for CUDA devices.
- :mod:`~divtrace.measure.meter`: :class:`Meter`, the sink of the measured run.
- :mod:`~divtrace.measure.host`: the one host synchronisation.
"""
