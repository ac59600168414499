"""Run under torchrun by the tests (two processes, gloo): tensor-parallel models against
the same models unsharded, through compare_models, and one against itself (batched
against split, through compare). Each rank writes what it found as JSON to the folder
given as the first argument; the second names the case (mlp, llama, sequence, split)."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace


class Block(nn.Module):
    """Up (column-parallel), an activation on the local shard, down (row-parallel)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def mlp() -> tuple[nn.Module, dict[str, Any], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(Block(64, 256), Block(64, 256), nn.Linear(64, 10)).eval()
    plan: dict[str, Any] = {f"{i}.up": ColwiseParallel() for i in range(2)}
    plan |= {f"{i}.down": RowwiseParallel() for i in range(2)}
    return model, plan, torch.randn(16, 64)


def llama() -> tuple[nn.Module, dict[str, Any], Any]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    plan: dict[str, Any] = {}
    for i in range(2):
        layer = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{layer}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{layer}.{name}"] = RowwiseParallel()
    return model, plan, torch.randint(0, 100, (4, 12))


class Sequence(nn.Module):
    """A norm, an MLP and a norm over a residual stream sharded along the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.entry = nn.Identity()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.down = nn.Linear(64, 32)
        self.out = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.entry(x))
        return self.out(h + self.down(self.act(self.up(h))))


def sequence() -> tuple[nn.Module, dict[str, Any], Any]:
    torch.manual_seed(0)
    plan = {"entry": PrepareModuleInput(input_layouts=Replicate(), use_local_output=False,
                                        desired_input_layouts=Shard(1)),
            "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "out": SequenceParallel()}
    return Sequence().eval(), plan, torch.randn(4, 8, 32)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _by_hand(single: nn.Module, sharded: nn.Module, x: Any, sites: dict[str, int]
             ) -> dict[str, float]:
    """rel_l2 at each of ``sites`` (a module name: the dimension its output is sharded
    along, or -0 for none), its local outputs gathered by hand."""
    seen: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    found = {}
    for name, dim in sites.items():
        for which, model in (("a", single), ("b", sharded)):
            module = model.get_submodule(name)
            handle = module.register_forward_hook(
                lambda _m, _i, out, w=which: seen[w].append(out.detach().clone()))
            with torch.no_grad():
                model(x)
            handle.remove()
        b = seen["b"].pop()
        if isinstance(b, DTensor):
            b = b.full_tensor()
        elif dim is not None:
            parts = [torch.empty_like(b) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, b.contiguous())
            b = torch.cat(parts, dim=dim)
        a = seen["a"].pop().double()
        found[name] = float((b.double() - a).norm() / a.norm())
    return found


def _stacked_by_hand(sharded: nn.Module, x: torch.Tensor, name: str, chunk: int) -> float:
    """rel_l2 at ``name`` of the batched pass against passes of ``chunk`` rows, every
    rank's local output stacked by hand."""
    seen: list[torch.Tensor] = []
    handle = sharded.get_submodule(name).register_forward_hook(
        lambda _m, _i, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        sharded(x)
        for start in range(0, len(x), chunk):
            sharded(x[start:start + chunk])
    handle.remove()
    runs = []
    for local in (seen[0], torch.cat(seen[1:])):
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        runs.append(torch.stack(parts, dim=-1).double())
    return float((runs[0] - runs[1]).norm() / runs[1].norm())


def split(out: Path) -> None:
    """Batched against split on the tensor-parallel model itself."""
    model, plan, x = mlp()
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), plan)
    before = _hooks(model)
    found = divtrace.compare(model, x, progress=False)  # per sample
    first = found.first_divergence
    (out / f"split{dist.get_rank()}.json").write_text(json.dumps({
        "table": found.table[["site", "status", "role", "mismatch", "rel_l2"]].to_dict("list"),
        "verdict": found.verdict, "summary": found.summary(), "kind": found.meta.kind,
        "by_hand": {name: _stacked_by_hand(model, x, name, 1) for name in ("0.up", "1.down")},
        "first": None if first is None else first["site"], "hooks_left": _hooks(model) - before}))


def main() -> None:
    out, case = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    if case == "split":
        split(out)
    else:
        pair(out, case)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's finalisation: gloo's worker threads can still be
    # torn down there, which now and then aborts a rank ("terminate called without an
    # active exception") after its results are written and the group is destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pair(out: Path, case: str) -> None:
    """The sharded model against itself unsharded."""
    world = dist.get_world_size()
    single, plan, x = {"mlp": mlp, "llama": llama, "sequence": sequence}[case]()
    sharded = copy.deepcopy(single)
    parallelize_module(sharded, init_device_mesh("cpu", (world,)), plan)
    before = _hooks(sharded) + _hooks(single)
    found = divtrace.compare_models(single, sharded, x, progress=False)
    left = _hooks(sharded) + _hooks(single) - before
    sites = {"mlp": {"0.up": -1, "0.act": -1, "0.down": None, "1.up": -1},
             "llama": {"model.layers.0.mlp.up_proj": -1, "model.layers.0.mlp.down_proj": None},
             "sequence": {"norm": None, "up": -1, "down": None}}[case]
    first = found.first_divergence
    (out / f"{case}{dist.get_rank()}.json").write_text(json.dumps({
        "table": found.table[["site", "status", "role", "mismatch", "rel_l2"]].to_dict("list"),
        "verdict": found.verdict, "summary": found.summary(), "kind": found.meta.kind,
        "by_hand": _by_hand(single, sharded, x, sites),
        "first": None if first is None else first["site"], "hooks_left": left}))


if __name__ == "__main__":
    main()
