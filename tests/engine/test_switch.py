"""offload="auto": a model that fits switches to torch's fused AdamW, and stays when it must."""

import pytest
import torch
from helpers import machine, max_diff, train

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
