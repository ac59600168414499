"""Plan: ``compare()``'s arguments become one validated, frozen :class:`Plan`.

- :mod:`~divtrace.plan.make`: :class:`Plan` and :func:`make_plan` (all validation).
- :mod:`~divtrace.plan.inputs`: the input, its batch size, samples and chunks.
- :mod:`~divtrace.plan.runs`: :class:`~divtrace.Run`, one configuration of a run.
- :mod:`~divtrace.plan.selection`: which modules are observed, and which mix samples.

The modules of this package import nothing from it: each is imported on its own.
"""
