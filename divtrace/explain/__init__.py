"""Explain: probes that say why the runs part — one probe, one file (``explain=[...]``).

- :mod:`~divtrace.explain.probe`: the :class:`Probe` seam and the :class:`Context` a
  probe sees.
- :mod:`~divtrace.explain.registry`: :data:`PROBES`, every probe in column order.
- :mod:`~divtrace.explain.roles`: sources and carriers (always on).
- :mod:`~divtrace.explain.local`: ``"local"``, replay on identical inputs.
- :mod:`~divtrace.explain.fp64`: ``"fp64"``, a float64 run of the same samples.
- :mod:`~divtrace.explain.repeat`: ``Repeat(n)``, run-to-run noise.
- :mod:`~divtrace.explain.kernels`: ``"kernels"``, what each site launched
  (through :mod:`~divtrace.explain.profiling`).
"""
