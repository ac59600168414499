"""The remedies divtrace tries: cuDNN off, float64, a fixed batch shape, reduced precision
off, the math attention backend, deterministic algorithms (the output head in float32:
``head.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from divtrace.align.sites import ROOT
from divtrace.compat import modes_off, pytree
from divtrace.errors import DivtraceValueError
from divtrace.plan.precision import set_tf32
from divtrace.plan.runs import eager_experts
from divtrace.remedies.remedy import Remedy, Scoped, Situation, targets

__all__ = ["CudnnOff", "Deterministic", "FixedBatch", "Float64", "MathAttention",
           "PrecisionOff", "Upcast"]

#: ``leave(output)``: undoes what a module call's ``enter`` did; returns the output to use.
Leave = Callable[[Any], Any]


def around(modules: Sequence[nn.Module], enter: Callable[[nn.Module, tuple[Any, ...]], Leave],
           stack: ExitStack) -> None:
    """Runs ``enter(module, args)`` before each call of each module and the ``leave`` it
    returns after the call, also when the call raises (then with ``None``). Both hooks go
    first, so the user's own hooks see what the remedy made."""
    for module in modules:
        pending: list[Leave] = []

        def pre(mod: nn.Module, args: tuple[Any, ...], pending: list[Leave] = pending) -> None:
            pending.append(enter(mod, args))

        def post(mod: nn.Module, args: tuple[Any, ...], output: Any,
                 pending: list[Leave] = pending) -> Any:
            return pending.pop()(output) if pending else None

        for handle in (module.register_forward_pre_hook(pre, prepend=True),
                       module.register_forward_hook(post, prepend=True, always_call=True)):
            stack.callback(handle.remove)


class CudnnOff(Scoped):
    """cuDNN off (``torch.backends.cudnn.enabled = False``) inside some modules' forward
    passes, or everywhere: their convolutions run PyTorch's own CUDA kernels, whose
    reduction order does not change with the batch size.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval()
        >>> divtrace.remedies.CudnnOff(["0"]).name
        'cuDNN off in 0'
    """

    kind = "cudnn"
    what = "cuDNN off"

    @property
    def reaches_copies(self) -> bool:
        return self.modules is None  # the flag itself, not hooks on modules

    def unusable(self, situation: Situation) -> str | None:
        return None if situation.on_cuda else "the model runs on the CPU, without cuDNN"

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        cudnn = torch.backends.cudnn
        if self.modules is None:
            cudnn.enabled = False
            return

        def enter(_module: nn.Module, _args: tuple[Any, ...]) -> Leave:
            was = cudnn.enabled
            cudnn.enabled = False

            def leave(_output: Any) -> None:
                cudnn.enabled = was
            return leave

        around(targets(model, self.modules), enter, stack)


#: The floating dtypes below each that an upcast to it turns into it.
_BELOW = {torch.float64: (torch.float32, torch.float16, torch.bfloat16),
          torch.float32: (torch.float16, torch.bfloat16)}


class Upcast(TorchFunctionMode):
    """Every torch function called while it is in force takes its floating tensors of less
    precision than ``dtype`` (parameters too) as ``dtype`` copies."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.below = _BELOW[dtype]
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "__get__":  # attributes are read as they are
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._up, (args, kwargs))
        return func(*args, **kwargs)

    def _up(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.dtype in self.below else tensor


def _down(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype) if t.dtype == torch.float64 else t


class Float64(Scoped):
    """Float64 inside some modules: while one runs, every torch function takes its
    floating tensors (input and parameters) as float64 copies, and its outputs are cast
    back to the dtype of its input. The module's parameters are not changed.

    Args:
        modules: Qualified module names; None: the whole model.
    """

    kind = "float64"
    what = "float64"

    def caveat(self, situation: Situation) -> str:
        return "its results are rounded once more, to the dtype of the module's input"

    def own(self, module: str, op: str) -> bool:
        scope = self.modules or (ROOT,)
        return any((module == m and op != "") or (m == ROOT and module != ROOT)
                   or module.startswith(m + ".") for m in scope)

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        chosen = [model] if self.modules is None else targets(model, self.modules)
        for back in eager_experts(model):  # grouped_mm takes no float64
            stack.callback(back)

        def enter(module: nn.Module, args: tuple[Any, ...]) -> Leave:
            dtype = next((t.dtype for t in pytree.tree_leaves(args)
                          if isinstance(t, torch.Tensor) and t.is_floating_point()),
                         next((p.dtype for p in module.parameters()), torch.get_default_dtype()))
            mode = Upcast()
            mode.__enter__()

            def leave(output: Any) -> Any:
                mode.__exit__(None, None, None)
                if output is None:
                    return None
                return pytree.tree_map_only(torch.Tensor, _down(dtype), output)
            return leave

        around(chosen, enter, stack)


class FixedBatch(Remedy):
    """Every call of the model padded to one batch size, the padding cut off its outputs:
    what serving engines do with CUDA graphs. A call of ``n < size`` rows gets ``size - n``
    copies of its first row appended along ``batch_dim`` (every input tensor with ``n``
    rows there), and every output tensor of ``size`` rows there is cut back to ``n``.

    Args:
        size: The batch size of every call.
        batch_dim: The batch dimension of the inputs and outputs.

    Example:
        >>> import torch, divtrace
        >>> net = torch.nn.Linear(4, 2).eval()
        >>> with divtrace.remedies.FixedBatch(8).applied(net):
        ...     net(torch.randn(3, 4)).shape
        torch.Size([3, 2])
    """

    kind = "fixed-batch"

    def __init__(self, size: int, batch_dim: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise DivtraceValueError(f"FixedBatch(size=...) must be an int >= 1; got {size!r}")
        self.size, self.batch_dim = size, batch_dim

    @property
    def name(self) -> str:
        return f"fixed batch of {self.size}"

    def pads(self) -> int | None:
        return self.size

    def unusable(self, situation: Situation) -> str | None:
        cannot = situation.cannot.get("padded")
        if cannot is not None:
            return cannot
        if not situation.batch_only:
            return "the runs differ in more than their batch size"
        return None

    def caveat(self, situation: Situation) -> str:
        chunk = situation.a_chunk or situation.batch_size
        return (f"a call of {chunk} row{'s' if chunk > 1 else ''} is computed as a batch "
                f"of {self.size}")

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "size": self.size, "batch_dim": self.batch_dim}

    def _rows(self, leaves: list[Any]) -> int | None:
        """The rows of the call: the size at ``batch_dim`` of its first tensor."""
        dim = self.batch_dim
        return next((t.shape[dim] for t in leaves
                     if isinstance(t, torch.Tensor) and -t.dim() <= dim < t.dim()), None)

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        dim, size, counts = self.batch_dim, self.size, []

        def pad(tensor: Any, rows: int) -> Any:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or (
                    tensor.shape[dim] != rows):
                return tensor
            first = tensor.narrow(dim, 0, 1)
            shape = list(tensor.shape)
            shape[dim] = size - rows
            return torch.cat([tensor, first.expand(shape)], dim)

        def pre(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            rows = self._rows(leaves)
            counts.append(rows)
            if rows is None or rows == size:
                return None
            if rows > size:
                counts.pop()
                raise DivtraceValueError(
                    f"FixedBatch(size={size}) got a call of {rows} rows; split such calls "
                    f"into batches of at most {size} rows")
            with modes_off():  # the padding is the remedy's work, not the model's ops
                return pytree.tree_unflatten([pad(t, rows) for t in leaves], spec)

        def post(_mod: nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
            rows = counts.pop() if counts else None
            if rows is None or rows == size or output is None:
                return None
            with modes_off():
                return pytree.tree_map_only(
                    torch.Tensor, lambda t: t.narrow(dim, 0, rows)
                    if t.dim() and t.shape[dim] == size else t, output)

        for handle in (model.register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
                       model.register_forward_hook(post, prepend=True, with_kwargs=True,
                                                   always_call=True)):
            stack.callback(handle.remove)


#: The flags that let cuBLAS reduce half-precision products in reduced precision.
REDUCTIONS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


class PrecisionOff(Remedy):
    """Reduced precision off: TF32 off for matmuls and cuDNN (through whichever API is in
    use), ``torch.set_float32_matmul_precision("highest")``, and cuBLAS's reduced-precision
    reductions of bfloat16 and float16 matmuls off."""

    kind = "precision"

    @property
    def reaches_copies(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return "reduced precision off"

    def unusable(self, situation: Situation) -> str | None:
        return None if situation.reduced else "no reduced precision is in force"

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        torch.set_float32_matmul_precision("highest")
        for path in ("cuda.matmul", "cudnn.conv", "cudnn.rnn"):
            set_tf32(path, False)
        matmul = torch.backends.cuda.matmul
        for flag in REDUCTIONS:
            if hasattr(matmul, flag):
                was = getattr(matmul, flag)
                setattr(matmul, flag, False)
                stack.callback(setattr, matmul, flag, was)


class MathAttention(Remedy):
    """The math backend of ``scaled_dot_product_attention`` (no fused attention kernel)."""

    kind = "math-attention"

    @property
    def reaches_copies(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return "math attention backend"

    def unusable(self, situation: Situation) -> str | None:
        return None if situation.attention else "the model has no attention module"

    def caveat(self, situation: Situation) -> str:
        return "only attention that calls F.scaled_dot_product_attention is affected"

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel(SDPBackend.MATH))


class Deterministic(Remedy):
    """Deterministic algorithms: ``torch.use_deterministic_algorithms(True,
    warn_only=True)``, ``cudnn.deterministic = True``, ``cudnn.benchmark = False``."""

    kind = "deterministic"

    @property
    def reaches_copies(self) -> bool:
        return True

    @property
    def name(self) -> str:
        return "deterministic algorithms"

    def caveat(self, situation: Situation) -> str:
        return ("promises that a pass repeats itself at one batch shape, not that two "
                "shapes agree")

    def enter(self, model: nn.Module, stack: ExitStack) -> None:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
