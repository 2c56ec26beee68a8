"""offload="auto": a model that fits switches to torch's fused AdamW, and stays when it must."""

import copy

import pytest
import torch
from helpers import machine, max_diff, planned_recompute, train
from models import tiny_mlp

import trainstream


def test_offload_auto_switches_to_fused_adamw_when_everything_fits():
    stock = train("mlp", None, steps=6)
    auto = train("mlp", dict(offload="auto", profile=machine(vram_gib=24)), steps=6)
    model, opt = auto[2]
    report = trainstream.memory_report(model)
    assert report["mode"] == "stock" and "switching to torch.optim.AdamW(fused=True)" in report["events"]
    assert opt._stock is not None and opt._stock.param_groups is opt.param_groups
    assert max_diff(stock[1], auto[1]) < 1e-5
    assert auto[0] == pytest.approx(stock[0], rel=1e-5)
    # torch's state_dict format, loadable into a plain AdamW; the model unwraps to itself.
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(opt.state_dict())
    assert trainstream.unwrap(model) is model
    assert not hasattr(model, "_trainstream_engine")


def test_after_the_switch_clipping_and_lr_changes_still_apply():
    stock = train("mlp", None, steps=5, clip=0.05)
    auto = train("mlp", dict(offload="auto", profile=machine(vram_gib=24)), steps=5, clip=0.05)
    assert trainstream.memory_report(auto[2][0])["mode"] == "stock"
    assert max_diff(stock[1], auto[1]) < 1e-5
    model, opt = auto[2]
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(8, 256)).pow(2).mean().backward()
    opt.step()
    # weight decay is lr-scaled too: nothing moves at lr 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "opts, reason",
    [
        (dict(profile=machine(vram_gib=4 / 1024)), "stock training would need"),
        (dict(param_offload=True, profile=machine(vram_gib=24)), "param_offload=True asks for paged weights"),
    ],
)
def test_offload_auto_stays_when_it_must(opts, reason):
    model = train("mlp", dict(offload="auto", **opts), steps=3)[2][0]
    report = trainstream.memory_report(model)
    assert report["mode"] == "offload" and reason in report["events"]


def _gpt_steps(model, opt, cfg, steps):
    idx = torch.randint(0, cfg.vocab, (8, 512), device="cuda")
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, torch.roll(idx, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
def test_gpu_a_model_that_fits_switches_to_fused_adamw():
    from models import GPT, GPTConfig

    cfg = GPTConfig(dim=768, layers=12, heads=12, vocab=32000)
    torch.manual_seed(0)
    model = GPT(cfg)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), device="cuda")
    losses = _gpt_steps(model, opt, cfg, 4)
    report = trainstream.memory_report(model)
    assert report["mode"] == "stock", report["events"]
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert opt._stock.param_groups[0]["fused"] and losses[-1] < losses[0]


def test_the_clipped_norm_is_reported_through_the_switch():
    """The report's last_grad_norm is the last step's, in offload mode up to the switch and
    from torch's clip_grad_norm_ after it: never None in between."""
    steps = []

    def train_and_read(n):
        run = train("mlp", dict(offload="auto", profile=machine(vram_gib=24)), steps=n, clip=0.05)
        report = trainstream.memory_report(run[2][0])
        steps.append(report["peaks"]["steps"])
        return report

    at_switch = train_and_read(2)  # the switch comes at the end of the second step
    assert at_switch["mode"] == "stock" and at_switch["last_grad_norm"] is not None
    after = train_and_read(3)
    assert after["mode"] == "stock" and after["last_grad_norm"] > 0 and steps == [2, 3]


def _auto_mlp(seed: int, device: str = "cpu", **options):
    """tiny_mlp wrapped with offload="auto" on a simulated 24 GiB card (on CUDA: the real one),
    clipping at 1.0; (model, optimizer, batch, loss_fn)."""
    torch.manual_seed(seed)
    model, batch, loss_fn = tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    profile = machine(vram_gib=24) if device == "cpu" else True
    opts = dict(device=device, offload="auto", profile=profile, max_grad_norm=1.0)
    model, opt = trainstream.wrap(model, opt, **dict(opts, **options))
    return model, opt, batch, loss_fn


def _steps(model, opt, batch, loss_fn, steps, device: str = "cpu") -> list:
    losses = []
    for i in steps:
        loss = loss_fn(model, batch(i, device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _resume_after_the_switch(device: str, model_first: bool = True, **resumed_options) -> None:
    """torch.save(opt.state_dict()) after offload="auto" switched, then a new wrap() and
    load_state_dict(): the run switches as it loads (it would measure two steps of its own on
    the engine first, and the host AdamW rounds otherwise than the fused one), and continues
    bit for bit as the uninterrupted run."""
    import io

    model, opt, batch, loss_fn = _auto_mlp(0, device)
    _steps(model, opt, batch, loss_fn, range(3), device)  # the switch comes at the end of the second step
    assert trainstream.memory_report(model)["mode"] == "stock"
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    whole = _steps(model, opt, batch, loss_fn, range(3, 6), device)

    resumed, resumed_opt, *_ = _auto_mlp(1, device, **resumed_options)  # other initial weights: the saved ones load
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    if model_first:
        resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optim"])
    if not model_first:  # the switch unwrapped the model: its state loads into the plain model
        resumed.load_state_dict(saved["model"])
    report = trainstream.memory_report(resumed)
    assert report["mode"] == "stock" and "switching now, before the first step" in report["events"]
    assert _steps(resumed, resumed_opt, batch, loss_fn, range(3, 6), device) == whole
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert p.device.type == device and torch.equal(p, q)
    # a plain torch AdamW takes the same state_dict (it ignores the mode's key)
    torch.optim.AdamW(resumed.parameters()).load_state_dict(resumed_opt.state_dict())


@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
def test_a_plain_loop_resumed_after_the_switch_continues_in_stock_mode(model_first):
    _resume_after_the_switch("cpu", model_first)


def test_a_resume_after_the_switch_into_optimizer_mode_gpu_continues_in_stock_mode():
    """A run whose moments live in the device update's regions (optimizer_mode="gpu") switches
    as it loads too, and continues as the uninterrupted run."""
    _resume_after_the_switch("cpu", optimizer_mode="gpu")


@pytest.mark.gpu
def test_gpu_a_plain_loop_resumed_after_the_switch_continues_in_stock_mode():
    _resume_after_the_switch("cuda")


def test_a_state_saved_before_the_switch_or_by_torch_keeps_the_engine():
    model, opt, batch, loss_fn = _auto_mlp(0)
    _steps(model, opt, batch, loss_fn, range(1))
    assert opt.state_dict()["trainstream_mode"] == "offload"
    for state in (opt.state_dict(), torch.optim.AdamW(model.parameters()).state_dict()):
        resumed, resumed_opt, *_ = _auto_mlp(1)
        resumed_opt.load_state_dict(state)
        assert trainstream.memory_report(resumed)["mode"] == "offload"


@pytest.mark.parametrize(
    "options, why",
    [
        (dict(offload=True), "offload=True keeps the engine"),
        (dict(param_offload=True), "param_offload=True asks for paged weights"),
    ],
)
def test_a_state_saved_after_the_switch_keeps_the_engine_the_options_ask_for(options, why):
    model, opt, batch, loss_fn = _auto_mlp(0)
    _steps(model, opt, batch, loss_fn, range(3))
    state = opt.state_dict()
    assert state["trainstream_mode"] == "stock"
    resumed, resumed_opt, *_ = _auto_mlp(1, **options)
    resumed_opt.load_state_dict(state)
    report = trainstream.memory_report(resumed)
    assert report["mode"] == "offload" and f"the engine stays: {why}" in report["events"]
    _steps(resumed, resumed_opt, batch, loss_fn, range(3, 4))  # and it trains on, from the loaded moments
    assert all(float(st["step"]) == 4 for st in resumed_opt.state.values())


def test_a_state_dict_with_an_unknown_mode_is_refused():
    model, opt, *_ = _auto_mlp(0)
    state = dict(opt.state_dict(), trainstream_mode="fused")
    with pytest.raises(ValueError, match="'trainstream_mode' is 'fused'; accepted: \\('offload', 'stock'\\)"):
        opt.load_state_dict(state)


def test_a_wrapped_optimizer_refuses_what_is_not_a_state_dict():
    model, opt, *_ = _auto_mlp(0)
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        opt.load_state_dict(["trainstream_mode"])


@pytest.mark.parametrize("wrong", ["groups", "sizes", "shapes"])
def test_a_refused_state_saved_after_the_switch_leaves_the_run_in_the_engine(wrong):
    """Another model's state, saved after its switch: refused before anything changes (the
    switch to stock cannot be undone), and the run trains on as if it had never been offered."""
    model, opt, batch, loss_fn = _auto_mlp(0)
    _steps(model, opt, batch, loss_fn, range(3))
    state = copy.deepcopy(opt.state_dict())
    assert state["trainstream_mode"] == "stock"
    if wrong == "groups":
        state["param_groups"] = state["param_groups"] * 2
    elif wrong == "sizes":
        state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:-1]
    else:
        first = state["param_groups"][0]["params"][0]
        state["state"][first]["exp_avg"] = state["state"][first]["exp_avg"][:1]
    resumed, resumed_opt, *_ = _auto_mlp(1)
    with pytest.raises(ValueError, match="another model"):
        resumed_opt.load_state_dict(state)
    assert trainstream.memory_report(resumed)["mode"] == "offload"


def test_offload_auto_does_not_cost_stock_training_without_every_blocks_activations(monkeypatch):
    """Blocks recomputed from the first pass on never saved their activations, so the meter has
    none of theirs: the switch would cost stock training from the others alone (review R7: it
    switched, and on a GPU that OOMs). It stays, and says why."""
    with planned_recompute(monkeypatch, [1, 2, 3]):
        auto = train("mlp", dict(offload="auto", profile=machine(vram_gib=24)), steps=6)
    report = trainstream.memory_report(auto[2][0])
    assert report["mode"] == "offload"
    assert "the activations of blocks [1, 2, 3] were not measured" in report["events"]
