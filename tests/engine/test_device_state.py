"""Device state (engine/device_state.py): a small trainable set keeps its weights, gradients,
moments and masters on the compute device and is updated when the host path would update it
(at the end of the window's last backward pass, or in step() with max_grad_norm); the planner
decides it from sizes (placement.py). On the CPU path the update is the same host AdamW as the
host path's, so a loop gives the same bits on both paths, whatever it does between backward()
and step(); against torch's AdamW the bounds of test_engine."""

from __future__ import annotations

import collections
import copy
import warnings

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


@pytest.mark.parametrize("clip", [None, 1e9], ids=["eager", "clip"])
def test_device_state_gradients_are_torch_p_grad(clip):
    """p.grad accumulates as torch's does (summed over the window) and zero_grad clears it
    as torch's does; no gradient reaches the landing path. The update takes the window's
    gradients where the host path's takes them: at the end of its last pass (eager: p.grad
    is None from then on), or at step() (max_grad_norm)."""
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    ref = LoraMLP()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = trainstream.wrap(
        model, opt, device="cpu", offload=True, accumulation_steps=2, max_grad_norm=clip, **RESIDENT
    )
    pairs = [(p, q) for p, q in zip(model.parameters(), ref.parameters()) if p.requires_grad]
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
        loss_fn(ref, batch(i, "cpu")).backward()
        if i == 0 or clip is not None:
            assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
    if clip is None:  # taken by the update the window's last pass queued
        assert all(p.grad is None for p, _ in pairs)
        return
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


def test_the_decision_refuses_large_shares_and_non_contiguous_params():
    from trainstream.engine.layout import Slot, Unit

    def unit(*shapes_trainable):
        u = Unit("block 0", 0, [])
        for i, (shape, trainable) in enumerate(shapes_trainable):
            p = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=trainable)
            u.slots.append(Slot(p, f"w{i}", torch.float32, trainable, True, unit=u))
        return u

    lora = [unit(((100, 100), False), ((2, 100), True), ((100, 2), True))]  # 400 of 10,400: 3.8%
    assert placement.why_not_device_state(None, lora) is None
    big = [unit(((100, 100), False), ((40, 100), True))]  # 4,000 of 14,000
    assert "28.6% of the model" in placement.why_not_device_state(None, big)
    transposed = unit(((100, 100), False), ((2, 100), True))
    transposed.slots[1].param = nn.Parameter(torch.empty(100, 2).t())
    assert "w1 is not contiguous" in placement.why_not_device_state(None, [transposed])


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


def test_data_parallel_takes_device_state_replicated_on_every_rank(monkeypatch):
    """Data parallel replicates device state on every rank: the ranks do not refuse it, and each
    rank's budget counts the whole of it and the fp32 buckets its gradients are averaged in."""
    layout = _lora_layout()
    alone = _plan(layout, machine(vram_gib=8, ram_gib=8), activation_offload=False)
    monkeypatch.setattr(placement, "world_size", lambda distributed: 2)
    plan = _plan(layout, machine(vram_gib=8, ram_gib=8), activation_offload=False)
    assert plan.device_state == alone.device_state == {s.name for u in layout.units for s in u.slots if s.trainable}
    assert "on each of the 2 ranks: replicated" in plan.device_state_notes[0]
    n = 4 * 2 * 32 * 1024  # trainable parameters
    device = placement.DEVICE_STATE_CLASS
    assert plan.budget["device"][device] == alone.budget["device"][device] + 4 * n
    assert plan.budget["host"]["moments"] == 0


def _nan_at(model, step: int, steps: list):
    """A NaN into one adapter gradient in the backward of step `step` (counted by `steps`)."""
    p = model.layers[2].fc1.lora_a

    def hook(g):
        return g * float("nan") if steps[0] == step else g

    return p.register_hook(hook)


def _run_with_nan(
    options, *, nonfinite="skip", clip=None, steps=4, nan_step=1, device="cpu", case="one group", snapshots=None
):
    """`case`: "two groups" (odd and even layers, other hyper-parameters), "bf16 model" (fp32
    masters on the engine's side); `snapshots`: a list that gets the trainable weights after
    each step."""
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    if case == "bf16 model":
        model = model.to(torch.bfloat16)
    if options is None:
        model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    if case == "two groups":
        odd = {id(p) for i, block in enumerate(model.layers) if i % 2 for p in block.parameters()}
        params = [
            {"params": [p for p in params if id(p) not in odd]},
            {"params": [p for p in params if id(p) in odd], "lr": 3e-3, "weight_decay": 0.0},
        ]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
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
        if snapshots is not None:
            if options is not None:
                opt.synchronize()
            snapshots.append(
                {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}
            )
    return losses, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, (model, opt)


def _assert_skipped_from_block_2_on(snapshots, nan_step=1):
    """Backward completes block 3 first: its update stands at the step of the NaN (in block 2),
    blocks 2, 1 and 0 keep their bits."""
    before, after = snapshots[nan_step - 1], snapshots[nan_step]
    for name in before:
        if name.startswith("layers.3."):
            assert not torch.equal(before[name], after[name]), name
        else:
            assert_same_bits(before[name], after[name])


def _skip_lines(model) -> list:
    """The events' lines about gradients not finite, without their time stamps."""
    lines = trainstream.memory_report(model)["events"].splitlines()
    return [line.split("] ", 1)[-1] for line in lines if "not finite" in line]


@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clip"])
def test_a_nonfinite_gradient_skips_what_the_host_path_skips(clip, monkeypatch):
    """Held (clipping): the step is skipped whole, as torch's loop that skips it. Eager: the
    unit found and every unit after it in backward's order (block 3 keeps its update), as the
    host path skips them; the same weights, moments, step counts, count and events."""
    run = _run_with_nan(RESIDENT, clip=clip)
    _assert_device_state(run)
    model, opt = run[2]
    assert opt.skipped_steps == 1
    events = trainstream.memory_report(model)["events"]
    assert "step 2: the gradient of layers.2.fc1.lora_a is not finite" in events
    assert all(torch.isfinite(v).all() for v in run[1].values())
    steps = {name: int(opt.state[p]["step"]) for name, p in model.named_parameters() if p.requires_grad}
    if clip is not None:
        stock = _run_with_nan(None, clip=clip)
        assert max_diff(stock[1], run[1]) < 5e-5
        assert set(steps.values()) == {3}  # the skipped step counted no step
    else:
        assert {n: v for n, v in steps.items() if n.startswith("layers.3.")} == dict.fromkeys(
            [n for n in steps if n.startswith("layers.3.")], 4
        )
        assert {v for n, v in steps.items() if not n.startswith("layers.3.")} == {3}
    _assert_as_on_the_host_path(monkeypatch, run, clip=clip)


def _assert_as_on_the_host_path(monkeypatch, run, **kwargs):
    """The same NaN run on the host path (`kwargs` for _run_with_nan): the same bits, one
    skipped step, the same skip events and step counts as `run`'s."""
    model, opt = run[2]
    _host_path(monkeypatch)
    host = _run_with_nan(RESIDENT, **kwargs)
    assert_same_bits(run, host)
    assert host[2][1].skipped_steps == 1 and _skip_lines(host[2][0]) == _skip_lines(model)
    assert [int(st["step"]) for st in host[2][1].state_dict()["state"].values()] == [
        int(st["step"]) for st in opt.state_dict()["state"].values()
    ]


@pytest.mark.parametrize("case", ["two groups", "bf16 model"])
def test_a_nonfinite_gradient_skips_from_its_unit_on_across_groups_and_masters(case, monkeypatch):
    """Eager updates: every unit goes in one launch per param group and (gradient dtype,
    master or not), each slot skipped by its unit's place in backward's order; the same bits,
    step counts, count and events as the host path, which goes unit by unit."""
    snapshots = []
    run = _run_with_nan(RESIDENT, case=case, snapshots=snapshots)
    _assert_device_state(run)
    opt = run[2][1]
    assert opt.skipped_steps == 1
    _assert_skipped_from_block_2_on(snapshots)
    _assert_as_on_the_host_path(monkeypatch, run, case=case)


def _count_calls(monkeypatch, owner, name: str, calls: dict) -> None:
    """`owner.name` counts its calls in ``calls[name]`` and does what it did."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def _three_steps_of_28_units(monkeypatch, device, owners):
    """A 28-unit LoRA MLP with its adapters in device state, wrapped on `device`, stepped 3
    times with the calls of `owners` ([(object, attribute name)]) counted: each step's counts,
    after the adapters are checked to have moved."""
    torch.manual_seed(0)
    model = LoraMLP(layers=28)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device=device, offload=True, **RESIDENT)
    engine = model._trainstream_engine
    assert len(engine.device_state) == 4 * 28 and engine._device_state_by_unit()
    calls = {name: 0 for _, name in owners}
    for owner, name in owners:
        _count_calls(monkeypatch, owner, name, calls)
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    counts = []
    for i in range(3):
        calls.update(dict.fromkeys(calls, 0))
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i)).to(device)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        counts.append(dict(calls))
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(not torch.equal(a, b) for a, b in zip(opt.param_groups[0]["params"], before))
    return counts


def test_an_eager_update_of_28_units_is_one_adamw_call_and_one_check(monkeypatch):
    """nonfinite="skip" with eager updates decides per unit in backward's order, yet the whole
    device state goes in one host AdamW call and one mark_nonfinite_ call per step (one param
    group, one gradient dtype), not one of each per unit."""
    from trainstream import ops

    counts = _three_steps_of_28_units(monkeypatch, "cpu", [(ops, "adamw_step"), (ops, "mark_nonfinite_")])
    assert counts == [{"adamw_step": 1, "mark_nonfinite_": 1}] * 3


@pytest.mark.gpu
def test_gpu_an_eager_update_of_28_units_is_one_kernel_launch_and_one_check(monkeypatch):
    """On CUDA: one MappedAdamW launch and one mark_nonfinite_ launch per step for 28 units."""
    from trainstream import ops
    from trainstream.ops import adamw

    counts = _three_steps_of_28_units(monkeypatch, "cuda", [(adamw.MappedAdamW, "__call__"), (ops, "mark_nonfinite_")])
    assert counts == [{"__call__": 1, "mark_nonfinite_": 1}] * 3


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["eager", "clip"])
def test_nonfinite_raise_names_the_parameter_and_drops_the_window(clip, accumulation, monkeypatch):
    """Where the host path raises: from loss.backward() without clipping (eager: the units
    before the one found keep their update; accumulation: from the pass that has it, nothing
    applied), from step() with it (nothing applied); the same weights after, on both paths."""

    def run():
        torch.manual_seed(0)
        model, batch, loss_fn = lora_mlp()
        model, opt = trainstream.wrap(
            model,
            None,
            device="cpu",
            lr=1e-2,
            offload=True,
            nonfinite="raise",
            max_grad_norm=clip,
            accumulation_steps=accumulation,
            **RESIDENT,
        )
        _nan_at(model, 0, [0])
        before = {k: v.clone() for k, v in model.state_dict().items()}
        if clip is None:
            with pytest.raises(FloatingPointError, match="layers.2.fc1.lora_a is not finite"):
                loss_fn(model, batch(0, "cpu")).backward()
        else:
            loss_fn(model, batch(0, "cpu")).backward()
            with pytest.raises(FloatingPointError, match="layers.2.fc1.lora_a is not finite"):
                opt.step()
        opt.synchronize()
        assert all(p.grad is None for p in model.parameters())
        return model, opt, before

    model, opt, before = run()
    assert model._trainstream_engine.plan.device_state
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    steps = {n: float(opt.state.get(p, {}).get("step", 0)) for n, p in model.named_parameters() if p.requires_grad}
    if clip is None and accumulation == 1:  # block 3 was updated before backward reached block 2
        assert changed == {k for k in before if k.startswith("layers.3.") and ".lora_" in k}
        assert all(v == (1 if n.startswith("layers.3.") else 0) for n, v in steps.items())
    else:
        assert not changed
        assert all(v == 0 for v in steps.values())  # no step was counted
    _host_path(monkeypatch)
    host, hopt, _ = run()
    assert not host._trainstream_engine.plan.device_state
    for k, v in host.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_nonfinite_ignore_updates():
    run = _run_with_nan(RESIDENT, nonfinite="ignore", steps=2)
    _assert_device_state(run)
    assert run[2][1].skipped_steps == 0
    assert not torch.isfinite(run[1]["layers.2.fc1.lora_a"]).all()


@pytest.mark.parametrize("clip", [None, 0.05], ids=["accumulation", "clip"])
def test_a_dropped_window_with_a_nonfinite_gradient_counts_as_skipped(clip, monkeypatch):
    """zero_grad() drops a held window before its end: counted and reported as the host path
    counts and reports it (the same events)."""

    def loop(model, opt, batch, loss_fn):
        _nan_at(model, 0, [0])
        loss_fn(model, batch(0, "cpu")).backward()
        opt.zero_grad()  # the window dropped before its step
        return opt.skipped_steps, _skip_lines(model)

    dev, host = _both_paths(monkeypatch, loop, accumulation_steps=2, max_grad_norm=clip)
    assert dev[3] == host[3] and dev[3][0] == 1
    assert "step 1: the gradient of layers.2.fc1.lora_a is not finite: skipped the updates of" in dev[3][1][0]


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_resume_of_fp32_params_from_the_optimizer_state_dict_is_bit_exact(moments):
    """fp32 params (their own masters). With bf16 params neither path resumes bit for bit:
    the fp32 masters are not in the optimizer's state_dict() (test below)."""

    def wrapped():
        torch.manual_seed(0)
        model, batch, loss_fn = lora_mlp()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, moment_dtype=moments, **RESIDENT)
        return model, opt, batch, loss_fn

    model, opt, batch, loss_fn = wrapped()
    assert model._trainstream_engine.plan.device_state
    _steps(model, opt, batch, loss_fn, 0, 2)
    saved = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    st = next(iter(saved["optim"]["state"].values()))
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["exp_avg"].dtype == getattr(torch, moments)
    _steps(model, opt, batch, loss_fn, 2, 2)
    resumed, ropt, _, _ = wrapped()
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optim"])
    _steps(resumed, ropt, batch, loss_fn, 2, 2)
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
                # The host path's update may still be in flight on its threads: an edit waits
                # for it (README: synchronize() before you read or edit weights).
                opt.synchronize()
                with torch.no_grad():
                    model.layers[0].fc1.lora_b.mul_(0.5)  # the edit wins over the master's low bits
        return model, {k: v.clone() for k, v in model.state_dict().items()}

    model, state = run()
    assert model._trainstream_engine.plan.device_state
    _host_path(monkeypatch)
    _, host = run()
    for k in state:
        assert torch.equal(state[k], host[k]), k


@pytest.mark.parametrize("clip", [None, 1e9], ids=["eager", "clip"])
def test_lr_set_between_backward_and_step_as_on_the_host_path(clip, monkeypatch):
    """Eager: the update queued at backward's end read the old lr, and step() warns, as on
    the host path. Held (clipping): step() reads the new one, as torch's, without warning."""

    def run():
        torch.manual_seed(0)
        model, batch, loss_fn = lora_mlp()
        model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, max_grad_norm=clip, **RESIDENT)
        loss_fn(model, batch(0, "cpu")).backward()
        opt.param_groups[0]["lr"] = 0.5
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        opt.synchronize()
        return model, [w for w in caught if "changed from" in str(w.message)]

    model, warned = run()
    assert model._trainstream_engine.plan.device_state
    torch.manual_seed(0)
    ref, batch, loss_fn = lora_mlp()
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    loss_fn(ref, batch(0, "cpu")).backward()
    if clip is not None:
        ropt.param_groups[0]["lr"] = 0.5  # read at step(), as torch reads it
    ropt.step()
    assert max_diff(model.state_dict(), ref.state_dict()) < 1e-6
    assert bool(warned) == (clip is None)
    _host_path(monkeypatch)
    host, host_warned = run()
    assert [str(w.message) for w in host_warned] == [str(w.message) for w in warned]
    for k, v in host.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_a_peft_lora_over_an_nf4_llama_takes_device_state(monkeypatch):
    from engine.test_quantized import _peft_llama

    run = train("llama", dict(RESIDENT, quantize="nf4"), steps=3, model_factory=_peft_llama())
    _assert_device_state(run)
    _host_path(monkeypatch)
    assert_same_bits(run, train("llama", dict(RESIDENT, quantize="nf4"), steps=3, model_factory=_peft_llama()))


# -- the same loop on both paths: the planner's choice changes no result -----------------------


def _steps(model, opt, batch, loss_fn, start: int, n: int) -> None:
    """Training steps start .. start+n-1 of the LoRA MLP's batches."""
    for i in range(start, start + n):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()


def _both_paths(monkeypatch, loop, dtype=None, device="cpu", **wrap_options):
    """`loop(model, opt, batch, loss_fn)` over the LoRA MLP wrapped with `wrap_options`, with
    device state and then on the host path: both runs' (model, opt, state dict, loop's
    answer), after asserting that they end with the same weights, moments and step counts
    (bit for bit on the CPU path, within float rounding on CUDA, where the gradients' own
    reductions may round apart), and that no trainable p.grad is left."""

    def run():
        torch.manual_seed(0)
        model, batch, loss_fn = lora_mlp()
        if dtype is not None:
            model = model.to(dtype)
        model, opt = trainstream.wrap(model, None, device=device, lr=1e-2, offload=True, **RESIDENT, **wrap_options)
        cpu_batch = batch
        batch = (lambda i, _d: cpu_batch(i, device)) if device != "cpu" else batch
        answer = loop(model, opt, batch, loss_fn)
        opt.synchronize()
        return model, opt, {k: v.detach().clone() for k, v in model.state_dict().items()}, answer

    dev = run()
    assert dev[0]._trainstream_engine.plan.device_state
    with monkeypatch.context() as m:
        _host_path(m)
        host = run()
    assert not host[0]._trainstream_engine.plan.device_state
    same = torch.equal if device == "cpu" else (lambda a, b: max_diff({"t": a}, {"t": b}) < 1e-6)
    for k, v in dev[2].items():
        assert same(v, host[2][k]), k
    for a, b in zip(dev[1].state_dict()["state"].values(), host[1].state_dict()["state"].values(), strict=True):
        assert torch.equal(a["step"], b["step"])
        assert all(same(a[k].cpu(), b[k].cpu()) for k in ("exp_avg", "exp_avg_sq"))
    for model in (dev[0], host[0]):
        assert all(p.grad is None for p in model.parameters())
    return dev, host


def test_a_loop_without_zero_grad_trains_as_the_host_path(monkeypatch):
    """step() consumes the gradients on both paths: without zero_grad() the next step's are
    its own, not summed onto the last."""

    def loop(model, opt, batch, loss_fn):
        for i in range(4):
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()

    _both_paths(monkeypatch, loop)
    _both_paths(monkeypatch, loop, max_grad_norm=0.05)


def test_a_step_count_set_by_hand_is_taken_in_as_on_the_host_path(monkeypatch):
    """Device state keeps its step counts as views of one tensor (one op advances them all):
    a count replaced in the optimizer's state between steps is the one the next update reads
    and advances, as the host path reads it."""

    def loop(model, opt, batch, loss_fn):
        _steps(model, opt, batch, loss_fn, 0, 2)
        opt.synchronize()
        for p in [p for p in model.parameters() if p.requires_grad][::3]:
            opt.state[p]["step"] = torch.tensor(10.0)
        _steps(model, opt, batch, loss_fn, 2, 2)
        return sorted(int(st["step"]) for st in opt.state_dict()["state"].values())

    dev, host = _both_paths(monkeypatch, loop)
    assert dev[3] == host[3] and set(dev[3]) == {4, 12}


def test_step_after_every_micro_batch_with_accumulation_as_the_host_path(monkeypatch):
    """accumulation_steps=2 but step() after each pass: each step() ends a window of one pass
    (the last partial batch of an epoch), which counts that pass once."""

    def loop(model, opt, batch, loss_fn):
        for i in range(4):
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()
            if i == 1:
                opt.zero_grad()

    _both_paths(monkeypatch, loop, accumulation_steps=2)
    _both_paths(monkeypatch, loop, accumulation_steps=2, max_grad_norm=0.05)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_window_is_applied_at_its_last_pass_without_step(accumulation, monkeypatch):
    """Eager updates (no clipping): the window's last backward pass applies it, step() or
    not (docs/semantics.md); the next window after step() trains on."""

    def loop(model, opt, batch, loss_fn):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for i in range(accumulation):
            loss_fn(model, batch(i, "cpu")).backward()
        opt.synchronize()
        changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
        opt.step()
        opt.zero_grad()
        loss_fn(model, batch(5, "cpu")).backward()  # a partial window, applied by step()
        opt.step()
        return changed

    dev, host = _both_paths(monkeypatch, loop, accumulation_steps=accumulation)
    assert dev[3] == host[3] == {k for k in dev[2] if ".lora_" in k}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_nonfinite_gradient_is_skipped_and_reported_as_on_the_host_path(accumulation, monkeypatch):
    """nonfinite="skip" with a NaN in step 2: the same weights, step counts, skipped_steps and
    events on both paths (eager: the units from the one found on; accumulation: the window)."""

    def loop(model, opt, batch, loss_fn):
        counter = [0]
        _nan_at(model, 1, counter)
        for i in range(3):
            counter[0] = i
            for j in range(accumulation):
                (loss_fn(model, batch(2 * i + j, "cpu")) / accumulation).backward()
            opt.step()
            opt.zero_grad()
        return opt.skipped_steps, _skip_lines(model)

    dev, host = _both_paths(monkeypatch, loop, accumulation_steps=accumulation)
    assert dev[3] == host[3] and dev[3][0] == 1 and len(dev[3][1]) == 1
    assert "step 2: the gradient of layers.2.fc1.lora_a is not finite" in dev[3][1][0]


def test_a_backward_that_misses_the_models_outputs_trains_as_the_host_path(monkeypatch):
    """A loss on a parameter alone (no forward): its backward is a pass all the same, begun at
    the parameter's gradient, as the host path begins it."""

    def loop(model, opt, batch, loss_fn):
        for i in range(2):
            model.layers[0].fc1.lora_a.pow(2).sum().backward()
            opt.step()
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()

    _both_paths(monkeypatch, loop)


def test_an_exception_inside_backward_keeps_what_the_host_path_keeps(monkeypatch):
    """An error in a hook after backward has completed blocks 3 and 2: eager updates keep
    theirs (the host path queued them as they completed), the rest of the pass is dropped,
    and the next step trains every block."""

    def loop(model, opt, batch, loss_fn):
        fail = [True]

        def hook(grad):
            if fail[0]:
                fail[0] = False
                raise RuntimeError("a hook failed")
            return grad

        def on_output(module, args, out):
            out.register_hook(hook)  # reached once backward is done with blocks 3 and 2

        for i in range(3):
            watch = model.layers[1].register_forward_hook(on_output) if i == 1 else None
            loss = loss_fn(model, batch(i, "cpu"))
            if watch is not None:
                watch.remove()
            try:
                loss.backward()
            except RuntimeError as e:
                assert "a hook failed" in str(e) and i == 1
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()

    _both_paths(monkeypatch, loop)


def test_an_exception_inside_backward_under_accumulation_keeps_nothing(monkeypatch):
    def loop(model, opt, batch, loss_fn):
        def hook(grad):
            raise RuntimeError("a hook failed")

        loss_fn(model, batch(0, "cpu")).backward()
        out = model(batch(1, "cpu"))
        out.register_hook(hook)
        with pytest.raises(RuntimeError, match="a hook failed"):
            out.pow(2).mean().backward()
        opt.zero_grad()
        for i in range(2):
            loss_fn(model, batch(2 + i, "cpu")).backward()
        opt.step()

    _both_paths(monkeypatch, loop, accumulation_steps=2)


def test_bf16_params_resume_bit_for_bit(monkeypatch):
    """A bf16 param's fp32 master (device state's) travels in the optimizer's state_dict()
    under "master", so a resumed run continues from its low bits, not from the bf16 weights
    (tests/engine/test_resume_masters.py covers both paths and both load orders)."""

    def wrapped():
        torch.manual_seed(0)
        model, batch, loss_fn = lora_mlp()
        model = model.to(torch.bfloat16)
        model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **RESIDENT)
        return model, opt, batch, loss_fn

    model, opt, batch, loss_fn = wrapped()
    assert model._trainstream_engine.plan.device_state
    _steps(model, opt, batch, loss_fn, 0, 2)
    saved = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    _steps(model, opt, batch, loss_fn, 2, 2)
    resumed, ropt, _, _ = wrapped()
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optim"])
    _steps(resumed, ropt, batch, loss_fn, 2, 2)
    a, b = model.state_dict(), resumed.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert all("master" in st for st in saved["optim"]["state"].values())


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
@pytest.mark.parametrize("case", ["one group", "two groups", "bf16 model"])
def test_gpu_a_nonfinite_gradient_skips_the_device_state_update(case, monkeypatch):
    """The check runs on the device ahead of the kernels, which read each slot's skip: the
    unit found and those after it in backward's order are skipped (eager updates; block 3,
    which backward completed first, keeps its update), as on the host path and the CPU path,
    in one launch per param group and (gradient dtype, master or not)."""
    snapshots = []
    run = _run_with_nan(RESIDENT, device="cuda", case=case, snapshots=snapshots)
    _assert_device_state(run)
    model, opt = run[2]
    steps = {n: int(opt.state[p]["step"]) for n, p in model.named_parameters() if p.requires_grad}
    assert opt.skipped_steps == 1 and all(v == (4 if n.startswith("layers.3.") else 3) for n, v in steps.items())
    assert "step 2: the gradient of layers.2.fc1.lora_a is not finite" in trainstream.memory_report(model)["events"]
    _assert_skipped_from_block_2_on(snapshots)
    cpu = _run_with_nan(RESIDENT, case=case)
    if case != "bf16 model":  # bf16 matmuls round apart between devices by more
        assert max_diff(cpu[1], run[1]) < 5e-5  # the same updates (matmuls round apart between devices)
    assert _skip_lines(model) == _skip_lines(cpu[2][0])
    _host_path(monkeypatch)
    host = _run_with_nan(RESIDENT, device="cuda", case=case)
    assert_same_bits(run, host)  # the same gradients, the host AdamW's operations one by one
    assert _skip_lines(host[2][0]) == _skip_lines(model)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["no zero_grad", "step every micro-batch", "nan skip", "nan skip accumulation"])
def test_gpu_device_state_loops_train_as_the_host_path(case, monkeypatch):
    """The loops of the CPU tests above on CUDA: device state's update runs at the end of
    backward there too, with the lazy check, and ends where the host path ends."""
    accumulation = 2 if case in ("step every micro-batch", "nan skip accumulation") else 1

    def loop(model, opt, batch, loss_fn):
        counter = [0]
        if case.startswith("nan"):
            _nan_at(model, 1, counter)
        for i in range(3):
            counter[0] = i
            passes = accumulation if case.startswith("nan") else 1
            for j in range(passes):
                (loss_fn(model, batch(2 * i + j, "cuda")) / passes).backward()
            opt.step()
            if case != "no zero_grad":
                opt.zero_grad()
        return opt.skipped_steps, _skip_lines(model)

    dev, host = _both_paths(monkeypatch, loop, device="cuda", accumulation_steps=accumulation)
    assert dev[3] == host[3]
    assert dev[3][0] == (1 if case.startswith("nan") else 0)


@pytest.mark.gpu
def test_gpu_the_device_state_check_waits_for_nothing_in_backward():
    """nonfinite="skip" (the default) reads nothing back at the end of backward: with a long
    chain of matmuls queued ahead of backward, backward() and step() return while the GPU is
    still busy (no host sync), and the skip is known once the updates have run."""
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    model, opt = trainstream.wrap(model, None, device="cuda", lr=1e-2, offload=True, **RESIDENT)
    engine = model._trainstream_engine
    assert engine.plan.device_state
    counter = [0]
    _nan_at(model, 3, counter)
    x = torch.randn(4096, 4096, device="cuda")
    for i in range(4):
        counter[0] = i
        loss = loss_fn(model, batch(i, "cuda"))
        if i == 3:
            y = x
            for _ in range(200):  # a second of GPU work ahead of backward on the same stream
                y = torch.tanh(y @ x)
        loss.backward()
        opt.step()
        if i == 3:
            busy = torch.cuda.Event()
            busy.record()
            assert not busy.query()  # nothing waited for the GPU: backward's update is still queued
            assert engine.device_state.has_pending()
        opt.zero_grad()
    assert opt.skipped_steps == 1  # waits for the updates in flight
    assert not engine.device_state.has_pending()
    assert "step 4: the gradient of layers.2.fc1.lora_a is not finite" in trainstream.memory_report(model)["events"]
    steps = {n: int(opt.state[p]["step"]) for n, p in model.named_parameters() if p.requires_grad}
    assert all(v == (4 if n.startswith("layers.3.") else 3) for n, v in steps.items())


@pytest.mark.parametrize(
    "options",
    [dict(accumulation_steps=2), dict(max_grad_norm=0.05), dict(accumulation_steps=2, max_grad_norm=0.05)],
    ids=["accumulation", "clip", "accumulation+clip"],
)
def test_a_held_window_of_losses_on_a_parameter_alone_trains_as_the_host_path(options, monkeypatch):
    """A backward that never reaches the model's outputs begins its pass at a device-state
    gradient in every mode (the host path's own hook begins it there), so step() applies it."""

    def loop(model, opt, batch, loss_fn):
        for i in range(2):
            for _ in range(options.get("accumulation_steps", 1)):
                model.layers[0].fc1.lora_a.pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            for _ in range(options.get("accumulation_steps", 1)):
                loss_fn(model, batch(i, "cpu")).backward()
            opt.step()
            opt.zero_grad()

    _both_paths(monkeypatch, loop, **options)


def _raising_on_block_1(model):
    """A hook on block 1's output that raises once, in the next backward."""

    def hook(grad):
        raise RuntimeError("a hook failed")

    return model.layers[1].register_forward_hook(lambda m, a, o: o.register_hook(hook) and None)


@pytest.mark.parametrize("read", ["state_dict", "synchronize"])
def test_what_a_raised_backward_completed_is_applied_before_a_checkpoint(read, monkeypatch):
    """Eager updates: the host path queued the units backward completed before it raised; a
    checkpoint (or synchronize(), which unwrap() calls) taken right after the exception holds
    the same on both paths."""

    def loop(model, opt, batch, loss_fn):
        loss_fn(model, batch(0, "cpu")).backward()
        opt.step()
        opt.zero_grad()
        watch = _raising_on_block_1(model)
        loss = loss_fn(model, batch(1, "cpu"))
        watch.remove()
        with pytest.raises(RuntimeError, match="a hook failed"):
            loss.backward()
        if read == "state_dict":
            return [int(st["step"]) for st in opt.state_dict()["state"].values()]
        opt.synchronize()
        return [p.grad is None for p in model.parameters() if p.requires_grad]

    dev, host = _both_paths(monkeypatch, loop)
    assert dev[3] == host[3]


# -- the host never waits for the device in a resident step (issue 23) ------------------------

WARM_STEPS = 5  # past the adapter's timed passes (their events are read back), state placed


def _resident_lora(device: str, fmt: str):
    """A LoRA over a quantized resident base in device state, `WARM_STEPS` steps trained:
    (step(i), engine). Its batches are made on the device first (a pageable copy waits)."""
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device=device, offload=True, quantize=fmt, **RESIDENT)
    batches = [batch(i, device) for i in range(WARM_STEPS + 3)]

    def step(i):
        loss_fn(model, batches[i]).backward()
        opt.step()
        opt.zero_grad()

    for i in range(WARM_STEPS):
        step(i)
    engine = model._trainstream_engine
    assert engine.plan.device_state and all(u.streamed for u in engine.block_units)
    return step, engine


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_a_resident_quantized_lora_step_waits_on_no_event(fmt, monkeypatch):
    """The CPU backend's events stand for the GPU's: a step that would make the host wait for
    the device (an event's synchronize, a device update's wait) calls DONE.synchronize."""
    from trainstream.engine import device

    step, engine = _resident_lora("cpu", fmt)
    before = [p.detach().clone() for p in engine.optimizer.param_groups[0]["params"]]
    waits = []
    monkeypatch.setattr(device._DoneEvent, "synchronize", lambda self: waits.append(1))
    for i in range(WARM_STEPS, WARM_STEPS + 3):
        step(i)
    assert waits == []
    after = engine.optimizer.param_groups[0]["params"]
    assert all(not torch.equal(a, b) for a, b in zip(after, before))  # the steps did train


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_gpu_a_resident_quantized_lora_step_never_synchronizes(fmt, monkeypatch):
    """No host-device synchronization in a resident step: none that torch's sync debug mode
    sees (.item() of a device tensor, a pageable copy, a stream or device synchronize), and
    no event or stream synchronize of ours."""
    step, _ = _resident_lora("cuda", fmt)
    torch.cuda.synchronize()
    waits = []
    for owner in (torch.cuda.Event, torch.cuda.Stream):
        original = owner.synchronize
        monkeypatch.setattr(owner, "synchronize", lambda self, o=original, n=owner.__name__: (waits.append(n), o(self)))
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(WARM_STEPS, WARM_STEPS + 3):
            step(i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert waits == []


# -- optimizer state replaced by hand: the update reads what the optimizer holds ----------------


def _trained(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def test_moments_replaced_by_hand_are_the_ones_updated(monkeypatch):
    """The launches are built over the moments once; moments a user puts in optimizer.state
    are the ones updated from then on (as on the host path), not the ones they replaced."""

    def loop(model, opt, batch, loss_fn):
        _steps(model, opt, batch, loss_fn, 0, 2)
        opt.synchronize()
        for p in _trained(opt):
            opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])
            opt.state[p]["exp_avg_sq"] = torch.zeros_like(opt.state[p]["exp_avg_sq"])
        _steps(model, opt, batch, loss_fn, 2, 2)

    _both_paths(monkeypatch, loop)  # the same weights, moments and steps as the host path


def test_a_param_state_replaced_by_hand_is_the_one_advanced(monkeypatch):
    def loop(model, opt, batch, loss_fn):
        _steps(model, opt, batch, loss_fn, 0, 2)
        opt.synchronize()
        for p in _trained(opt)[:4]:
            st = opt.state[p]
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(st["exp_avg"]),
                "exp_avg_sq": torch.zeros_like(st["exp_avg_sq"]),
            }
        _steps(model, opt, batch, loss_fn, 2, 2)
        return [int(opt.state[p]["step"]) for p in _trained(opt)[:4]]

    dev, host = _both_paths(monkeypatch, loop)
    assert dev[3] == host[3] == [2, 2, 2, 2]


def test_an_optimizer_state_reset_keeps_a_state_to_save(monkeypatch):
    """`opt.state = defaultdict(dict)` starts every param's state afresh, and state_dict()
    saves the new state."""

    def loop(model, opt, batch, loss_fn):
        _steps(model, opt, batch, loss_fn, 0, 2)
        opt.synchronize()
        opt.state = collections.defaultdict(dict)
        _steps(model, opt, batch, loss_fn, 2, 2)
        return len(opt.state_dict()["state"])

    dev, host = _both_paths(monkeypatch, loop)
    assert dev[3] == host[3] == 16
