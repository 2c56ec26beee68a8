# Temporary GPU diagnosis (not part of the suite): are saved weights finite when unpacked?
import sys, torch
import trainstream
from trainstream.engine import params as P, engine as E
from trainstream.bench.models import GPT, GPTConfig
orig_view = P.WeightPager.device_view
def view(self, slot, dtype, size, stride, offset):
    v = orig_view(self, slot, dtype, size, stride, offset)
    torch.cuda.synchronize()
    dev = slot.unit.fetched[slot]
    print("unpack", slot.name, dtype, tuple(size), stride, offset, "finite", bool(torch.isfinite(v).all()),
          "dev finite", bool(torch.isfinite(dev).all()), "eq master", bool(torch.equal(dev.float().cpu(), slot.host[torch.float32])), flush=True)
    return v
P.WeightPager.device_view = view
orig_pack = E.Engine.pack
def pack(self, unit, t):
    r = orig_pack(self, unit, t)
    if isinstance(r, E.SavedWeight):
        print("pack", r.slot.name, t.dtype, tuple(t.shape), t.stride(), flush=True)
    return r
E.Engine.pack = pack
for vocab, dim in ((32000, 2048), (512, 2048)):
    torch.manual_seed(0)
    m = GPT(GPTConfig(dim=dim, layers=2, heads=16, vocab=vocab))
    m, opt = trainstream.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-4), device="cuda", param_offload=True, activation_offload=False)
    eng = m._trainstream_engine
    idx = torch.randint(0, vocab, (8, 512)).cuda()
    loss = m(idx, torch.roll(idx, -1, 1)); loss.backward(); eng.synchronize(); torch.cuda.synchronize()
    print("VOCAB", vocab, float(loss), [s.name for u in eng.units for s in u.trainable if not torch.isfinite(s.stage).all()], flush=True)
