"""divtrace: trace, layer by layer, where a batched run and a split run of a model differ.

Example:
    >>> import torch, divtrace
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).eval()
    >>> result = divtrace.compare(net, torch.randn(8, 4), progress=False)
    >>> result.table.columns[0]
    'site'
"""

from divtrace import remedies
from divtrace.accumulation import compare_backward
from divtrace.backward.result import Backward
from divtrace.batch_sweep import BatchSweep, sweep_batch
from divtrace.compare import compare
from divtrace.compiled import compare_compiled
from divtrace.errors import (
    BatchMixingError,
    DivtraceAttributeError,
    DivtraceError,
    DivtraceTypeError,
    DivtraceValueError,
    DivtraceWarning,
)
from divtrace.explain.context import Context
from divtrace.explain.fp64 import Fp64
from divtrace.explain.independence import Independence
from divtrace.explain.kernels import Kernels
from divtrace.explain.local import Local
from divtrace.explain.observer import Observer
from divtrace.explain.precision import Precision
from divtrace.explain.probe import Explained, Findings, Hooks, Judged, Probe, Spec, output_rows
from divtrace.explain.registry import EXPLAIN_COLUMNS
from divtrace.explain.repeat import Repeat
from divtrace.explain.routing import Routing
from divtrace.explain.tokens import PerToken
from divtrace.explain.view import TableView
from divtrace.generate.result import Generation
from divtrace.generation import compare_generate
from divtrace.io import load
from divtrace.kinds.kind import Kind
from divtrace.layouts import compare_layouts, compare_rollout
from divtrace.measure.host import Deferred
from divtrace.measure.measured import Measured
from divtrace.plan.prompts import Prompts
from divtrace.plan.runs import Resources, Run
from divtrace.plan.tokens import Layout
from divtrace.record.experts import Routers
from divtrace.report.comparison import Comparison
from divtrace.report.diff import Diff, diff
from divtrace.report.plot import overlay
from divtrace.report.result import Result
from divtrace.report.table import COLUMNS
from divtrace.report.tokens import TokenFigures, token_figures
from divtrace.sweep import Sweep, sweep
from divtrace.two_models import compare_models
from divtrace.version import __version__

__all__ = [
    "COLUMNS",
    "EXPLAIN_COLUMNS",
    "Backward",
    "BatchMixingError",
    "BatchSweep",
    "Comparison",
    "Context",
    "Deferred",
    "Diff",
    "DivtraceAttributeError",
    "DivtraceError",
    "DivtraceTypeError",
    "DivtraceValueError",
    "DivtraceWarning",
    "Explained",
    "Findings",
    "Fp64",
    "Generation",
    "Hooks",
    "Independence",
    "Judged",
    "Kernels",
    "Kind",
    "Layout",
    "Local",
    "Measured",
    "Observer",
    "PerToken",
    "Precision",
    "Probe",
    "Prompts",
    "Repeat",
    "Resources",
    "Result",
    "Routers",
    "Routing",
    "Run",
    "Spec",
    "Sweep",
    "TableView",
    "TokenFigures",
    "__version__",
    "compare",
    "compare_backward",
    "compare_compiled",
    "compare_generate",
    "compare_layouts",
    "compare_models",
    "compare_rollout",
    "diff",
    "load",
    "output_rows",
    "overlay",
    "remedies",
    "sweep",
    "sweep_batch",
    "token_figures",
]
