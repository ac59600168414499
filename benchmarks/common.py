"""What the suites share: the cases, the bare passes, timing, peak memory, an older
checkout imported beside this one, and ``compare()``'s arguments in either API."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import divtrace
from divtrace.plan.samples import chunks_for

#: Image models: the model, the batch, the input's side, run a's chunk, the samples.
CASES: dict[str, dict[str, Any]] = {
    "vgg11_features_b128_chunk2": {"model": "vgg11_features", "batch": 128, "size": 128,
                                   "chunk": 2, "samples": [0, 1]},
    "alexnet_b100_per_sample": {"model": "alexnet", "batch": 100, "size": 224, "chunk": 1,
                                "samples": None},
    "resnet50_b64_per_sample": {"model": "resnet50", "batch": 64, "size": 224, "chunk": 1,
                                "samples": None},
    "vgg11_features_b32_per_sample": {"model": "vgg11_features", "batch": 32, "size": 128,
                                      "chunk": 1, "samples": None},
    "mlp_b8_per_sample": {"model": "mlp", "batch": 8, "size": 256, "chunk": 1,
                          "samples": None},
    "mobilenet_v3_small_b16_chunk2": {"model": "mobilenet_v3_small", "batch": 16,
                                      "size": 64, "chunk": 2, "samples": [0, 1]},
    "efficientnet_b0_b16_chunk2": {"model": "efficientnet_b0", "batch": 16, "size": 64,
                                   "chunk": 2, "samples": [0, 1]},
    "resnet18_b16_chunk2": {"model": "resnet18", "batch": 16, "size": 64, "chunk": 2,
                            "samples": [0, 1]},
    "mobilenet_v3_small_b16_per_sample": {"model": "mobilenet_v3_small", "batch": 16,
                                          "size": 64, "chunk": 1, "samples": None},
}

#: What each option adds to ``compare()``'s arguments (this API).
OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "independence=off": {"explain": ["-independence"]},
    "precision=off": {"explain": ["-precision"]},
    "local": {"explain": ["local"]},
    "fp64": {"explain": ["fp64"]},
    "repeat=1": {"explain": [divtrace.Repeat(1)]},
    "kernels": {"explain": ["kernels"]},
    "graphs=False": {"resources": divtrace.Resources(graphs=False)},
    "keep": {"resources": divtrace.Resources(keep=True)},
}

#: The same options in the API before ``explain=`` (checkouts before it).
_OLD_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {}, "independence=off": {"independence": False}, "precision=off": {},
    "local": {"local": True},
    "fp64": {"truth": "fp64"}, "repeat=1": {"repeat": 1}, "kernels": {"kernels": True},
    "graphs=False": {"graphs": False}, "keep": {"keep": True},
}


def build(case: dict[str, Any], device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """A case's model (random weights, seed 0) and input, on ``device``."""
    import torchvision.models

    torch.manual_seed(0)
    name, size = case["model"], case["size"]
    if name == "mlp":  # a small model: passes of a few kernels
        layers = [nn.Sequential(nn.Linear(size, size), nn.GELU()) for _ in range(4)]
        return nn.Sequential(*layers).eval().to(device), torch.randn(case["batch"], size,
                                                                       device=device)
    model = (torchvision.models.vgg11().features if name == "vgg11_features"
             else getattr(torchvision.models, name)())
    x = torch.rand(case["batch"], 3, size, size)
    return model.eval().to(device), x.to(device)


def arguments(package: Any, chunk: int, samples: list[int] | None, option: str = "default"
              ) -> dict[str, Any]:
    """``compare()``'s keyword arguments for ``package`` (this divtrace or an older one,
    whichever API it has): run a in chunks of ``chunk``, ``samples``, ``option``."""
    if "explain" in inspect.signature(package.compare).parameters:
        return {"a": package.Run(chunk=chunk), "samples": samples, "progress": False,
                **_translated(package, OPTIONS[option])}
    return {"chunk": chunk, "samples": samples, "progress": False, **_OLD_OPTIONS[option]}


def _translated(package: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Options made with this divtrace's classes, remade with ``package``'s."""
    out = dict(options)
    if "explain" in out:
        out["explain"] = [package.Repeat(p.times) if isinstance(p, divtrace.Repeat) else p
                          for p in out["explain"]]
    if "resources" in out:
        given = out["resources"]
        out["resources"] = package.Resources(keep=given.keep, offload=given.offload,
                                             graphs=given.graphs)
    return out


def use_seed_settings(device: torch.device) -> None:
    """The settings of the seed reports on CUDA: cuDNN deterministic, no benchmark, TF32
    off."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def bare_passes(model: nn.Module, x: torch.Tensor, case: dict[str, Any]) -> None:
    """What ``compare()`` must run at least: run a's chunks holding the compared samples,
    and the batched pass, without hooks."""
    samples = case["samples"] or list(range(case["batch"]))
    with torch.no_grad():
        for start, stop in chunks_for(samples, case["chunk"], case["batch"]):
            model(x[start:stop])
        model(x)


def floor_passes(model: nn.Module, x: torch.Tensor, case: dict[str, Any],
                 notes: dict[str, Any], other: torch.Tensor) -> None:
    """The floor of the default: the bare passes, then the passes the verdict's tests
    made in the call whose ``meta.notes`` are given, without divtrace — one batched pass
    per group of the independence test (``other``: the batch with other values, made
    beforehand), and for the precision test a float64 copy of the model with the bare
    passes again in float64. The tests' further passes (rows that moved) are left out:
    a lower bound."""
    bare_passes(model, x, case)
    independence, precision = notes.get("independence", {}), notes.get("precision", {})
    with torch.no_grad():
        for _ in range(independence.get("groups", 0) if independence.get("ran") else 0):
            model(other)
    if precision.get("ran"):
        import copy

        double = copy.deepcopy(model).double()
        bare_passes(double, x.double(), case)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``fn()``, its GPU work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@contextmanager
def calls_timed(targets: Iterable[tuple[Any, str, str]], record: Callable[[str, float], object],
                device: torch.device | None = None) -> Iterator[None]:
    """While inside, each ``(owner, attribute, label)`` of ``targets`` times its calls and
    hands ``(label, seconds)`` to ``record`` (on CUDA with ``device``: after a
    synchronisation, so the seconds hold the call's GPU work); put back on exit."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def wrap(original: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if device is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                record(label, time.perf_counter() - began)
        return timed_call

    for (owner, name, original), (_, _, label) in zip(originals, targets, strict=True):
        setattr(owner, name, wrap(original, label))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def peak(fn: Callable[[], object], device: torch.device) -> tuple[int, object]:
    """Peak memory of ``fn()`` above the memory in use before it, and its result: on
    CUDA the allocator's peak; on the CPU the resident set's high-water mark (Linux; only
    in a process where glibc maps large blocks, so that frees leave the resident set:
    :func:`cpu_peaks`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    out = fn()
    return (_status_kib("VmHWM") - base) * 1024, out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


#: The setting that makes glibc map every block of 64 KiB or more, and unmap it when
#: freed: the resident set then shows frees, but every such block faults its pages in
#: afresh, which a process with glibc's own setting seldom does (docs/performance.md).
_MAPPED = ("MALLOC_MMAP_THRESHOLD_", "65536")


def measures_peaks(device: torch.device) -> bool:
    """Whether this process measures peak memory: always on CUDA; on the CPU only the
    child process of :func:`cpu_peaks` (the others time with glibc's own setting)."""
    return device.type == "cuda" or os.environ.get(_MAPPED[0]) == _MAPPED[1]


def cpu_peaks(suite: str, argv: list[str]) -> dict[str, Any]:
    """On the CPU, the peak-memory figures of ``python -m benchmarks SUITE ARGV``, run
    again in a child process with glibc mapping large blocks (``--peaks FILE``: the JSON
    it writes, read back here); an empty dict in a process that measures its own peaks
    (:func:`measures_peaks`)."""
    if measures_peaks(torch.device("cpu")):
        return {}
    with tempfile.TemporaryDirectory() as folder:
        found = Path(folder) / "peaks.json"
        subprocess.run([sys.executable, "-m", "benchmarks", suite, *argv, "--peaks",
                        str(found)], check=True, env=os.environ | dict([_MAPPED]),
                       stdout=subprocess.DEVNULL)
        peaks: dict[str, Any] = json.loads(found.read_text())
    return peaks


def load_old(checkout: Path) -> Any:
    """The divtrace package of ``checkout`` (a worktree of an older commit), imported as
    ``divtrace_old`` beside this one."""
    target = Path(tempfile.mkdtemp()) / "divtrace_old"
    shutil.copytree(checkout / "divtrace", target)
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(from|import) divtrace\b", r"\1 divtrace_old", text))
    sys.path.insert(0, str(target.parent))
    return importlib.import_module("divtrace_old")


def stored_bytes(result: Any) -> int:
    """The bytes of run a's rows a comparison kept (its meta a record, or an older
    version's dict)."""
    meta = result.meta
    return int(meta["stored_bytes"] if isinstance(meta, dict) else meta.stored_bytes)


def environment(device: torch.device) -> dict[str, Any]:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def llama(case: dict[str, Any], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A Llama of ``case``'s shape with random weights, made on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=case["hidden"], intermediate_size=case["mlp"],
                         num_hidden_layers=case["layers"], num_attention_heads=case["heads"],
                         num_key_value_heads=case["kv_heads"], vocab_size=case["vocab"],
                         max_position_embeddings=max(2048, case.get("tokens", 0)))
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def llama_8b(device: str | torch.device = "cuda") -> nn.Module:
    """An 8B-shaped Llama (hidden 4096, 32 layers, vocabulary 128256, SDPA), random init
    from its config, in bfloat16 on ``device``, in eval mode: the GPU scripts' large model."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def cuda_timed(work: Callable[[], Any]) -> tuple[Any, float]:
    """``work()``'s result and its wall time, the CUDA queue drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = work()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start
