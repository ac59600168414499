"""Experiment: one shared reduction of a site's prompts' partial blocks (padded with the
kernel's own zero blocks to the longest) instead of one per prompt: speed and how far the
figures move."""
import statistics, time, torch, numpy as np
import divtrace
from divtrace.measure import fused, ragged
from divtrace.measure.stats import reduce_blocks
from divtrace.measure.fields import FIELDS
from benchmarks.lm import PROMPTS, _llama

exact = fused.fused_many_placed

def shared(pairs, rtol, atol):
    device, dtype = pairs[0][0].device, pairs[0][0].dtype
    pairs = [(b if b.stride(1) == 1 else b.contiguous(), r if r.stride(1) == 1 else r.contiguous()) for b, r in pairs]
    top = max(max(1, fused.triton.cdiv(b.shape[1], fused._BLOCK)) for b, _ in pairs)
    rows = sum(b.shape[0] for b, _ in pairs)
    out = torch.empty((rows, top, len(FIELDS)), dtype=torch.float64, device=device)
    records, kinds, spans, at = [], {}, [], 0
    for i, (b, r) in enumerate(pairs):
        records.append((b.data_ptr(), r.data_ptr(), out.data_ptr() + at * top * len(FIELDS) * 8, b.shape[1], b.stride(0), r.stride(0), top))
        kinds.setdefault((b.data_ptr() % 16 == 0, r.data_ptr() % 16 == 0, b.stride(0) % 16 == 0, r.stride(0) % 16 == 0, b.shape[1] % 16 == 0), []).append(i)
        spans.append((at, at + b.shape[0])); at += b.shape[0]
    for kind, members in kinds.items():
        fused._launch([records[i] for i in members], [pairs[i][0].shape[0] * top for i in members], kind, device, dtype, rtol, atol)
    fields = out[:, 0] if top == 1 else reduce_blocks(out, 1)
    return [(fields, span) for span in spans]

case = PROMPTS["cuda"]; device = torch.device("cuda")
model = _llama(case, device)
g = torch.Generator().manual_seed(0)
lengths = torch.linspace(case["shortest"], case["longest"], case["prompts"]).round()
given = divtrace.Prompts([torch.randint(3, case["vocab"], (int(n),), generator=g).to(device) for n in lengths.tolist()], padding_side="left")
def run(fn):
    ragged.fused.fused_many_placed = fn
    try:
        return divtrace.compare(model, given, progress=False)
    finally:
        ragged.fused.fused_many_placed = exact
# fused is imported as a module in ragged: patch the attribute the module uses
for fn in (exact, shared, exact, shared): run(fn)
times = {"exact": [], "shared": []}
for _ in range(7):
    for name, fn in (("exact", exact), ("shared", shared)):
        torch.cuda.synchronize(); t = time.perf_counter(); run(fn); torch.cuda.synchronize()
        times[name].append(time.perf_counter() - t)
for k, v in times.items(): print(k, "median", round(statistics.median(v), 3), "s", [round(x, 3) for x in v])
a, b = run(exact).table, run(shared).table
print("tables equal:", a.equals(b))
for col in ("rel_l2", "max_abs", "mean_abs", "cosine", "mismatch", "exceed", "max_ulp"):
    x, y = a[col].to_numpy(float), b[col].to_numpy(float)
    ok = np.isfinite(x) & np.isfinite(y)
    differ = int((x[ok] != y[ok]).sum())
    rel = np.abs(x[ok] - y[ok]) / np.maximum(np.abs(x[ok]), 1e-300)
    print(f"{col}: {differ} of {ok.sum()} rows differ; largest relative change {rel.max():.3g}")
