"""The offload engine on the CPU path (device="cpu": the same hooks and bookkeeping as on a
GPU, with streams as no-ops) and, for tests marked gpu, on CUDA."""

import copy
import dataclasses
import gc
import os
import subprocess
import sys

import pytest
import torch
from engine_models import PAGED, RESIDENT, assert_same_bits, checkpointed_gpt, max_diff, tiny_gpt, tiny_mlp, train

import trainstream

CPU_MODELS = ["gpt", "mlp", "llama", "qwen2"]


# -- paging is bit-exact -------------------------------------------------------------------------


@pytest.mark.parametrize("name", CPU_MODELS)
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_paging_is_bit_exact(name, autocast):
    resident = train(name, RESIDENT, autocast=autocast)
    paged = train(name, PAGED, autocast=autocast)
    assert_same_bits(resident, paged)
    report = trainstream.memory_report(paged[2][0])
    assert report["params"]["paged_blocks"] and report["paged_activation_bytes"] > 0


def test_autocast_pages_linear_weights_in_bf16():
    _, _, (model, _) = train("gpt", PAGED, autocast=torch.bfloat16, steps=2)
    engine = model._trainstream_engine
    slots = {s.name: s for u in engine.block_units for s in u.slots}
    assert torch.bfloat16 in slots["layers.0.qkv.weight"].host  # Linear: bf16 copy kept by the optimizer
    assert torch.bfloat16 not in slots["layers.0.ln1.weight"].host  # LayerNorm runs in fp32 under autocast


def test_gpu_mode_stages_moments_in_regions_of_an_eighth_of_the_inflight_cap():
    """Each unit's moments are cut, in order, into regions of at most max_inflight_bytes / 8
    that go to VRAM and back around each update (on the CPU backend into a second host
    buffer: a region not copied back, or a param read at another's offset, changes the
    bits); a param whose moments alone exceed that has its own region, copied up to half
    the cap and mapped for the kernel beyond."""
    cap = 240_000  # tiny_gpt: a block's norms share a region, qkv (98 KB) is copied alone, fc and out (131 KB) mapped
    host = train("gpt", RESIDENT, steps=4)
    device = train("gpt", dict(RESIDENT, **GPU_MODE, max_inflight_bytes=cap), steps=4)
    assert_same_bits(host, device)
    engine = device[2][0]._trainstream_engine
    regions = list(dict.fromkeys(engine.moments.region_of.values()))
    assert all(r.staged == (r.nbytes <= cap // 2) for r in regions)
    assert all(len(r.layout) == 1 for r in regions if r.nbytes > cap // 8)
    assert any(r.staged and r.nbytes > cap // 8 for r in regions)
    assert max(len(r.layout) for r in regions if r.staged) > 1 and any(not r.staged for r in regions)
    order = [s.param for u in engine.units for s in u.trainable]
    assert [p for r in regions for p, *_ in r.layout] == order  # each unit's params, in order
    for r in regions:  # a region never spans two units
        assert (
            len({next(u.name for u in engine.units if any(s.param is p for s in u.trainable)) for p, *_ in r.layout})
            == 1
        )
    assert engine.moments.copies == 4 * sum(r.staged for r in regions) and engine.moments.mapped == 0
    assert trainstream.memory_report(device[2][0])["plan"]["moment_copies"] == {
        "regions": len(regions),
        "regions_too_large_to_copy": sum(not r.staged for r in regions),
        "copied": engine.moments.copies,
        "mapped_for_want_of_room": 0,
    }
    assert trainstream.memory_report(host[2][0])["plan"]["moment_copies"] is None


def test_gpu_mode_runs_one_kernel_per_region_between_its_copies(monkeypatch):
    """Each region's kernel comes after its own copy in and before its copy home, and the
    next region's copy in comes after this one's kernel: a unit's regions are never all
    held in VRAM at once waiting for one kernel."""
    from trainstream.engine.moments import MomentStager
    from trainstream.engine.optimizer import StreamedAdamW

    calls = []
    stage_in, send_home, kernel = MomentStager.stage_in, MomentStager.send_home, StreamedAdamW.queue_on_device

    def record(name, fn, region_of):
        def wrapped(self, *args, **kwargs):
            calls.append((name, region_of(self, *args)))
            return fn(self, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        MomentStager,
        "stage_in",
        record("in", stage_in, lambda self, params, stream: {id(self.region_of[p]) for p in params}),
    )
    monkeypatch.setattr(
        MomentStager, "send_home", record("home", send_home, lambda self, staged, done: {id(staged.region)})
    )
    monkeypatch.setattr(
        StreamedAdamW,
        "queue_on_device",
        record("kernel", kernel, lambda self, device, slots, *rest: {id(s.param) for s in slots}),
    )
    device = train("gpt", dict(RESIDENT, **GPU_MODE, max_inflight_bytes=240_000), steps=2)
    stager = device[2][0]._trainstream_engine.moments
    params_of = {id(r): {id(p) for p, *_ in r.layout} for r in stager.region_of.values()}
    names = [name for name, _ in calls]
    assert names == ["in", "kernel", "home"] * (2 * len(params_of))  # every region, each step
    for (_, into), (_, kernel_params), (_, home) in zip(calls[::3], calls[1::3], calls[2::3]):
        assert len(into) == 1 and into == home and kernel_params == params_of[next(iter(into))]


def test_gpu_mode_maps_the_moments_a_copy_would_raise_the_peak_for(monkeypatch):
    """No room under the peak so far: every region stays in host memory for the kernel to
    map, with the same bits."""
    _moment_room(monkeypatch, lambda self: 0)
    host = train("gpt", RESIDENT, steps=3)
    device = train("gpt", dict(RESIDENT, **GPU_MODE), steps=3)
    assert_same_bits(host, device)
    stager = device[2][0]._trainstream_engine.moments
    assert stager.copies == 0 and stager.mapped == 3 * len(set(stager.region_of.values()))


@pytest.mark.parametrize(
    "opts",
    [dict(accumulation=3), dict(clip=0.05), dict(accumulation=2, clip=0.05)],
    ids=["accumulation", "clip", "accumulation+clip"],
)
def test_paging_bit_exact_with_clipping_and_accumulation(opts):
    assert_same_bits(train("gpt", RESIDENT, steps=4, **opts), train("gpt", PAGED, steps=4, **opts))


def test_paging_bit_exact_bf16_model_and_frozen_params():
    frozen = lambda n: n.endswith("fc.weight")  # noqa: E731  (a LoRA-like mix of frozen and trained)
    for dtype in (torch.float32, torch.bfloat16):
        a = train("gpt", RESIDENT, steps=4, dtype=dtype, freeze=frozen)
        b = train("gpt", PAGED, steps=4, dtype=dtype, freeze=frozen)
        assert_same_bits(a, b)
    assert a[0][-1] < a[0][0]


def test_guard_params_false_gives_the_same_run():
    assert_same_bits(
        train("gpt", dict(PAGED, guard_params=True), steps=3), train("gpt", dict(PAGED, guard_params=False), steps=3)
    )


# -- optimizer_mode="gpu": the update on the device over host moments ------------------------------

GPU_MODE = dict(optimizer_mode="gpu")


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_gpu_mode_gives_the_host_modes_bits(name, autocast, base):
    """The kernel (on the CPU path its host twin) computes the host AdamW's bits; what this
    checks is the bookkeeping: gradients left on the device, fp32 weights that are their
    own master, paged weights written in host memory."""
    host = train(name, base, autocast=autocast, steps=4)
    device = train(name, dict(base, **GPU_MODE), autocast=autocast, steps=4)
    assert_same_bits(host, device)
    engine = device[2][0]._trainstream_engine
    assert engine.update_on_device and engine.device_grads
    assert all(s.device_grad is None for u in engine.units for s in u.trainable)
    # No landing buffers for gradients that never leave the device, and none counted.
    assert all(s.stage_region is None for u in engine.units for s in u.trainable)
    assert engine.budget["host"]["gradient buffers"] == 0
    assert trainstream.memory_report(device[2][0])["plan"]["optimizer_mode"] == "gpu"
    assert trainstream.memory_report(host[2][0])["plan"]["optimizer_mode"] == "cpu"


@pytest.mark.parametrize(
    "opts",
    [dict(accumulation=3), dict(clip=0.05), dict(accumulation=2, clip=0.05)],
    ids=["accumulation", "clip", "accumulation+clip"],
)
def test_gpu_mode_with_clipping_and_accumulation_lands_gradients_on_the_host(opts):
    for base in (RESIDENT, PAGED):
        device = train("gpt", dict(base, **GPU_MODE), steps=4, **opts)
        assert_same_bits(train("gpt", base, steps=4, **opts), device)
        assert not device[2][0]._trainstream_engine.device_grads
        assert "land in host memory" in trainstream.memory_report(device[2][0])["events"]


def test_gpu_mode_bf16_model_and_frozen_params():
    frozen = lambda n: n.endswith("fc.weight")  # noqa: E731
    for base in (RESIDENT, PAGED):
        a = train("gpt", base, steps=3, dtype=torch.bfloat16, freeze=frozen)
        b = train("gpt", dict(base, **GPU_MODE), steps=3, dtype=torch.bfloat16, freeze=frozen)
        assert_same_bits(a, b)


def test_gpu_mode_keeps_no_finished_update_handles():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", offload=True, optimizer_mode="gpu", **RESIDENT)
    for i in range(5):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert all(len(u.updates) <= 1 for u in model._trainstream_engine.units)


def _train_and_move(mode: str) -> dict:
    """Three steps with every block resident, blocks 0 and 1 paged, three more steps, block 0
    back: the host weights of a unit updated on the device must be brought level first."""
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
    engine = model._trainstream_engine
    for i in range(9):
        if i in (3, 6):  # applied by the adapter at the next forward, as its replans are
            engine.adapter.pending = ([0, 1] if i == 3 else [1], [])
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert [u.paged for u in engine.block_units] == [False, True, False, False]
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_gpu_mode_blocks_moved_between_steps_keep_their_weights():
    host, device = _train_and_move("cpu"), _train_and_move("gpu")
    for k in host:
        assert torch.equal(host[k], device[k]), k


def _gpt_steps(mode: str, steps: int = 3):
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
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_gpu_mode_state_dicts_unwrap_and_switch():
    (host_model, host_opt), (model, opt) = _gpt_steps("cpu"), _gpt_steps("gpu")
    # The optimizer's state_dict first (it waits for the updates itself), then the model's.
    host_sd, sd = host_opt.state_dict(), opt.state_dict()
    for k, v in host_sd["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(v[key]), torch.as_tensor(sd["state"][k][key])), (k, key)
    for k, v in host_model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    assert trainstream.unwrap(model) is model and not hasattr(model, "_trainstream_engine")
    # offload="auto" still switches to stock training from the device mode's state.
    stock = train("mlp", None, steps=6)
    auto = train("mlp", dict(offload="auto", profile=machine(vram_gib=24), **GPU_MODE), steps=6)
    assert trainstream.memory_report(auto[2][0])["mode"] == "stock"
    assert max_diff(stock[1], auto[1]) < 1e-5


def test_mapped_moments_take_a_loaded_state_dict_and_go_with_the_switch():
    """The moments in the host arena (on the CPU backend, plain memory stands in for the
    pinned arena) are the optimizer's state; pinning new buffers copies the state in; they
    keep their buffers through load_state_dict, which copies into them, and are let go when
    offload="auto" switches to stock training."""
    from trainstream.engine.switch import switch_to_stock

    model, opt = _gpt_steps("gpu")
    params = [p for g in opt.param_groups for p in g["params"]]
    assert set(opt._mapped) == set(params)  # laid out at wrap()
    before = {p: opt.state[p]["exp_avg_sq"].clone() for p in params}
    opt.pin_state({p: (torch.full_like(p, float("nan")), torch.full_like(p, float("nan"))) for p in params})
    buffers = dict(opt._mapped)
    for p in params:  # the state was copied in
        assert opt.state[p]["exp_avg_sq"] is buffers[p][1] and torch.equal(buffers[p][1], before[p])
    sd = opt.state_dict()
    sd["state"] = {
        k: {kk: (vv * 2 if kk == "exp_avg" else vv.clone()) for kk, vv in v.items()} for k, v in sd["state"].items()
    }
    del sd["state"][0]  # a param without saved state starts again from zeros, in its buffers
    opt.load_state_dict(sd)
    assert opt._mapped == buffers
    for i, p in enumerate(params):
        assert opt.state[p]["exp_avg"] is buffers[p][0] and opt.state[p]["exp_avg_sq"] is buffers[p][1]
        expect = sd["state"][i]["exp_avg"] if i else torch.zeros_like(p)
        assert torch.equal(opt.state[p]["exp_avg"], expect), i
    assert float(opt.state[params[0]]["step"]) == 0
    switch_to_stock(model._trainstream_engine)
    assert opt._mapped == {}  # (on a GPU the stock state is a device copy: nothing else holds them)


class _LateAccumulation:
    """An accumulation job that says it is finished only once someone has waited for it."""

    def __init__(self, job):
        self.job, self.waited = job, False

    def done(self) -> bool:
        return self.waited and self.job.done()

    def wait(self) -> None:
        self.job.wait()
        self.waited = True


def test_gpu_mode_waits_for_the_host_sum_before_the_update_reads_it(monkeypatch):
    """With accumulation the last pass adds into the host sums on the thread pool; the kernel
    is not in that pool, so the update must wait for the adds before it is queued."""
    from trainstream.engine.device import DeviceUpdate

    real = trainstream.ops.accumulate_
    monkeypatch.setattr(trainstream.ops, "accumulate_", lambda *a, **k: _LateAccumulation(real(*a, **k)))
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(
        model, None, device="cpu", offload=True, optimizer_mode="gpu", accumulation_steps=2, **RESIDENT
    )
    queue = opt.queue_on_device
    checked = []

    def checking(device, slots, *args, **kwargs):
        for s in slots:
            assert s.reader is None or isinstance(s.reader, DeviceUpdate) or s.reader.done(), s.name
        checked.append(len(slots))
        return queue(device, slots, *args, **kwargs)

    monkeypatch.setattr(opt, "queue_on_device", checking)
    for i in range(4):
        loss_fn(model, batch(i, "cpu")).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    assert checked


def test_gpu_mode_refuses_non_contiguous_parameters():
    model, _, _ = tiny_mlp()
    first = model[0]
    first.weight = torch.nn.Parameter(first.weight.detach().t().contiguous().t())
    with pytest.raises(ValueError, match="optimizer_mode='gpu' needs contiguous parameters"):
        trainstream.wrap(model, None, device="cpu", optimizer_mode="gpu")


class _Backend:
    is_cuda = True


@pytest.mark.parametrize("host_rate, expect", [(5e9, False), (2.2e9, False), (1.8e9, True), (2e8, True)])
def test_optimizer_mode_auto_weighs_the_host_rate_against_pcie(host_rate, expect, monkeypatch):
    """At 25 GB/s each way the kernel moves 8 bytes a parameter each way (resident fp32: the
    moments only): 0.4 ns at 80% of the link, 0.5 ns with the 1.25 margin. A host at 2.2e9
    params/s (0.45 ns) keeps the update; at 1.8e9 (0.56 ns) the device takes it."""
    from trainstream.engine.layout import build_units
    from trainstream.engine.placement import choose_optimizer_mode, device_update_bytes
    from trainstream.options import parse

    model, _, _ = tiny_mlp(layers=4, dim=256)
    blocks, outside, _ = build_units(model, list(model), set(model.parameters()))
    opts = parse({"optimizer_mode": "auto"})
    n = sum(p.numel() for p in model.parameters())
    assert device_update_bytes(opts, blocks + outside, 4) == (8 * n, 8 * n)  # resident fp32: the moments only
    profile = dataclasses.replace(machine(), host_adamw_params_per_s=host_rate)
    on_device, note = choose_optimizer_mode(opts, blocks + outside, profile, 4, _Backend())
    assert on_device is expect
    assert ("GPU AdamW (estimated" if expect else "host AdamW (estimated") in note
    # The CPU backend never picks the device; "gpu" is taken as asked.
    assert choose_optimizer_mode(opts, blocks, profile, 4, type("B", (), {"is_cuda": False})())[0] is False
    monkeypatch.setattr("trainstream._native.require_cuda", lambda feature: None)  # a GPU machine
    assert choose_optimizer_mode(parse({"optimizer_mode": "gpu"}), blocks, profile, 4, _Backend())[0] is True


# -- against torch ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [{}, dict(clip=0.05), dict(accumulation=3), dict(accumulation=2, clip=0.05)],
    ids=["plain", "clip", "accumulation", "accumulation+clip"],
)
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_matches_torch_adamw(name, opts):
    stock = train(name, None, **opts)
    wrapped = train(name, PAGED, **opts)
    assert max_diff(stock[1], wrapped[1]) < 5e-5  # lr 1e-2 for 10 steps; the update itself matches to ~1e-7
    assert wrapped[0] == pytest.approx(stock[0], rel=1e-4, abs=1e-5)
    if opts.get("clip"):
        assert wrapped[2][0]._trainstream_engine.last_grad_norm > opts["clip"]  # clipping was active


def test_converts_an_optimizer_with_state():
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    reference, _, _ = tiny_gpt()
    reference.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (model, reference)]
    for m, o in zip((model, reference), opts):
        for i in range(3):
            loss_fn(m, batch(i, "cpu")).backward()
            o.step()
            o.zero_grad()
    model, opt = trainstream.wrap(model, opts[0], device="cpu", **PAGED)
    assert opt.state_dict()["state"][0]["step"] == 3
    for i in range(3, 6):
        for m, o in ((model, opt), (reference, opts[1])):
            loss_fn(m, batch(i, "cpu")).backward()
            o.step()
            o.zero_grad()
    ref = reference.state_dict()
    assert max((model.state_dict()[k].cpu() - ref[k]).abs().max().item() for k in ref) < 2e-5


# -- state dicts and unwrap --------------------------------------------------------------------------


def test_state_dicts_round_trip():
    losses, state, (model, opt) = train("gpt", PAGED, steps=3)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # torch's state_dict aliases the live moments
    # A plain torch model and AdamW load what the wrapped ones saved...
    plain, batch, loss_fn = tiny_gpt()
    plain.load_state_dict(saved_model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
    plain_opt.load_state_dict(saved_opt)
    # ...and the wrapped ones load it back after drifting away from it.
    for i in range(2):
        loss_fn(model, batch(10 + i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert not torch.equal(model.state_dict()["layers.0.qkv.weight"], saved_model["layers.0.qkv.weight"])
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), saved_model[k]), k
    for i in range(2):
        for m, o in ((model, opt), (plain, plain_opt)):
            loss_fn(m, batch(20 + i, "cpu")).backward()
            o.step()
            o.zero_grad()
    assert max(((model.state_dict()[k].cpu() - v).abs().max().item() for k, v in plain.state_dict().items())) < 1e-5


def test_unwrap_gives_a_plain_model():
    _, state, (model, opt) = train("gpt", PAGED, steps=2)
    blocks = list(model.layers)
    trainstream.unwrap(model)
    assert not hasattr(model, "_trainstream_engine")
    assert not model._forward_pre_hooks and all("forward" not in b.__dict__ for b in blocks)
    assert all(
        p._post_accumulate_grad_hooks in (None, {}) or not p._post_accumulate_grad_hooks for p in model.parameters()
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]) and v.stride() == v.contiguous().stride(), k
    with pytest.raises(RuntimeError, match="unwrapped"):
        opt.step()
    _, batch, loss_fn = tiny_gpt()
    loss_fn(model, batch(0, "cpu")).backward()  # trains as a plain model: gradients stay in .grad
    assert all(p.grad is not None for p in model.parameters())


# -- behaviour and errors ----------------------------------------------------------------------------


def test_model_without_a_block_stack():
    def factory():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return (
            model,
            (lambda i, d: torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(d)),
            (lambda m, x: m(x).square().mean()),
        )

    stock = train("none", None, model_factory=factory)
    wrapped = train("none", {}, model_factory=factory)
    assert max_diff(stock[1], wrapped[1]) < 1e-5
    report = trainstream.memory_report(wrapped[2][0])
    assert "no repeated block stack" in report["events"]
    assert report["params"]["paged_blocks"] == [] and report["params"]["resident_blocks"] == []


def test_too_many_backward_passes_is_an_error():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", accumulation_steps=2)
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps=2"):
        loss_fn(model, batch(2, "cpu")).backward()


def test_zero_grad_drops_an_unfinished_window():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", accumulation_steps=2, lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn(model, batch(0, "cpu")).backward()
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "option, value",
    [
        ("quantize", "fp4"),
        ("param_offload", [0, 99]),
        ("prefetch_depth", 0),
        ("device", "tpu"),
        ("optimiser_mode", "cpu"),
    ],
)
def test_bad_options_name_themselves(option, value):
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match=option):
        trainstream.wrap(model, None, device="cpu", **{option: value}) if option != "device" else trainstream.wrap(
            model, None, device=value
        )


def test_lr_with_an_optimizer_is_an_error():
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="'lr' applies only when optimizer is None"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", lr=0.1)


def test_undelivered_options_say_so():
    model, _, _ = tiny_mlp()
    with pytest.raises(NotImplementedError, match="data parallel is not available yet"):
        trainstream.wrap(model, None, device="cpu", distributed=True)


def test_wrong_optimizer_and_double_wrap():
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="optimizer must be one of"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    model, _ = trainstream.wrap(model, None, device="cpu")
    with pytest.raises(ValueError, match="already wrapped"):
        trainstream.wrap(model, None, device="cpu")


def machine(vram_gib=24.0, ram_gib=64.0, pinned_gib=None):
    """A simulated machine for the planner (the figures any test may set by keyword)."""
    from trainstream.planner import HardwareProfile

    return HardwareProfile(
        vram_total_bytes=int(vram_gib * 2**30),
        vram_free_bytes=int(vram_gib * 2**30),
        ram_available_bytes=int(ram_gib * 2**30),
        pinned_limit_bytes=int((pinned_gib or ram_gib) * 2**30),
        h2d_bytes_per_s=25e9,
        d2h_bytes_per_s=25e9,
    )


def test_memory_error_gives_the_numbers():
    model, _, _ = tiny_mlp()
    with pytest.raises(MemoryError, match=r"host RAM: needs .* GiB .*moments.* available 0.00 GiB"):
        trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=1e-3))
    assert not hasattr(model, "_trainstream_engine")
    with pytest.raises(MemoryError, match=r"VRAM: needs .* usable 0.00 GiB"):
        trainstream.wrap(model, None, device="cpu", profile=machine(vram_gib=1e-4), param_offload=False)
    trainstream.wrap(model, None, device="cpu", check_memory=False, profile=machine(ram_gib=1e-3))


def test_auto_pages_blocks_on_a_small_simulated_card():
    # 6 blocks of 256 KiB on a 3 MiB card: half the usable memory is held back for the
    # activations not measured yet, and the weights do not fit in the rest.
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", profile=machine(vram_gib=3 / 1024))
    report = trainstream.memory_report(model)
    assert 0 < len(report["params"]["paged_blocks"]) < 6, report["events"]
    assert "plan at wrap()" in report["events"] and report["plan"]["profile"]["source"] == "given"
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()


def test_memory_report_explains_the_plan():
    _, _, (model, _) = train("gpt", dict(param_offload=[1, 3], activation_offload=0.5), steps=1)
    report = trainstream.memory_report(model)
    assert report["mode"] == "offload"
    assert report["params"] == {
        "paged_blocks": [1, 3],
        "resident_blocks": [0, 2],
        "activation_paged_blocks": [0, 1],
        "quantize": "none",
    }
    assert "block stack 'layers': 4 x Block" in report["events"]
    assert report["plan"]["history"] == [] and report["peaks"]["steps"] == 1


def test_paged_weights_are_placeholders_between_uses():
    _, _, (model, _) = train("gpt", PAGED, steps=1)
    w = model.layers[0].qkv.weight
    assert w.shape == (192, 64) and w.untyped_storage().nbytes() == 4 and torch.isnan(w).all()
    assert model.layers[0].qkv.weight.dtype == torch.float32


# -- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gpu_paging_is_bit_exact(name, autocast):
    resident = train(name, RESIDENT, device="cuda", autocast=autocast)
    paged = train(name, PAGED, device="cuda", autocast=autocast)
    assert_same_bits(resident, paged)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [RESIDENT, PAGED, dict(PAGED, max_inflight_bytes=1)], ids=["resident", "paged", "cap"])
def test_gpu_synchronization_stress(opts):
    """Tiny compute, large tensors: a missing wait on any stream shows up as a wrong number."""
    factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)  # noqa: E731
    stock = train("mlp", None, device="cuda", steps=8, lr=1e-3, model_factory=factory)
    wrapped = train("mlp", opts, device="cuda", steps=8, lr=1e-3, model_factory=factory)
    assert max_diff(stock[1], wrapped[1]) < 1e-5
    assert wrapped[0] == pytest.approx(stock[0], rel=1e-4)


def _moment_room(monkeypatch, room) -> None:
    """Set what MomentStager sees as room under the VRAM peak: `room(stager)` -> bytes or
    None (no limit). With tiny activations the real peak leaves too little to copy the
    moments in, and these tests are about the copies."""
    from trainstream.engine.moments import MomentStager

    monkeypatch.setattr(MomentStager, "room", room)


@pytest.mark.gpu
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("copied", [True, False], ids=["copied", "mapped"])
def test_gpu_mode_synchronization_stress(base, copied, monkeypatch):
    """gpu mode, tiny compute, each layer's moments (34 MB) copied to VRAM and home around
    its update, or mapped by the kernel: the bits of the host AdamW."""
    _moment_room(monkeypatch, lambda self: None if copied else 0)
    factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)  # noqa: E731
    host = train("mlp", base, device="cuda", steps=8, lr=1e-3, model_factory=factory)
    device = train("mlp", dict(base, **GPU_MODE), device="cuda", steps=8, lr=1e-3, model_factory=factory)
    assert_same_bits(host, device)
    stager = device[2][0]._trainstream_engine.moments
    assert (stager.copies > 0, stager.mapped > 0) == (copied, not copied)


@pytest.mark.gpu
def test_gpu_mode_regions_switching_between_copied_and_mapped_keep_their_order(monkeypatch):
    """Steps that copy the moments in, copy them in again, then map them (room under the
    peak varies), every copy home held back on the GPU: the next update, copied or mapped,
    must wait for the region's last copy home, or it reads stale moments, or the late copy
    lands on top of a mapped kernel's update. (Mapped, then copied, is also ordered by the
    next forward's wait for the kernel.)"""
    from trainstream.engine.moments import MomentStager

    delay = int(1e8)  # GPU cycles, tens of milliseconds: longer than a step of this model
    send_home = MomentStager.send_home

    def late_copy_home(self, staged, kernel_done):
        if staged.copy is not None:
            with torch.cuda.stream(self.engine.backend.moments_out):
                torch.cuda._sleep(delay)  # no wait added here: send_home orders the copy itself
        return send_home(self, staged, kernel_done)

    factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)  # noqa: E731
    host = train("mlp", RESIDENT, device="cuda", steps=9, lr=1e-3, model_factory=factory)
    _moment_room(monkeypatch, lambda self: 0 if self.engine.steps % 3 == 2 else None)
    monkeypatch.setattr(MomentStager, "send_home", late_copy_home)
    device = train("mlp", dict(RESIDENT, **GPU_MODE), device="cuda", steps=9, lr=1e-3, model_factory=factory)
    assert_same_bits(host, device)
    stager = device[2][0]._trainstream_engine.moments
    assert stager.copies > 0 and stager.mapped > 0


@pytest.mark.gpu
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("late", ["copy_in", "kernel", "copy_home"])
def test_gpu_mode_units_of_several_regions_with_one_stream_held_back(base, late, monkeypatch):
    """tiny_gpt under this cap: each block's moments in five regions, three copied and two
    mapped (fc, out), each with a kernel of its own. One stream's work is held back each
    time (several held back at once keep pace with each other and hide a missing wait), and
    nothing here orders it: a missing wait between a region's copy in, its kernel and its
    copy home, between steps, or between a unit's copies home and a host reader of the
    moments, changes the bits. The host's waits under max_inflight_bytes are switched off:
    under this small cap they order nearly everything themselves (with them, a copy in
    that skipped its wait for the region's copy home passed this test on the H200)."""
    from trainstream.engine.device import TransferLedger
    from trainstream.engine.moments import MomentStager
    from trainstream.engine.optimizer import StreamedAdamW

    delay = int(1e7)  # GPU cycles, a few milliseconds: longer than this model's kernels and copies
    stage_in, send_home, kernel = MomentStager.stage_in, MomentStager.send_home, StreamedAdamW.queue_on_device

    def late_copy_in(self, params, stream):
        with torch.cuda.stream(self.engine.backend.moments_in):
            torch.cuda._sleep(delay)
        return stage_in(self, params, stream)

    def late_kernel(self, *args, **kwargs):
        torch.cuda._sleep(delay)  # on the update stream, where the engine queues the kernel
        return kernel(self, *args, **kwargs)

    def late_copy_home(self, staged, kernel_done):
        with torch.cuda.stream(self.engine.backend.moments_out):
            torch.cuda._sleep(delay)
        return send_home(self, staged, kernel_done)

    cap = dict(max_inflight_bytes=240_000)
    host = train("gpt", dict(base, **cap), device="cuda", steps=4)
    _moment_room(monkeypatch, lambda self: None)
    monkeypatch.setattr(TransferLedger, "make_room", lambda self, nbytes, cap, also_held=0: self.settle())
    if late == "copy_in":
        monkeypatch.setattr(MomentStager, "stage_in", late_copy_in)
    elif late == "kernel":
        monkeypatch.setattr(StreamedAdamW, "queue_on_device", late_kernel)
    else:
        monkeypatch.setattr(MomentStager, "send_home", late_copy_home)
    device = train("gpt", dict(base, **GPU_MODE, **cap), device="cuda", steps=4)
    assert_same_bits(host, device)
    moments = lambda opt: {
        (i, k): v
        for i, st in opt.state_dict()["state"].items()  # noqa: E731
        for k, v in st.items()
        if k != "step"
    }
    host_moments, device_moments = moments(host[2][1]), moments(device[2][1])
    assert host_moments.keys() == device_moments.keys() and host_moments
    for k in host_moments:
        assert torch.equal(host_moments[k], device_moments[k]), k
    stager = device[2][0]._trainstream_engine.moments
    block_regions = [
        r
        for r in set(stager.region_of.values())
        if any(p is q for p, *_ in r.layout for q in device[2][0].layers[0].parameters())
    ]
    assert sorted(r.staged for r in block_regions) == [False, False, True, True, True]
    assert stager.copies > 0 and stager.mapped == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_gpu_optimizer_mode_gpu_gives_the_host_modes_bits(name, autocast, base):
    """The CUDA kernel on the update stream, beside backward: the same bits as the host AdamW."""
    assert_same_bits(
        train(name, base, device="cuda", autocast=autocast, steps=5),
        train(name, dict(base, **GPU_MODE), device="cuda", autocast=autocast, steps=5),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(accumulation=2), dict(clip=0.05)], ids=["accumulation", "clip"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gpu_optimizer_mode_gpu_reads_gradients_from_host_memory(opts, autocast):
    for base in (RESIDENT, PAGED):
        assert_same_bits(
            train("gpt", base, device="cuda", steps=4, autocast=autocast, **opts),
            train("gpt", dict(base, **GPU_MODE), device="cuda", steps=4, autocast=autocast, **opts),
        )


@pytest.mark.gpu
def test_gpu_optimizer_mode_gpu_accumulation_of_large_gradients_on_one_thread():
    """Large host sums added on one pool thread: an update that did not wait for the adds
    would read a half-summed gradient."""
    factory = lambda: tiny_mlp(layers=4, dim=2048, rows=2)  # noqa: E731
    opts = dict(RESIDENT, threads=1)
    assert_same_bits(
        train("mlp", opts, device="cuda", steps=3, accumulation=2, lr=1e-3, model_factory=factory),
        train("mlp", dict(opts, **GPU_MODE), device="cuda", steps=3, accumulation=2, lr=1e-3, model_factory=factory),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [RESIDENT, PAGED, dict(PAGED, max_inflight_bytes=1)], ids=["resident", "paged", "cap"])
def test_gpu_optimizer_mode_gpu_synchronization_stress(opts):
    """Tiny compute, large tensors, the update in place on the device: a missing wait between
    the update stream and compute shows up as a wrong number."""
    factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)  # noqa: E731
    stock = train("mlp", None, device="cuda", steps=8, lr=1e-3, model_factory=factory)
    wrapped = train("mlp", dict(opts, **GPU_MODE), device="cuda", steps=8, lr=1e-3, model_factory=factory)
    assert max_diff(stock[1], wrapped[1]) < 1e-5
    assert wrapped[0] == pytest.approx(stock[0], rel=1e-4)


@pytest.mark.gpu
def test_gpu_optimizer_mode_gpu_loads_a_state_dict_into_the_mapped_moments():
    """A loaded checkpoint is copied into the pinned buffers the kernel was given at wrap()
    (no second pinned copy), and training goes on from it."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(model.cuda(), None, lr=1e-2, offload=True, **RESIDENT, **GPU_MODE)
    for i in range(2):
        loss_fn(model, batch(i, "cuda")).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    sd["state"] = {k: {kk: (vv * 2 if kk == "exp_avg" else vv) for kk, vv in v.items()} for k, v in sd["state"].items()}
    buffers = dict(opt._mapped)
    assert buffers and all(m.is_pinned() and v.is_pinned() for m, v in buffers.values())
    opt.load_state_dict(sd)
    assert opt._mapped == buffers
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        assert opt.state[p]["exp_avg"] is buffers[p][0] and opt.state[p]["exp_avg_sq"] is buffers[p][1]
        assert torch.equal(opt.state[p]["exp_avg"], sd["state"][i]["exp_avg"])
    loss_fn(model, batch(2, "cuda")).backward()
    opt.step()
    opt._synchronize()
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.gpu
def test_gpu_optimizer_mode_gpu_keeps_gradients_out_of_vram():
    """Resident weights, gradients updated on the device as they come: the peak stays under
    weights + all gradients (stock's), like the host mode's."""
    factory = lambda: tiny_mlp(layers=8, dim=2048, rows=64)  # noqa: E731
    trainstream.profile_hardware("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    train(
        "mlp",
        dict(RESIDENT, **GPU_MODE, max_inflight_bytes=64 << 20),
        device="cuda",
        steps=3,
        lr=1e-3,
        model_factory=factory,
    )
    weights = 8 * 2048 * 2048 * 4
    assert torch.cuda.max_memory_allocated() - before < 1.5 * weights


@pytest.mark.gpu
def test_gpu_paging_lowers_the_peak():
    factory = lambda: tiny_mlp(layers=8, dim=2048, rows=512)  # noqa: E731
    peaks = {}
    trainstream.profile_hardware("cuda")  # measured (and cached) outside the peaks compared
    # The CPU outruns this tiny compute: without max_inflight_bytes holding it back, released
    # blocks and gradients waiting for their copies would pile up in VRAM.
    for label, opts in (
        ("resident", RESIDENT),
        ("paged", dict(PAGED, min_offload_bytes=1 << 20, max_inflight_bytes=40 << 20)),
    ):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # What this run adds: earlier tests in the process may leave tensors allocated (on the
        # H200 a pytest run started this test with 100-240 MB held that a lone run did not).
        before = torch.cuda.memory_allocated()
        train("mlp", opts, device="cuda", steps=3, lr=1e-3, model_factory=factory)
        peaks[label] = torch.cuda.max_memory_allocated() - before
    weights = 8 * 2048 * 2048 * 4
    # Resident: all weights plus gradient transients; paged: about two blocks plus transfers.
    assert peaks["paged"] < peaks["resident"] - 0.5 * weights, peaks


# -- the pieces that order transfers --------------------------------------------------------------


class _Event:
    def __init__(self, log, name):
        self.log, self.name, self.finished = log, name, False

    def query(self):
        return self.finished

    def synchronize(self):
        self.log.append(self.name)
        self.finished = True


def test_transfer_ledger_waits_oldest_first_until_it_fits():
    from trainstream.engine.device import DONE, TransferLedger

    log = []
    ledger = TransferLedger()
    events = [_Event(log, i) for i in range(4)]
    for e in events:
        ledger.add(e, 10)
    ledger.add(DONE, 10**9)  # finished work holds nothing
    events[0].finished = True
    ledger.make_room(15, cap=40)  # 30 held after the finished one settles: wait for one more
    assert log == [1] and ledger.bytes == 20
    ledger.make_room(100, cap=40)  # more than the cap alone: wait for everything, then go ahead
    assert log == [1, 2, 3] and ledger.bytes == 0


def test_a_failed_weight_copy_surfaces_on_the_training_thread():
    """Whether the lander thread or the training thread pushes the weights, a failure
    reaches the training loop, never a silent stale weight."""
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", **RESIDENT)
    pager = model._trainstream_engine.weights

    def broken(unit):
        raise OSError("copy failed")

    pager.push = broken
    with pytest.raises((RuntimeError, OSError)) as info:
        loss_fn(model, batch(0, "cpu")).backward()
        opt.step()
        pager.lander.stop()  # the thread has handled every update it was given
        model(batch(1, "cpu"))
    error = info.value
    assert "copy failed" in str(error) + str(error.__cause__)


# -- edge cases a training loop runs into ----------------------------------------------------------


def test_loaded_hyperparameters_take_effect():
    _, _, (model, opt) = train("gpt", PAGED, steps=1)
    state = opt.state_dict()
    for group in state["param_groups"]:
        group["lr"] = 0.0  # with lr 0 AdamW (decoupled decay included) leaves every weight alone
    opt.load_state_dict(state)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, batch, loss_fn = tiny_gpt()
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_no_grad_forward_between_forward_and_backward():
    """An fp32 evaluation forward after an autocast forward must not change what the
    pending backward sees (its weights were fetched in bf16)."""
    runs = []
    for opts in (RESIDENT, PAGED):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **opts)
        losses = []
        for i in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, batch(i, "cpu"))
            with torch.no_grad():
                losses.append(loss_fn(model, batch(100 + i, "cpu")).item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    assert_same_bits(runs[0], runs[1])


def test_float16_parameters_are_refused():
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        trainstream.wrap(model.half(), None, device="cpu")


def test_training_goes_on_after_a_backward_that_raised():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", **PAGED)
    loss = loss_fn(model, batch(0, "cpu"))
    hidden = model[2].weight  # a failure partway through backward, after some gradients landed

    def fail(grad):
        raise RuntimeError("boom")

    handle = hidden.register_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    handle.remove()
    opt.zero_grad()
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert "a backward pass raised" in trainstream.memory_report(model)["events"]


def test_state_dict_keep_vars_gives_real_values():
    _, state, (model, _) = train("gpt", PAGED, steps=1)
    kept = model.state_dict(keep_vars=True)
    for k, v in kept.items():
        assert torch.equal(v.detach(), state[k]), k


def test_an_offload_adamw_brings_its_clipping():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, trainstream.OffloadAdamW(model.parameters(), max_grad_norm=1e-3), device="cpu")
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()
    assert model._trainstream_engine.last_grad_norm is not None
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="max_grad_norm"):
        trainstream.wrap(
            model, trainstream.OffloadAdamW(model.parameters(), max_grad_norm=1.0), device="cpu", max_grad_norm=2.0
        )
    with pytest.raises(ValueError, match="accumulation_steps"):
        trainstream.wrap(model, trainstream.OffloadAdamW(model.parameters(), accumulation_steps=2), device="cpu")


def test_the_last_backward_of_a_window_updates_units_used_earlier_only():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.extra = torch.nn.Linear(8, 8)

        def forward(self, x, use_extra):
            for b in self.blocks:
                x = b(x)
            return (self.extra(x) if use_extra else x).square().mean()

    model, opt = trainstream.wrap(Net(), None, device="cpu", accumulation_steps=2)
    model(torch.randn(4, 8), True).backward()
    model(torch.randn(4, 8), False).backward()
    engine = model._trainstream_engine
    assert all(u.queued for u in engine.units)  # before step(): the window is complete
    opt.step()


def test_non_reentrant_checkpointing_pages_bit_exactly():
    factory = checkpointed_gpt(reentrant=False)
    resident = train("ckpt", RESIDENT, model_factory=factory, steps=3, autocast=torch.bfloat16)
    assert_same_bits(resident, train("ckpt", PAGED, model_factory=factory, steps=3, autocast=torch.bfloat16))
    stock = train("ckpt", None, model_factory=factory, steps=3)
    assert max_diff(stock[1], train("ckpt", PAGED, model_factory=factory, steps=3)[1]) < 2e-5


def test_host_arena_carves_power_of_two_pieces_without_overlap():
    from trainstream.engine.device import Backend, HostArena

    shapes = [(1000,), (300, 7), (5,), (4096,), (1,), (2500, 3)] * 5
    total = sum(HostArena.size_of(s[0] * (s[1] if len(s) > 1 else 1), torch.float32) for s in shapes)
    arena = HostArena(Backend(torch.device("cpu")), total)
    taken = [arena.take(s, torch.float32) for s in shapes]
    assert arena.remaining == 0 and all(p.numel() & (p.numel() - 1) == 0 for p in arena.pieces)
    assert arena.reserved < 2 * total
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in taken)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    with pytest.raises(RuntimeError, match="exhausted"):
        arena.take((1,), torch.float32)


def test_auto_moments_drop_to_bf16_only_when_ram_is_short(monkeypatch):
    model, batch, loss_fn = tiny_mlp()  # 393K params: fp32 moments need about 6 MiB of host memory in all
    wrapped, opt = trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=64))
    assert opt.moment_dtype == torch.float32
    trainstream.unwrap(wrapped)
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=5.2 / 1024))
    assert opt.moment_dtype == torch.bfloat16
    assert "bfloat16 with stochastic rounding" in trainstream.memory_report(model)["events"]
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16
    # Eight processes on the node share its RAM: a 64 GiB machine gives each an eighth.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    model, _, _ = tiny_mlp()
    with pytest.raises(MemoryError, match="share of 8"):
        trainstream.wrap(model, None, device="cpu", profile=machine(ram_gib=8 * 3.0 / 1024))


def test_saved_activations_are_measured_per_block():
    _, _, (model, _) = train("gpt", RESIDENT, steps=3)
    measured = trainstream.memory_report(model)["plan"]["activation_bytes_per_block"]
    assert sorted(measured) == [0, 1, 2, 3]
    # Each block saves at least its input (4 x 16 tokens x 64 fp32) and its MLP hidden (4x wider).
    assert all(b >= 4 * 16 * 64 * 4 * 5 for b in measured.values()), measured
    _, _, (paged, _) = train("gpt", PAGED, steps=1)
    assert trainstream.memory_report(paged)["plan"]["activation_bytes_per_block"] == measured


@pytest.mark.parametrize("opts", [RESIDENT, PAGED, {}], ids=["resident", "paged", "auto"])
def test_a_deleted_wrapped_model_is_freed(opts):
    """Hooks torch keeps in C++ (invisible to the cycle collector) must not hold the engine:
    otherwise every model wrapped in a process keeps its device memory until exit."""
    import weakref

    _, _, (model, opt) = train("mlp", opts, steps=3)
    refs = [weakref.ref(model), weakref.ref(model._trainstream_engine), *map(weakref.ref, model.parameters())]
    del model, opt
    gc.collect()
    import time

    time.sleep(0.05)  # the lander thread lets go of its last unit
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_gpu_a_deleted_wrapped_model_frees_its_device_memory(opts):
    import time

    gc.collect()
    before = torch.cuda.memory_allocated()
    factory = lambda: tiny_mlp(layers=4, dim=1024, rows=64)  # noqa: E731
    _, _, (model, opt) = train("mlp", opts, device="cuda", steps=3, model_factory=factory)
    del model, opt
    gc.collect()
    time.sleep(0.05)  # the lander thread lets go of its last unit
    gc.collect()
    assert torch.cuda.memory_allocated() - before < (1 << 20), (before, torch.cuda.memory_allocated())


_EXIT_SCRIPT = """
import atexit, os, threading


@atexit.register  # registered first, so it runs after trainstream's own exit hook
def no_lander_left():
    if any(t.name == "trainstream-lander" and t.is_alive() for t in threading.enumerate()):
        os._exit(3)


import trainstream
from engine_models import tiny_mlp
model, batch, loss_fn = tiny_mlp(layers=8, dim=2048, rows=64)
model, opt = trainstream.wrap(model, None, device="cpu", param_offload=False, offload=True, threads=1)
for i in range(3):
    loss_fn(model, batch(i, "cpu")).backward()
    opt.step()  # returns with updates still running: the lander thread waits on them
    opt.zero_grad()
print("exiting")
"""


def test_the_process_exits_cleanly_while_updates_are_in_flight():
    """At interpreter exit the lander thread may be waiting inside a native call; killed
    there by Python's shutdown, it aborted the process. An exit hook stops it first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "exiting" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_small_gradients_leave_in_one_batch_per_unit(monkeypatch):
    """Gradients under GradStreamer.SMALL_GRAD_BYTES wait for their unit's last one and go
    to host memory together (one D2H batch per unit and pass); a large one goes at once."""
    from trainstream.engine.grads import GradStreamer

    sends = []
    send = GradStreamer._send

    def counting(self, unit):
        sends.append((unit.name, len(unit.waiting)))
        send(self, unit)

    monkeypatch.setattr(GradStreamer, "_send", counting)
    _, _, (model, _) = train("gpt", RESIDENT, steps=1)  # every gradient of the tiny GPT is small
    units = [u for u in model._trainstream_engine.units if u.trainable]
    assert sorted(sends) == sorted((u.name, len(u.trainable)) for u in units)
    sends.clear()
    monkeypatch.setattr(GradStreamer, "SMALL_GRAD_BYTES", 0)  # every gradient counts as large
    train("gpt", RESIDENT, steps=1)
    assert all(n == 1 for _, n in sends) and len(sends) == sum(len(u.trainable) for u in units)


@pytest.mark.parametrize("opts", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_reentrant_checkpointing_with_a_frozen_head(opts):
    """The first trainable gradient arrives inside a checkpoint's own backward: the pass must
    still end with the whole backward (it starts at the model's output)."""
    frozen = lambda n: n.startswith(("head", "norm"))  # noqa: E731
    stock = train("ckpt", None, steps=3, freeze=frozen, model_factory=checkpointed_gpt(reentrant=True))
    wrapped = train("ckpt", opts, steps=3, freeze=frozen, model_factory=checkpointed_gpt(reentrant=True))
    assert max_diff(stock[1], wrapped[1]) < 5e-5


def test_a_second_gradient_in_one_pass_is_an_error_not_a_wrong_update():
    torch.manual_seed(0)
    model, batch, loss_fn = checkpointed_gpt(reentrant=True, shared_gain=True)()
    model, opt = trainstream.wrap(model, None, lr=1e-2, device="cpu", offload=True, **RESIDENT)
    with pytest.raises(RuntimeError, match="norm.gain got a second gradient in one backward pass"):
        loss_fn(model, batch(0, "cpu")).backward()
    opt.zero_grad()  # the pass is closed; updates queued before the error stand, as for any failed backward
    assert "a backward pass raised" in trainstream.memory_report(model)["events"]


def test_a_failure_at_the_end_of_backward_leaves_no_half_landed_state(monkeypatch):
    from trainstream.engine.grads import GradStreamer

    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(model, None, lr=1e-2, device="cpu", offload=True, **RESIDENT)
    end_pass = GradStreamer._end_pass

    def failing_end(self):
        # The first thing _end_pass does with every unit: fail on the second unit, with the
        # first already sent (a failed host job surfacing there, say).
        calls = []

        def send(unit):
            calls.append(unit)
            if len(calls) == 2:
                raise RuntimeError("a host job failed")

        self._send = send
        for unit in self.engine.units[:2]:  # two units still waiting, as after unused parameters
            unit.waiting = [(unit.trainable[0], torch.zeros(1), None)]
        try:
            end_pass(self)
        finally:
            del self._send

    monkeypatch.setattr(GradStreamer, "_end_pass", failing_end)
    with pytest.raises(RuntimeError, match="a host job failed"):
        loss_fn(model, batch(0, "cpu")).backward()
    monkeypatch.setattr(GradStreamer, "_end_pass", end_pass)
    engine = model._trainstream_engine
    assert all(not u.waiting and u.landed == 0 and not any(s.fresh for s in u.trainable) for u in engine.units)
    assert "the end of a backward pass raised" in trainstream.memory_report(model)["events"]
    loss_fn(model, batch(1, "cpu")).backward()  # the next pass counts only its own gradients
    opt.step()
    opt.zero_grad()


def test_a_parameter_in_two_reentrant_segments_of_one_block_sums_its_gradients():
    """The second segment's backward gives ln its first gradient; the first segment's gives
    the second one before the block's last gradient (a's, which ln follows in forward), so it
    arrives while the first still waits on the device, and the two are summed, as torch does."""
    from torch.utils.checkpoint import checkpoint

    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.a, self.b = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            h = checkpoint(lambda x: x + self.ln(self.a(x)), x, use_reentrant=True)
            return checkpoint(lambda h: h + self.b(self.ln(h)), h, use_reentrant=True)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.layers = torch.nn.ModuleList([Halves() for _ in range(3)])
            self.head = torch.nn.Linear(16, 32)

        def forward(self, idx):
            x = self.emb(idx)
            for layer in self.layers:
                x = layer(x)
            return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())

    def factory():
        return (
            Model(),
            (lambda i, device: torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i)).to(device)),
            (lambda m, idx: m(idx)),
        )

    stock = train("halves", None, steps=3, model_factory=factory)
    wrapped = train("halves", RESIDENT, steps=3, model_factory=factory)
    assert max_diff(stock[1], wrapped[1]) < 5e-5
