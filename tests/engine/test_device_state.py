"""Device state (engine/device_state.py): a small trainable set keeps its weights, gradients,
moments and masters on the compute device and is updated in step(); the planner decides it
from sizes (placement.py). On the CPU path the update is the same host AdamW as the host
path's, so the two give the same bits; against torch's AdamW the bounds of test_engine."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PAGED, RESIDENT, assert_same_bits, machine, max_diff, train
from models import tiny_gpt
from torch import nn

import trainstream
from trainstream.engine import placement


class LoraLinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update (LoRA's shape, both factors random so
    that every gradient is non-zero from the first step)."""

    def __init__(self, dim: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(dim, dim, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) / dim**0.5)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) / rank)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoraBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = LoraLinear(dim), LoraLinear(dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class LoraMLP(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(LoraBlock(dim) for _ in range(layers))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def lora_mlp():
    """(model, batch, loss_fn), as tests/models.py's factories; trainable share ~6%."""
    model = LoraMLP()

    def batch(i, device):
        return torch.randn(8, 64, generator=torch.Generator().manual_seed(4000 + i)).to(device)

    return model, batch, lambda m, x: m(x.to(m.layers[0].fc1.lora_a.dtype)).float().pow(2).mean()


def _engine(run):
    return run[2][0]._trainstream_engine


def _host_path(monkeypatch):
    """Plans from here on keep today's path for every trainable set."""
    monkeypatch.setattr(placement, "DEVICE_STATE_MAX_SHARE", 0.0)


def _assert_device_state(run):
    engine = _engine(run)
    trainable = [s for u in engine.units for s in u.slots if s.trainable]
    assert engine.plan.device_state == frozenset(s.name for s in trainable)
    assert all(s.device_state and s.stage_region is None and not s.host for s in trainable)
    assert all(not u.trainable for u in engine.units)  # the gradient streamer sees none of them
    report = trainstream.memory_report(run[2][0])
    assert "device state: the" in report["events"]
    n = sum(s.param.numel() for s in trainable)
    assert report["plan"]["device_state"]["tensors"] == len(trainable)
    assert report["plan"]["device_state"]["parameters"] == n
    assert report["plan"]["device_state"]["device_bytes"] > n * trainable[0].dtype.itemsize  # weights and moments
    assert placement.DEVICE_STATE_CLASS in report["plan"]["budget"]["device"]


CASES = {
    "plain": dict(),
    "clip": dict(clip=0.05),
    "accumulation": dict(accumulation=2),
    "accumulation+clip": dict(accumulation=2, clip=0.05),
    "paged": dict(options=PAGED),
    "paged+clip+accumulation": dict(options=dict(param_offload=True), clip=0.05, accumulation=2),
    "bf16 moments": dict(options=dict(RESIDENT, moment_dtype="bfloat16")),
    "bf16 model": dict(dtype=torch.bfloat16),
    "int8 base": dict(options=dict(RESIDENT, quantize="int8")),
    "nf4 base": dict(options=dict(PAGED, quantize="nf4")),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_lora_trains_with_device_state_as_the_host_path_and_torch(case, monkeypatch):
    kw = dict(CASES[case])
    options = kw.pop("options", RESIDENT)
    run = train("lora", options, steps=5, model_factory=lora_mlp, **kw)
    _assert_device_state(run)
    assert run[0][-1] < run[0][0]
    _host_path(monkeypatch)
    host = train("lora", options, steps=5, model_factory=lora_mlp, **kw)
    assert not _engine(host).plan.device_state and "device state: not used" in _engine(host).events.text()
    assert_same_bits(run, host)  # the same host AdamW over the same gradients: the same bits
    if "quantize" not in options and "moment_dtype" not in options and "dtype" not in kw:
        stock = train("lora", None, steps=5, model_factory=lora_mlp, **kw)
        assert max_diff(stock[1], run[1]) < 5e-5
        assert run[0] == pytest.approx(stock[0], rel=1e-4, abs=1e-5)
    if kw.get("clip"):
        assert _engine(run).last_grad_norm > kw["clip"]  # clipping was active


def test_device_state_gradients_are_torch_p_grad():
    """p.grad accumulates as torch's does (summed over the window) and zero_grad clears it
    as torch's does; no gradient reaches the landing path."""
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    ref = LoraMLP()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, accumulation_steps=2, **RESIDENT)
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
        loss_fn(ref, batch(i, "cpu")).backward()
    pairs = [(p, q) for p, q in zip(model.parameters(), ref.parameters()) if p.requires_grad]
    assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
    with pytest.raises(RuntimeError, match="accumulation_steps=2"):
        loss_fn(model, batch(2, "cpu")).backward()  # the window's pass count still holds
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p, _ in pairs)
    opt.zero_grad()
    assert all(p.grad is None for p, _ in pairs)


def test_a_full_fine_tune_keeps_the_host_path():
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **RESIDENT)
    engine = model._trainstream_engine
    assert engine.plan.device_state == frozenset()
    assert "trainable parameters are 100.0% of the model" in engine.events.text()
    loss_fn(model, batch(0, "cpu")).backward()
    trainable = [s for u in engine.units for s in u.trainable]
    assert len(trainable) == len(list(model.parameters()))
    # Every gradient went to its landing buffer (p.grad taken by the hook).
    assert all(s.param.grad is None and s.stage is not None for s in trainable)
    opt.step()


def test_the_decision_refuses_data_parallel_large_shares_and_non_contiguous_params():
    from trainstream.engine.layout import Slot, Unit

    def unit(*shapes_trainable):
        u = Unit("block 0", 0, [])
        for i, (shape, trainable) in enumerate(shapes_trainable):
            p = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=trainable)
            u.slots.append(Slot(p, f"w{i}", torch.float32, trainable, True, unit=u))
        return u

    lora = [unit(((100, 100), False), ((2, 100), True), ((100, 2), True))]  # 400 of 10,400: 3.8%
    assert placement.why_not_device_state(None, lora, ranks=1) is None
    assert "data parallel over 2 ranks" in placement.why_not_device_state(None, lora, ranks=2)
    big = [unit(((100, 100), False), ((40, 100), True))]  # 4,000 of 14,000
    assert "28.6% of the model" in placement.why_not_device_state(None, big, ranks=1)
    transposed = unit(((100, 100), False), ((2, 100), True))
    transposed.slots[1].param = nn.Parameter(torch.empty(100, 2).t())
    assert "w1 is not contiguous" in placement.why_not_device_state(None, [transposed], ranks=1)


def _lora_layout(blocks=4, dim=1024, rank=32):
    """A ModelLayout of meta tensors: per block a frozen (dim, dim) weight and two trainable
    LoRA factors (5.9% of the parameters), no memory behind them."""
    from trainstream.engine.layout import ModelLayout, Slot, Unit

    units = []
    for i in range(blocks):
        u = Unit(f"block {i}", i, [])
        for name, shape, trainable in (("w", (dim, dim), False), ("a", (rank, dim), True), ("b", (dim, rank), True)):
            p = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=trainable)
            u.slots.append(Slot(p, f"layers.{i}.{name}", torch.float32, trainable, True, unit=u))
        units.append(u)
    return ModelLayout(units, [], [], [], [], 0)


def _plan(layout, profile, **options):
    from trainstream import options as opts_mod
    from trainstream.engine.device import Backend

    return placement.plan_run(opts_mod.parse(options), layout, profile, Backend(torch.device("cpu")))


def test_the_decision_on_simulated_profiles(monkeypatch):
    layout = _lora_layout()
    names = {s.name for u in layout.units for s in u.slots if s.trainable}
    roomy = _plan(layout, machine(vram_gib=8, ram_gib=8), activation_offload=False)
    assert roomy.device_state == names and roomy.paged == ()
    # per block: 2 x 32K fp32 params: weights, gradients and two fp32 moments (no master)
    assert roomy.budget["device"][placement.DEVICE_STATE_CLASS] == 4 * 2 * 32 * 1024 * 4 * 4
    assert roomy.budget["host"]["moments"] == 0 and "device state: the 8 trainable" in roomy.device_state_notes[0]
    assert not any(s.device_state for u in layout.units for s in u.slots)  # planned on copies
    # 4 MiB frozen weights per block; half the usable memory held back for activations. In
    # 50 MiB the host path keeps every block resident; device state's 4 MiB would page three.
    tight = _plan(layout, machine(vram_gib=50 / 1024, ram_gib=8), activation_offload=False)
    assert tight.device_state == frozenset() and tight.paged == ()
    assert "would page 3 more blocks' weights and 0 more blocks' activations" in tight.device_state_notes[0]
    _host_path(monkeypatch)
    host = _plan(layout, machine(vram_gib=50 / 1024, ram_gib=8), activation_offload=False)
    assert host.paged == tight.paged and host.budget == tight.budget


def test_data_parallel_keeps_the_host_path(monkeypatch):
    monkeypatch.setattr(placement, "world_size", lambda distributed: 2)
    plan = _plan(_lora_layout(), machine(vram_gib=8, ram_gib=8), activation_offload=False)
    assert plan.device_state == frozenset()
    assert "data parallel over 2 ranks (the reduction of device-state gradients is not built)" in plan.notes[-1]


def _nan_at(model, step: int, steps: list):
    """A NaN into one adapter gradient in the backward of step `step` (counted by `steps`)."""
    p = model.layers[2].fc1.lora_a

    def hook(g):
        return g * float("nan") if steps[0] == step else g

    return p.register_hook(hook)


def _run_with_nan(options, *, nonfinite="skip", clip=None, steps=4, nan_step=1, device="cpu"):
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    if options is None:
        model = model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    if options is not None:
        model, opt = trainstream.wrap(
            model, opt, device=device, offload=True, max_grad_norm=clip, nonfinite=nonfinite, **options
        )
    counter = [0]
    _nan_at(model, nan_step, counter)
    losses = []
    for i in range(steps):
        counter[0] = i
        loss = loss_fn(model, batch(i, device))
        loss.backward()
        losses.append(loss.item())
        grads_finite = all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        if options is None and not grads_finite:
            opt.zero_grad()  # the reference skips the step whole
            continue
        if options is None and clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, (model, opt)


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clip"])
def test_a_nonfinite_gradient_skips_the_step_whole(clip, monkeypatch):
    run = _run_with_nan(RESIDENT, clip=clip)
    _assert_device_state(run)
    model, opt = run[2]
    assert opt.skipped_steps == 1
    events = trainstream.memory_report(model)["events"]
    assert "step 2: the gradient of layers.2.fc1.lora_a is not finite" in events
    stock = _run_with_nan(None, clip=clip)
    assert max_diff(stock[1], run[1]) < 5e-5 and all(torch.isfinite(v).all() for v in run[1].values())
    steps = {int(st["step"]) for st in opt.state.values()}
    assert steps == {3}  # the skipped step counted no step
    if clip is not None:  # a held window: the host path skips it whole too, the same bits
        _host_path(monkeypatch)
        assert_same_bits(run, _run_with_nan(RESIDENT, clip=clip))


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clip"])
def test_nonfinite_raise_names_the_parameter_and_drops_the_window(clip):
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    model, opt = trainstream.wrap(
        model, None, device="cpu", lr=1e-2, offload=True, nonfinite="raise", max_grad_norm=clip, **RESIDENT
    )
    assert model._trainstream_engine.plan.device_state
    _nan_at(model, 0, [0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn(model, batch(0, "cpu")).backward()
    with pytest.raises(FloatingPointError, match="layers.2.fc1.lora_a is not finite"):
        opt.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert all(float(st["step"]) == 0 for st in opt.state_dict()["state"].values())  # no step was counted


def test_nonfinite_ignore_updates():
    run = _run_with_nan(RESIDENT, nonfinite="ignore", steps=2)
    _assert_device_state(run)
    assert run[2][1].skipped_steps == 0
    assert not torch.isfinite(run[1]["layers.2.fc1.lora_a"]).all()


def test_a_dropped_window_with_a_nonfinite_gradient_counts_as_skipped():
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, accumulation_steps=2, **RESIDENT)
    _nan_at(model, 0, [0])
    loss_fn(model, batch(0, "cpu")).backward()
    opt.zero_grad()  # the window dropped before its step
    assert opt.skipped_steps == 1
    assert "not finite in the window zero_grad() dropped" in trainstream.memory_report(model)["events"]


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_resume_from_the_optimizer_state_dict_is_bit_exact(moments):
    def wrapped():
        torch.manual_seed(0)
        model, batch, loss_fn = lora_mlp()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, moment_dtype=moments, **RESIDENT)
        return model, opt, batch, loss_fn

    def steps(model, opt, batch, loss_fn, start, n):
        for i in range(start, start + n):
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()
            opt.zero_grad()

    model, opt, batch, loss_fn = wrapped()
    assert model._trainstream_engine.plan.device_state
    steps(model, opt, batch, loss_fn, 0, 2)
    saved = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    st = next(iter(saved["optim"]["state"].values()))
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["exp_avg"].dtype == getattr(torch, moments)
    steps(model, opt, batch, loss_fn, 2, 2)
    resumed, ropt, _, _ = wrapped()
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optim"])
    steps(resumed, ropt, batch, loss_fn, 2, 2)
    for (k, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k
    for a, b in zip(opt.state_dict()["state"].values(), ropt.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # torch's format: a plain AdamW takes it
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]).load_state_dict(opt.state_dict())


def test_offload_auto_switches_to_stock_with_the_moments():
    auto = train("lora", dict(offload="auto", profile=machine(vram_gib=24)), steps=2, model_factory=lora_mlp)
    kept = train("lora", dict(offload=True, profile=machine(vram_gib=24)), steps=2, model_factory=lora_mlp)
    _assert_device_state(kept)
    model, opt = auto[2]
    assert trainstream.memory_report(model)["mode"] == "stock" and opt._stock is not None
    assert_same_bits(auto, kept)  # two engine steps, then the switch
    for a, b in zip(opt.state_dict()["state"].values(), kept[2][1].state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        assert float(a["step"]) == float(b["step"]) == 2


def test_an_in_place_edit_of_a_bf16_param_is_taken_into_its_master(monkeypatch):
    def run():
        torch.manual_seed(0)
        model, batch, loss_fn = lora_mlp()
        model = model.to(torch.bfloat16)
        model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **RESIDENT)
        for i in range(3):
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                with torch.no_grad():
                    model.layers[0].fc1.lora_b.mul_(0.5)  # the edit wins over the master's low bits
        return model, {k: v.clone() for k, v in model.state_dict().items()}

    model, state = run()
    assert model._trainstream_engine.plan.device_state
    _host_path(monkeypatch)
    _, host = run()
    for k in state:
        assert torch.equal(state[k], host[k]), k


def test_lr_set_between_backward_and_step_is_used_without_warning(recwarn):
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    ref = LoraMLP()
    ref.load_state_dict(model.state_dict())
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **RESIDENT)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    for m, o in ((model, opt), (ref, ropt)):
        loss_fn(m, batch(0, "cpu")).backward()
        o.param_groups[0]["lr"] = 0.5  # a device-state update reads its group at step(), as torch's
        o.step()
    assert max_diff(model.state_dict(), ref.state_dict()) < 1e-6
    assert not [w for w in recwarn if "changed from" in str(w.message)]


def test_a_peft_lora_over_an_nf4_llama_takes_device_state(monkeypatch):
    from engine.test_quantized import _peft_llama

    run = train("llama", dict(RESIDENT, quantize="nf4"), steps=3, model_factory=_peft_llama())
    _assert_device_state(run)
    _host_path(monkeypatch)
    assert_same_bits(run, train("llama", dict(RESIDENT, quantize="nf4"), steps=3, model_factory=_peft_llama()))


# -- on the GPU (the lead runs these on an H200) ----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", ["plain", "accumulation", "paged", "bf16 moments", "bf16 model", "nf4 base", "gpu mode"]
)
def test_gpu_device_state_gives_the_host_paths_bits(case, monkeypatch):
    """The CUDA AdamW performs the host AdamW's operations one by one: the same bits (in
    optimizer_mode='gpu' the host path's update is that kernel too)."""
    kw = dict(CASES[case]) if case != "gpu mode" else dict(options=dict(RESIDENT, optimizer_mode="gpu"))
    options = kw.pop("options", RESIDENT)
    run = train("lora", options, device="cuda", steps=5, model_factory=lora_mlp, **kw)
    _assert_device_state(run)
    assert all(s.param.is_cuda for u in _engine(run).units for s in u.device_state_slots)
    _host_path(monkeypatch)
    assert_same_bits(run, train("lora", options, device="cuda", steps=5, model_factory=lora_mlp, **kw))


@pytest.mark.gpu
def test_gpu_device_state_with_clipping_is_the_host_path_within_rounding(monkeypatch):
    """The global norm is taken by another reduction (multi-tensor) than the host path's."""
    run = train("lora", RESIDENT, device="cuda", steps=5, clip=0.05, model_factory=lora_mlp)
    _assert_device_state(run)
    _host_path(monkeypatch)
    host = train("lora", RESIDENT, device="cuda", steps=5, clip=0.05, model_factory=lora_mlp)
    assert max_diff(run[1], host[1]) < 1e-6
    assert run[0] == pytest.approx(host[0], rel=1e-6)


@pytest.mark.gpu
def test_gpu_a_peft_lora_over_a_quantized_resident_base_matches_stock_peft():
    """Against stock peft training on the base's round-tripped weights (what the quantized
    run computes with), within float rounding as test_engine's torch comparisons."""
    from engine.test_quantized import _peft_llama

    run = train("llama", dict(RESIDENT, quantize="nf4"), device="cuda", steps=4, model_factory=_peft_llama())
    _assert_device_state(run)
    assert all(s.param.is_cuda for u in _engine(run).units for s in u.device_state_slots)
    stock = train("llama", None, device="cuda", steps=4, model_factory=_peft_llama("nf4"))
    assert max_diff(stock[1], run[1]) < 5e-5
    assert run[0] == pytest.approx(stock[0], rel=1e-4, abs=1e-5)


@pytest.mark.gpu
def test_gpu_a_nonfinite_gradient_skips_the_device_state_update():
    """The check runs on the device ahead of the kernel, which reads its flag."""
    run = _run_with_nan(RESIDENT, device="cuda")
    _assert_device_state(run)
    model, opt = run[2]
    assert opt.skipped_steps == 1 and {int(st["step"]) for st in opt.state.values()} == {3}
    assert "step 2: the gradient of layers.2.fc1.lora_a is not finite" in trainstream.memory_report(model)["events"]
    cpu = _run_with_nan(RESIDENT)
    assert max_diff(cpu[1], run[1]) < 5e-5  # the same updates (matmuls round apart between devices)
