"""What the tests share: wrap() options, a training loop, a simulated machine for the
planner, and the comparisons (bits of tensors, of whole training runs)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

import torch
from models import MODELS, tiny_gpt

import trainstream

PAGED = dict(param_offload=True, activation_offload=True, min_offload_bytes=0)
RESIDENT = dict(param_offload=False, activation_offload=False)
AUTO = dict(param_offload="auto", activation_offload="auto")
GPU_MODE = dict(optimizer_mode="gpu")


def train(
    name: str,
    wrap_options: dict | None,
    *,
    steps: int = 10,
    device: str = "cpu",
    autocast=None,
    accumulation: int = 1,
    clip: float | None = None,
    lr: float = 1e-2,
    dtype=None,
    freeze=None,
    seed: int = 0,
    model_factory=None,
):
    """Train `name` for `steps` steps, stock (wrap_options None) or wrapped; return the
    losses, a host copy of the final state dict, and (model, optimizer)."""
    torch.manual_seed(seed)
    model, batch, loss_fn = (model_factory or MODELS[name])()
    if dtype is not None:
        model = model.to(dtype)
    if freeze is not None:
        for n, p in model.named_parameters():
            if freeze(n):
                p.requires_grad_(False)
    if wrap_options is None:
        model = model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01, foreach=False)
    if wrap_options is not None:
        # offload=True unless a test asks otherwise: "auto" would switch these small models to
        # stock training after two steps, and the tests are about the engine.
        opts = dict(device=device, accumulation_steps=accumulation, max_grad_norm=clip, offload=True)
        opts.update(wrap_options)
        model, opt = trainstream.wrap(model, opt, **opts)
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            ctx = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model, batch(step * accumulation + micro, device))
            (loss / accumulation).backward()
            losses.append(loss.item())
        if wrap_options is None and clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return losses, state, (model, opt)


def gpt_steps(mode: str, steps: int = 3, before_step=None):
    """tiny_gpt wrapped with every block resident, trained `steps` steps under
    optimizer_mode=`mode`: (model, optimizer). `before_step(i, engine)` runs before step i's
    forward, between steps."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        offload=True,
        optimizer_mode=mode,
        **RESIDENT,
    )
    for i in range(steps):
        if before_step is not None:
            before_step(i, model._trainstream_engine)
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def machine_bytes(ram_bytes: int, vram_bytes: int = 1 << 40, pinned_bytes: int | None = None):
    """A simulated machine for the planner, in bytes, with 25 GB/s links each way."""
    from trainstream.planner import HardwareProfile

    return HardwareProfile(
        vram_total_bytes=vram_bytes,
        vram_free_bytes=vram_bytes,
        ram_available_bytes=ram_bytes,
        pinned_limit_bytes=ram_bytes if pinned_bytes is None else pinned_bytes,
        h2d_bytes_per_s=25e9,
        d2h_bytes_per_s=25e9,
    )


def machine(vram_gib=24.0, ram_gib=64.0, pinned_gib=None):
    """A simulated machine for the planner (the figures any test may set by keyword), in GiB."""
    return machine_bytes(
        ram_bytes=int(ram_gib * 2**30),
        vram_bytes=int(vram_gib * 2**30),
        pinned_bytes=int((pinned_gib or ram_gib) * 2**30),
    )


def bits(t):
    """A tensor's bits, as integers of its element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(a, b):
    """Two tensors of the same dtype and shape with the same bits; or two training runs
    ((losses, state dict, ...) as train() returns them) with the same losses and the same
    final state dict, bit for bit."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b)), f"{(bits(a) != bits(b)).sum().item()} of {a.numel()} elements differ"
        return
    la, sa = a[0], a[1]
    lb, sb = b[0], b[1]
    assert la == lb, f"losses differ: {la} vs {lb}"
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs (max {(sa[k].float() - sb[k].float()).abs().max()})"


def max_diff(sa, sb) -> float:
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def collected(condition, timeout_s: float = 10.0) -> bool:
    """Collect garbage until `condition()` holds, for at most `timeout_s`: a wrapped model is
    freed by a collection (its engine and the model refer to each other), once the lander
    thread has let go of the unit whose update it was waiting for."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def cuda_bytes_held() -> int:
    """Bytes the caching allocator has handed out, less cuBLAS's workspaces: torch keeps one
    per (handle, stream) that ran a matmul for the life of the process, so a test's first
    matmul on a stream would otherwise read as memory its model never gave back."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


def live_cuda_tensors() -> list:
    """(shape, dtype) of the CUDA tensors Python still holds, largest first (a failure's message)."""
    found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    found.sort(key=lambda t: -t.untyped_storage().nbytes())
    return [(tuple(t.shape), t.dtype) for t in found[:8]]


def run_ranks(entry, world: int, root: str, args_of_rank, join_s: float) -> list:
    """Start `entry(*args_of_rank(r))` in a spawned process for each rank r, wait up to
    `join_s` for each (a rank still running past it is killed: a hang fails the test, not
    CI), and return what each saved as ROOT/rank<r>.pt (None where a rank saved nothing)."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=entry, args=args_of_rank(r)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(join_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for r in range(world):
        path = os.path.join(root, f"rank{r}.pt")
        out.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return out


@contextlib.contextmanager
def planned_recompute(monkeypatch, blocks):
    """wrap() plans `blocks` recomputed (the plan_run of wrap() returns them in the plan); no
    replan moves them (the CPU backend measures no peak, so only the settling replans would)."""
    from trainstream import api
    from trainstream.engine.adapt import Adapter

    real = api.plan_run

    def plan_run(opts, layout, profile, backend):
        plan = real(opts, layout, profile, backend)
        return dataclasses.replace(plan, recompute=tuple(b for b in blocks if b not in plan.act_paged))

    with monkeypatch.context() as m:
        m.setattr(api, "plan_run", plan_run)
        m.setattr(Adapter, "SETTLE_STEPS", 0)
        yield


class FakeDevice:
    """Device memory as the adapter reads it: `now` (allocated), and a peak counter."""

    def __init__(self, adapter, now):
        self.now, self.peak = now, now
        adapter.allocated = lambda: self.now
        adapter.device_peak = lambda: self.peak
        adapter.counters = lambda: {"current": self.now, "peak": self.peak}  # both in one read


def on_a_nearly_full_card(make):
    """`make`'s model (built after torch.manual_seed(0), optimized as train() optimizes)
    wrapped with its weights resident and activation_offload="auto" for an 8 MiB card whose
    device memory reads full but for room for about three small blocks' activations:
    (model, optimizer, adapter, batch, loss_fn). The online guard acts in the first pass."""
    torch.manual_seed(0)
    model, batch, loss_fn = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    model, opt = trainstream.wrap(
        model,
        opt,
        device="cpu",
        offload=True,
        param_offload=False,
        activation_offload="auto",
        profile=machine(vram_gib=8 / 1024),
    )
    adapter = model._trainstream_engine.adapter
    FakeDevice(adapter, adapter.usable - 3 * 8192)
    return model, opt, adapter, batch, loss_fn
