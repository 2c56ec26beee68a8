"""The optimizer wrap() returns: the host and device (optimizer_mode="gpu") updates give the
same bits, its state loads and converts, and its parameters' dtypes are checked."""

import pytest
import torch
from helpers import GPU_MODE, PAGED, RESIDENT, assert_same_bits, gpt_steps, max_diff, train
from models import tiny_gpt, tiny_mlp

import trainstream


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


def test_mapped_moments_take_a_loaded_state_dict_and_go_with_the_switch():
    """The moments in the host arena (on the CPU backend, plain memory stands in for the
    pinned arena) are the optimizer's state; pinning new buffers copies the state in; they
    keep their buffers through load_state_dict, which copies into them, and are let go when
    offload="auto" switches to stock training."""
    from trainstream.engine.adapt import SwitchToStock

    model, opt = gpt_steps("gpu")
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
    model._trainstream_engine.apply(SwitchToStock({}))
    assert opt._mapped == {}  # (on a GPU the stock state is a device copy: nothing else holds them)


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


def test_float16_parameters_are_refused():
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        trainstream.wrap(model.half(), None, device="cpu")


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


def _scheduled_run(wrapped: bool, make_scheduler, steps: int = 5, reload: bool = False):
    """tiny_gpt trained `steps` steps by torch AdamW with a scheduler built on it before
    wrap() (when `wrapped`); `reload`: the wrapped optimizer loads its own state_dict first."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    scheduler = make_scheduler(opt)
    source = opt
    if wrapped:
        model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, **RESIDENT)
        assert opt.param_groups is source.param_groups
        assert all(a is b for a, b in zip(opt.param_groups, source.param_groups))
        if reload:
            opt.load_state_dict(opt.state_dict())
            assert opt.param_groups is source.param_groups and opt.param_groups[0] is source.param_groups[0]
    lrs = []
    for i in range(steps):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return lrs, state


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
}


@pytest.mark.parametrize("reload", [False, True], ids=["as_wrapped", "after_load_state_dict"])
@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_a_scheduler_built_before_wrap_drives_the_updates(kind, reload):
    """SPEC.md: the optimizer wrap() returns shares its param_groups (the list and its dicts)
    with the one passed in, so a scheduler built on that one sets the learning rate the
    updates read, as with torch alone; load_state_dict keeps the sharing. Without a warning:
    the scheduler's check that step() ran sees the wrapped optimizer's steps."""
    import warnings

    stock_lrs, stock = _scheduled_run(False, SCHEDULERS[kind])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lrs, wrapped = _scheduled_run(True, SCHEDULERS[kind], reload=reload)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert lrs == stock_lrs
    assert max_diff(stock, wrapped) < 2e-5


def test_synchronize_makes_weights_read_after_it_current():
    """optimizer.synchronize() (SPEC.md): every update finished and on the model's tensors,
    so reading a weight right after step() gives torch AdamW's new value, on the wrapped
    optimizer and after the switch to stock alike (there it waits for the fused kernels)."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_mlp()
    reference, _, _ = tiny_mlp()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    model, opt = trainstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu", offload=True, **RESIDENT
    )
    for i in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            loss_fn(m, batch(i, "cpu")).backward()
            o.step()
            o.zero_grad()
        opt.synchronize()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.detach() - q.detach()).abs().max().item() < 1e-5


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no_clip", "max_grad_norm"])
def test_the_switch_to_stock_warns_that_user_clipping_starts_to_work(clip):
    """p.grad stays None under the engine, so a torch.nn.utils.clip_grad_norm_ of the user's
    does nothing until offload="auto" switches to stock training, where it starts clipping:
    without max_grad_norm the switch says so, once; with it nothing changes and nothing warns."""
    import warnings

    from helpers import machine

    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(
        model, None, device="cpu", offload="auto", profile=machine(vram_gib=24), max_grad_norm=clip
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()
            opt.zero_grad()
    assert trainstream.memory_report(model)["mode"] == "stock"
    about_clipping = [w for w in caught if "clip_grad_norm_" in str(w.message)]
    assert len(about_clipping) == (1 if clip is None else 0)


def test_the_wrapped_optimizer_reports_the_clipped_norm_in_offload_mode():
    """optimizer.last_grad_norm is the engine's global norm while the engine steps (it was
    set only by stock steps, so a caller reading it in offload mode got None)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    model, opt = trainstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        device="cpu",
        offload=True,
        max_grad_norm=0.5,
        profile=False,
    )
    assert opt.last_grad_norm is None
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    engine = model._trainstream_engine
    assert opt.last_grad_norm is not None and opt.last_grad_norm == engine.last_grad_norm > 0.5
