"""The private torch APIs divtrace leans on, in one place: they may change between torch
releases, and this is the one file to mend when they do."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import CodeType, FunctionType

import torch
from torch import nn
from torch.testing._comparison import default_tolerances
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

__all__ = ["BATCH_NORM", "DROPOUT", "TorchDispatchMode", "compiling",
           "cuda_driver", "default_tolerances", "dropped", "foreach_copy", "forward_hooks",
           "generator_kept", "impl", "inductor_settings", "is_compiled", "modes_off",
           "module_tracker", "own_code", "own_tensors", "pytree", "recompile_limit",
           "recompiles_allowed", "version"]

#: The base classes of BatchNorm and of Dropout layers (they mix samples, or draw random
#: numbers, in train mode).
BATCH_NORM: type[nn.Module] = nn.modules.batchnorm._BatchNorm
DROPOUT: type[nn.Module] = nn.modules.dropout._DropoutNd



def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (its original
    is ``module._orig_mod``)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo
        return False
    return isinstance(module, OptimizedModule)


def own_code(function: Callable[..., object]) -> Callable[..., object]:
    """A copy of ``function`` with a code object of its own. Dynamo keeps what it compiled
    per code object: compiling the copy fills no cache of ``function``'s (a user's
    compiled model's, or one that hit the recompile limit and now runs only the shapes it
    holds), and a copy compiled under other settings compiles anew."""
    mine = FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                        function.__defaults__, function.__closure__)
    mine.__kwdefaults__ = function.__kwdefaults__
    mine.__dict__.update(function.__dict__)
    mine.__qualname__ = function.__qualname__
    return mine


@contextmanager
def recompile_limit(at_least: int) -> Iterator[None]:
    """Dynamo's recompile limit at least ``at_least`` inside the block, put back after."""
    try:
        from torch._dynamo import config
    except ImportError:  # a torch without dynamo
        yield
        return
    word = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch({word: recompiles_allowed(at_least)}):
        yield


def recompiles_allowed(at_least: int) -> int:
    """The recompile limit :func:`recompile_limit` puts in force (0 without dynamo)."""
    try:
        from torch._dynamo import config
    except ImportError:
        return 0
    word = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return max(int(getattr(config, word)), at_least)


def dropped(codes: Sequence[CodeType]) -> int:
    """Dynamo's compiled code of ``codes`` (code objects of divtrace's own, from
    :func:`own_code`) dropped; returns the most entries one of them held (0 where torch has
    no dynamo)."""
    try:
        from torch._dynamo import reset_code
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # a torch without dynamo, or another layout of it
        return 0
    unique = list(dict.fromkeys(codes))
    most = max((len(_debug_get_cache_entry_list(code)) for code in unique), default=0)
    for code in unique:
        reset_code(code)
    return most


def compiling() -> tuple[int, float]:
    """The graphs dynamo has compiled in this process so far, and the seconds its
    compilations took (0 and 0.0 where torch does not say)."""
    try:
        from torch._dynamo import utils
    except ImportError:
        return 0, 0.0
    graphs = int(utils.counters["stats"].get("unique_graphs", 0))
    times = getattr(utils, "compilation_time_metrics", {})  # seconds per timed step
    inner = [values for name, values in times.items() if name.endswith("compile_inner")]
    seconds = float(sum(inner[0])) if inner else 0.0
    return graphs, seconds


def inductor_settings(settings: Mapping[str, object]) -> AbstractContextManager[object]:
    """A context in which inductor's ``settings`` (dotted names of
    ``torch._inductor.config``: ``"cpp.threads"``, ``"split_reductions"``) are in force,
    put back exactly after; a name this torch's inductor has not is refused."""
    from torch._inductor import config

    unknown = [name for name in settings if not _has(config, name)]
    if unknown:
        raise ValueError(f"torch {torch.__version__}'s inductor has no setting {unknown[0]!r}")
    return config.patch(dict(settings))


def _has(config: object, name: str) -> bool:
    head, _, rest = name.partition(".")
    if not hasattr(config, head):
        return False
    return _has(getattr(config, head), rest) if rest else True


#: ``version(tensor)``: the tensor's version counter, which moves whenever the tensor is
#: changed in place (a C-level getter: it runs in every hook).
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")

#: ``impl(tensor)``: the address of the tensor's C++ object. Between ops inside a forward
#: pass a tensor may have no Python object at all (and gets a new one, with a new id(),
#: each time Python sees it), so lineage across ops is keyed by this address.
impl: Callable[[torch.Tensor], int] = operator.attrgetter("_cdata")


def own_tensors(module: nn.Module
                ) -> tuple[Mapping[str, torch.Tensor | None], Mapping[str, torch.Tensor | None]]:
    """A module's own parameters and buffers (not its children's), by name, as
    ``named_parameters`` and ``named_buffers`` read them: the module's private dicts, read
    directly, since the public way starts a walk of its own per module."""
    return module._parameters, module._buffers


def foreach_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copies each source into its target, launched together."""
    torch._foreach_copy_(targets, sources)


@contextmanager
def forward_hooks(hooks: Sequence[tuple[nn.Module, Callable[..., object]]]) -> Iterator[None]:
    """Forward hooks that take the call's kwargs, on many modules, while inside: added as
    ``register_forward_hook(hook, with_kwargs=True)`` adds them (after the modules' own,
    with ids from the same counter), without a handle object per hook, and removed on
    exit, also when the body raised."""
    counter = torch.utils.hooks.RemovableHandle
    plain = nn.Module.register_forward_hook
    added: list[tuple[nn.Module, int]] = []
    handles: list[torch.utils.hooks.RemovableHandle] = []
    try:
        for module, hook in hooks:
            if type(module).register_forward_hook is not plain:  # its own rules (a
                # ScriptModule refuses hooks): asked the public way
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
                continue
            key = counter.next_id
            counter.next_id += 1
            module._forward_hooks[key] = hook
            module._forward_hooks_with_kwargs[key] = True
            added.append((module, key))
        yield
    finally:
        for module, key in added:
            module._forward_hooks.pop(key, None)
            module._forward_hooks_with_kwargs.pop(key, None)
        for handle in handles:
            handle.remove()


def cuda_driver() -> int | None:
    """The CUDA driver's version (e.g. 13000 for 13.0), or None without one."""
    try:
        return int(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None


class _ForwardTracker(ModuleTracker):
    """``ModuleTracker`` without its backward bookkeeping: divtrace's passes run without
    grad, and looking through every call's inputs and outputs for tensors that require it
    cost more than the rest of the tracking."""

    def _fw_pre_hook(self, mod: nn.Module, input: object) -> None:
        self.parents.add(self._get_mod_name(mod))

    def _fw_post_hook(self, mod: nn.Module, input: object, output: object) -> None:
        self.parents.discard(self._get_mod_name(mod))


def module_tracker(names: Mapping[nn.Module, str]) -> ModuleTracker:
    """``torch.utils.module_tracker.ModuleTracker`` (forward only) that knows the modules by
    ``names`` (their qualified names in the model) instead of naming them by their class."""
    tracker = _ForwardTracker()
    for module, name in names.items():
        tracker._known_modules[module] = name
        tracker._seen_modules.add(module)
    return tracker


#: The dispatch keys through which a ``TorchDispatchMode`` sees ops.
_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))


def modes_off() -> AbstractContextManager[object]:
    """A context in which no ``TorchDispatchMode`` sees the ops that run (divtrace's own
    work inside a recorded pass must not be recorded). Excluding the Python dispatch keys
    costs well under a microsecond; popping the modes (``_disable_current_modes``) ~10."""
    return torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS)


def function_mode_off(mode: object) -> AbstractContextManager[object]:
    """A context in which ``mode``, a ``TorchFunctionMode``, is not in force when it is the
    innermost one (divtrace's own work inside a pass that runs under one of its modes);
    it is back on exit. Elsewhere (inside a dispatch mode's handler, where no function mode
    is in force, or under another mode of the model's own) nothing changes. (torch's own
    ``_pop_mode_temporarily`` does the same as a generator: 2.3 µs a use against 1.6 here,
    around every site of a float64 replay.)"""
    depth = torch._C._len_torch_function_stack()
    if depth and torch._C._get_function_stack_at(depth - 1) is mode:
        return _InnermostOff()
    return nullcontext()


class _InnermostOff:
    """Takes the innermost function mode off the stack on entry, puts it back on exit."""

    __slots__ = ("_mode",)

    def __enter__(self) -> object:
        self._mode = torch._C._pop_torch_function_stack()
        return self._mode

    def __exit__(self, *exc: object) -> None:
        torch._C._push_on_torch_function_stack(self._mode)


@contextmanager
def generator_kept(device: torch.device) -> Iterator[None]:
    """Around a CUDA graph capture: if it fails, the device's default generator gets back
    a copy of its state from before. (A capture registers the generator; a capture that
    ends in an error leaves it marked as capturing, and every later random draw on the
    device raises "Offset increment outside graph capture".)"""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    before = generator.clone_state()
    try:
        yield
    except BaseException:
        generator.graphsafe_set_state(before)
        raise
