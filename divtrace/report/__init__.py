"""Report: from the runs' figures to what a person reads.

- :mod:`~divtrace.report.table`: the one host synchronisation and the table.
- :mod:`~divtrace.report.comparison`: :class:`~divtrace.Comparison`, the result.
- :mod:`~divtrace.report.meta`: :class:`Meta`, the typed settings of a comparison.
- :mod:`~divtrace.report.text`: the summary.
- :mod:`~divtrace.report.html`: Jupyter's view and the self-contained page.
- :mod:`~divtrace.report.plot`: every picture (comparisons and sweeps).
- :mod:`~divtrace.report.files`: the output formats (CSV, JSON; HTML is in `html`).
"""
