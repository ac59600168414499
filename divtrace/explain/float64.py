"""A replay that stays in float64: casts down to a coarser floating dtype are kept out.

A model cast to float64 can still round in float32 where its code says so
(``hidden.to(torch.float32)`` in an RMSNorm, ``inv_freq.float()`` in rotary
embeddings, ``softmax(..., dtype=torch.float32)`` in attention): such a cast would put
float32 rounding back into the replay. While :class:`KeptFloat64` is in force, a cast of
a float64 tensor to float32, float16 or bfloat16 returns the float64 tensor itself (and a
cast of anything else to one of them, float64 values), a function asked for a coarser
``dtype=`` computes in float64; every other function runs as it is. The
sinks of the replay run with it off (:class:`Unmoded`), so divtrace's own work is not
touched.

:func:`replayed` runs both runs so and measures them against each other. Where one pass
of run a holds every compared sample, run b's pass is stored first and run a's measured
against it (:mod:`~divtrace.measure.reversed`): run b's rows fill as its activations are
freed, instead of run a's float64 rows being all held through run b's batched pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from divtrace.align.sites import Site
from divtrace.compat import function_mode_off
from divtrace.explain.held import REL_READS, figures_of
from divtrace.kinds.kind import Kind
from divtrace.measure.chunked import compare_stores
from divtrace.measure.host import Host
from divtrace.measure.meter import Meter
from divtrace.measure.reversed import ReversedMeter, within_pass
from divtrace.record.lineage import InputPart
from divtrace.record.recorder import Sink, Tracker
from divtrace.record.rows import RowStore
from divtrace.record.runner import Runner

if TYPE_CHECKING:
    from divtrace.explain.context import Context

__all__ = ["KeptFloat64", "Unmoded", "replayed"]

_CASTS = frozenset({torch.Tensor.to, torch.Tensor.float, torch.Tensor.half,
                    torch.Tensor.bfloat16, torch.Tensor.type, torch.Tensor.type_as})
_COARSER = frozenset({torch.float32, torch.float16, torch.bfloat16})


class KeptFloat64(TorchFunctionMode):
    """Casts to a coarser floating dtype give float64: a float64 tensor stays itself."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("dtype") in _COARSER:  # softmax(dtype=float32), arange(dtype=...)
            kwargs = {**kwargs, "dtype": torch.float64}
        out = func(*args, **kwargs)
        if func not in _CASTS or not args:
            return out
        given = args[0]
        if not isinstance(out, torch.Tensor) or out.dtype not in _COARSER:
            return out
        if isinstance(given, torch.Tensor) and given.dtype == torch.float64 and (
                given.device == out.device):
            return given
        return out.to(torch.float64)  # ids made floating, constants: float64 too


@dataclass
class Unmoded(Sink):
    """Hands ``sink`` everything with the innermost function mode (the replay's
    :class:`KeptFloat64`) out of force meanwhile: divtrace's own work runs as it does
    elsewhere, without a mode's Python call around every op."""

    sink: Sink
    mode: KeptFloat64

    def begin_chunk(self, start: int, stop: int, tracker: Tracker) -> None:
        with function_mode_off(self.mode):
            self.sink.begin_chunk(start, stop, tracker)

    def pass_rows(self, start: int, stop: int) -> int:
        with function_mode_off(self.mode):
            return int(self.sink.pass_rows(start, stop))

    def piece(self, tokens: Any, rows: int) -> None:
        with function_mode_off(self.mode):
            self.sink.piece(tokens, rows)

    def on_call(self, call: Site, module: nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], output: Any, tracker: Tracker) -> None:
        with function_mode_off(self.mode):
            self.sink.on_call(call, module, args, kwargs, output, tracker)

    def on_op(self, call: Site, op: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any], parts: list[InputPart], tracker: Tracker) -> None:
        with function_mode_off(self.mode):
            self.sink.on_op(call, op, args, kwargs, parts, tracker)

    def on_tensor(self, site: Site, tensor: torch.Tensor) -> None:
        with function_mode_off(self.mode):
            self.sink.on_tensor(site, tensor)

    def end_chunk(self) -> bool:
        with function_mode_off(self.mode):
            return bool(self.sink.end_chunk())


def replayed(ctx: Context, a: Runner, b: Runner, step: Callable[[], object]
             ) -> dict[str, float]:
    """Per site: the rel_l2 of run b's float64 replay ``b`` against run a's ``a`` (both
    run under :class:`KeptFloat64`; ``step`` after each pass)."""
    plan = ctx.plan
    store = ctx.kind.store(plan, list(plan.samples), offload=plan.offload,
                           learn_lineage=False)
    host = Host()
    first = _batched_first(ctx, store)
    size = plan.batch.batch_size
    start, stop = plan.a_chunks[0] if first else (0, size)
    meter = (ReversedMeter(within_pass(store, start), stop - start, host, ctx.meter.rtol,
                           ctx.meter.atol, lineage=False, views=False, reads=REL_READS)
             if first else ctx.meter.over(store, host, REL_READS))  # what rel_l2 reads
    other: RowStore | None = None  # run b's rows, when it runs in chunks

    def run(runner: Runner, sink: Sink, chunks: list[tuple[int, int]]) -> None:
        runner.execute(Unmoded(sink, mode), plan.batch, chunks, lambda _s, _e: runner.name,
                       step, ctx.check)

    with KeptFloat64() as mode:  # float64 throughout, the model's own casts too
        if first:
            run(b, store, [(0, size)])
            run(a, meter, list(plan.a_chunks))
        elif plan.b_chunks:
            other = ctx.kind.store(plan, list(plan.samples), offload=plan.offload,
                                   learn_lineage=False)
            run(a, store, list(plan.a_chunks))
            run(b, other, list(plan.b_chunks))
        else:
            run(a, store, list(plan.a_chunks))
            run(b, meter, [(0, size)])
    if other is not None:
        compare_stores(meter, other, size)
    meter.flush()
    host.fetch()
    # (the measured sites' shapes are those of the pass the meter saw: its rows)
    return {key: rel for key, (_, rel) in figures_of(meter, meter.batch).items()}


def _batched_first(ctx: Context, store: RowStore) -> bool:
    """Whether run b's pass is stored first and run a's measured against it: one pass
    each, run a's holding every compared sample, kept in a plain row store and measured
    by a plain meter (a kind with a store, a meter or an adapter of its own keeps the
    usual order)."""
    plan = ctx.plan
    return (len(plan.a_chunks) == 1 and not plan.b_chunks and type(store) is RowStore
            and type(ctx.meter) is Meter and type(ctx.kind).wrap is Kind.wrap)
