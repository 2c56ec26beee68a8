# Temporary GPU diagnosis (not part of the suite): where the first NaN appears.
import sys, torch, contextlib
sys.path.insert(0, "tests")
import trainstream
from trainstream.bench.models import GPT, GPTConfig
for ac in (torch.bfloat16, None):
    torch.manual_seed(0)
    m = GPT(GPTConfig(dim=2048, layers=3, heads=16, vocab=32000))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    m, opt = trainstream.wrap(m, opt, device="cuda", param_offload=True, activation_offload=False)
    eng = m._trainstream_engine
    for step in range(5):
        g = torch.Generator().manual_seed(step); idx = torch.randint(0, 32000, (8, 512), generator=g).cuda()
        with torch.autocast("cuda", dtype=ac, enabled=ac is not None):
            loss = m(idx, torch.roll(idx, -1, 1))
        loss.backward()
        bad = []
        eng.synchronize()
        for u in eng.units:
            for s in u.trainable:
                if s.stage is not None and not torch.isfinite(s.stage).all(): bad.append(("stage", s.name, s.stage.dtype))
        opt.step()
        eng.synchronize()
        for u in eng.units:
            for s in u.trainable:
                for d, t in s.host.items():
                    if not torch.isfinite(t).all(): bad.append(("host", s.name, d))
                st = opt.state[s.param]
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st and not torch.isfinite(st[k]).all(): bad.append((k, s.name))
        opt.zero_grad()
        print(ac, step, float(loss), bad[:6], len(bad), flush=True)
