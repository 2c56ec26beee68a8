# Temporary GPU diagnosis of paging on CUDA (not part of the suite).
import sys, torch
sys.path.insert(0, "tests")
from engine_models import train, PAGED, RESIDENT
from trainstream.bench.models import GPT, GPTConfig
def factory():
    m = GPT(GPTConfig(dim=256, layers=4, heads=4, vocab=512))
    def batch(i, d):
        g = torch.Generator().manual_seed(i); idx = torch.randint(0, 512, (4, 64), generator=g)
        return idx.to(d), torch.roll(idx, -1, 1).to(d)
    return m, batch, lambda m, b: m(*b)
for ac in (None, torch.bfloat16):
    for label, o in (("resident", RESIDENT), ("weights", dict(param_offload=True, activation_offload=False)),
                     ("acts0", dict(param_offload=False, activation_offload=True, min_offload_bytes=0)),
                     ("acts1M", dict(param_offload=False, activation_offload=True)),
                     ("both", dict(PAGED))):
        l, sd, _ = train("x", o, device="cuda", steps=4, autocast=ac, lr=1e-3, model_factory=factory)
        print(ac, label, [round(x, 6) for x in l], flush=True)
