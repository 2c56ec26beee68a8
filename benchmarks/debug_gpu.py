# Temporary GPU diagnosis of paging on CUDA (not part of the suite).
import sys, torch
sys.path.insert(0, "tests")
from engine_models import train, PAGED, RESIDENT, tiny_mlp, max_diff
from trainstream.bench.models import GPT, GPTConfig
CONFIGS = (("resident", RESIDENT), ("weights", dict(param_offload=True, activation_offload=False)),
           ("acts0", dict(param_offload=False, activation_offload=True, min_offload_bytes=0)),
           ("both", dict(PAGED)), ("cap", dict(PAGED, max_inflight_bytes=1)))
factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)
for steps in (1, 2, 4):
    stock = train("mlp", None, device="cuda", steps=steps, lr=1e-3, model_factory=factory)
    for label, o in CONFIGS:
        w = train("mlp", o, device="cuda", steps=steps, lr=1e-3, model_factory=factory)
        print("mlp", steps, label, "maxdiff", max_diff(stock[1], w[1]), "loss", w[0][-1], stock[0][-1], flush=True)
def gfactory():
    m = GPT(GPTConfig(dim=2048, layers=3, heads=16, vocab=32000))
    def batch(i, d):
        g = torch.Generator().manual_seed(i); idx = torch.randint(0, 32000, (8, 512), generator=g)
        return idx.to(d), torch.roll(idx, -1, 1).to(d)
    return m, batch, lambda m, b: m(*b)
for label, o in CONFIGS[:4]:
    l, sd, _ = train("x", o, device="cuda", steps=3, autocast=torch.bfloat16, lr=1e-4, model_factory=gfactory)
    print("gpt", label, l, flush=True)
