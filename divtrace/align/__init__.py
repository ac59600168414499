"""Align: where each observed tensor lives (its site), and how two runs' sites line up.

- :mod:`~divtrace.align.sites`: :class:`Site`, site keys, the tensors inside an output.
- :mod:`~divtrace.align.status`: :class:`Status`, whether a tensor lines up with the
  other run's rows at its site.
- :mod:`~divtrace.align.order`: the table's order, with sites only one run reached.
"""
