"""Kinds of comparison: what two runs are compared, and how a site's rows are found in
each.

- :mod:`~divtrace.kinds.kind`: :class:`Kind` (public as ``divtrace.Kind``), the seam a
  kind implements; its defaults are those of the batched run against the split run;
- :mod:`~divtrace.kinds.prompts`,
  :mod:`~divtrace.kinds.padded`, :mod:`~divtrace.kinds.models`,
  :mod:`~divtrace.kinds.sharded`: one kind each;
- :mod:`~divtrace.kinds.registry`: the built-in kinds and the one a plan is of.
"""
