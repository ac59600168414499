"""Record: observe a run and keep what the comparison needs of it.

- :mod:`~divtrace.record.recorder`: the seam — :class:`Recorder`, :class:`Sink`, the
  per-pass :class:`Tracker`.
- :mod:`~divtrace.record.hooks`: :class:`ModuleHooks`, the module-hook recorder.
- :mod:`~divtrace.record.rows`: :class:`RowStore`, the compared samples' rows of a run.
- :mod:`~divtrace.record.lineage`: where a leaf call's inputs came from.
- :mod:`~divtrace.record.loop`: :func:`drive`, the one chunk loop every run goes through.
- :mod:`~divtrace.record.runner`: :class:`Runner`, one run ready to execute.
- :mod:`~divtrace.record.guard`: the user's model comes back untouched.
"""
