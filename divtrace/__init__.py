"""divtrace: trace, layer by layer, where a batched and a split run of a model part.

Example:
    >>> import torch, divtrace
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).eval()
    >>> result = divtrace.compare(net, torch.randn(8, 4), progress=False)
    >>> result.table.columns[0]
    'site'
"""

from divtrace.assemble import COLUMNS, EXPLAIN_COLUMNS
from divtrace.compare import compare
from divtrace.comparison import Comparison
from divtrace.errors import (
    BatchMixingError,
    DivtraceError,
    DivtraceTypeError,
    DivtraceValueError,
    DivtraceWarning,
)
from divtrace.plot import overlay

__version__ = "0.1.0"

__all__ = [
    "COLUMNS",
    "EXPLAIN_COLUMNS",
    "BatchMixingError",
    "Comparison",
    "DivtraceError",
    "DivtraceTypeError",
    "DivtraceValueError",
    "DivtraceWarning",
    "__version__",
    "compare",
    "overlay",
]
