"""Explain: probes that say why the runs part — one explain option, one file.

- :mod:`~divtrace.explain.probe`: the :class:`Probe` seam and the :class:`Context` a
  probe sees.
- :mod:`~divtrace.explain.registry`: :data:`PROBES`, every probe in column order.
- :mod:`~divtrace.explain.roles`: sources and carriers (always on).
- :mod:`~divtrace.explain.local`: ``local=True``, replay on identical inputs.
- :mod:`~divtrace.explain.truth`: ``truth="fp64"``, a float64 run of the same samples.
- :mod:`~divtrace.explain.repeat`: ``repeat=n``, run-to-run noise.
- :mod:`~divtrace.explain.kernels`: ``kernels=True``, what each site launched
  (through :mod:`~divtrace.explain.profiling`).
"""
