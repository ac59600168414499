import torch, divtrace, cProfile, pstats, time
from benchmarks.backward import CASES, llama, batch_of, by_tokens, model_loss, bare
from benchmarks.common import timed
case = CASES["cuda"]; dev = torch.device("cuda")
m = llama(case, dev, torch.bfloat16); b = batch_of(case, dev); w = by_tokens(b)
f = lambda: divtrace.compare_backward(m, b, model_loss, chunk=4, weight=w, progress=False, forward=False)
f(); bare(m, b, 4)
print("bare", timed(lambda: bare(m, b, 4), dev), "f", timed(f, dev))
torch.cuda.synchronize()
cProfile.run("f(); torch.cuda.synchronize()", "/tmp/prof3")
s = pstats.Stats("/tmp/prof3"); s.sort_stats("tottime").print_stats(22)
s.sort_stats("cumulative").print_stats(30)
