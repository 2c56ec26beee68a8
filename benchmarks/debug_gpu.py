# Temporary GPU diagnosis (not part of the suite): which sync point removes the mismatch.
import os, subprocess, sys
code = r'''
import sys, torch
sys.path.insert(0, "tests")
from engine_models import train, PAGED, tiny_mlp, max_diff
from trainstream.bench.models import GPT, GPTConfig
factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)
stock = train("mlp", None, device="cuda", steps=4, lr=1e-3, model_factory=factory)
out = []
for rep in range(2):
    w = train("mlp", dict(PAGED, max_inflight_bytes=1), device="cuda", steps=4, lr=1e-3, model_factory=factory)
    out.append(max_diff(stock[1], w[1]))
def gfactory():
    m = GPT(GPTConfig(dim=2048, layers=3, heads=16, vocab=32000))
    def batch(i, d):
        g = torch.Generator().manual_seed(i); idx = torch.randint(0, 32000, (8, 512), generator=g)
        return idx.to(d), torch.roll(idx, -1, 1).to(d)
    return m, batch, lambda m, b: m(*b)
l, sd, _ = train("x", dict(param_offload=True, activation_offload=False), device="cuda", steps=4, autocast=torch.bfloat16, lr=1e-4, model_factory=gfactory)
print("RESULT", "mlpcap", ["%.2g" % d for d in out], "gpt", ["%.5f" % x for x in l], flush=True)
'''
for points in ["", "all", "fetch", "attach", "release", "push", "pack,packweight", "unpack,actfetch", "grad", "handon", "bwdstart"]:
    env = dict(os.environ, TRAINSTREAM_DEBUG_SYNC=points)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    res = [l for l in r.stdout.splitlines() if l.startswith("RESULT")]
    print(repr(points), res[0] if res else r.stderr[-500:], flush=True)
