"""Resume is exact for a model that is not fp32: the wrapped optimizer's state_dict() carries
each bf16 param's fp32 master under "master" (OffloadAdamW's key and format), and a master
loaded after wrap() replaces the engine's where the param holds what it rounds to
(engine/optimizer.py, [Note: masters in state dicts]).

The reference is the run that never stopped: 3 steps, a checkpoint of the model's and the
optimizer's state dicts (through torch.save, as a user or the HF Trainer writes it), 3 more
steps; a fresh model, wrapped, loads the checkpoint (in either order) and takes the same 3
steps, which must give the same losses and weights bit for bit. Without the masters the
resumed run starts from the bf16 weights widened and parts from the reference at once
(lr 1e-2 moves a weight by many bf16 ulps a step, so the masters' low bits matter)."""

from __future__ import annotations

import gc
import io

import pytest
import torch
from helpers import PAGED, RESIDENT, assert_same_bits
from models import tiny_gpt, tiny_mlp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel

import trainstream
from trainstream.api import _engine_of

LR = 1e-2
SPLIT, STEPS = 3, 6  # the checkpoint is taken after SPLIT of STEPS steps


def _bf16_mlp(seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    model, batch, loss_fn = tiny_mlp(layers=4, dim=64)
    return model.to(torch.bfloat16), (lambda i: batch(i, device).to(torch.bfloat16)), loss_fn


def _bf16_lora(seed: int, device: str = "cpu"):
    """A tiny GPT in bf16 with peft LoRA adapters (r=4) on each block's qkv and fc, the
    adapters bf16 too (peft would make them fp32 when it casts them itself): a trainable set
    small enough for device state."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)  # one base for every run: only the adapters start elsewhere
    base, batch, _ = tiny_gpt()
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=["qkv", "fc"], lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(base, config).to(torch.bfloat16)
    return model, (lambda i: batch(i, device)), (lambda m, b: m(*b))


def _wrapped(make, seed: int, device: str = "cpu", **options):
    model, batch, loss_fn = make(seed, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    opts = dict(device=device, threads=1, profile=False, offload=True)
    opts.update(options)
    model, opt = trainstream.wrap(model, opt, **opts)
    return model, opt, batch, loss_fn


def _train(model, opt, batch, loss_fn, first: int, last: int) -> list:
    """Steps `first` to `last`; attention by the math kernel, whose backward is
    deterministic on a GPU too (two runs are compared bit for bit)."""
    losses = []
    for i in range(first, last):
        with sdpa_kernel(SDPBackend.MATH):
            loss = loss_fn(model, batch(i))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _checkpoint(model, opt) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    return buf.getvalue()


def _read(checkpoint: bytes) -> dict:
    return torch.load(io.BytesIO(checkpoint), weights_only=True, map_location="cpu")


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert_same_bits(a[k], b[k])


def _uninterrupted(make, **options):
    """STEPS steps with a checkpoint after SPLIT: (losses of the steps after it, the final
    weights, the checkpoint, the run's events)."""
    model, opt, batch, loss_fn = _wrapped(make, 0, **options)
    _train(model, opt, batch, loss_fn, 0, SPLIT)
    checkpoint = _checkpoint(model, opt)
    after = _train(model, opt, batch, loss_fn, SPLIT, STEPS)
    return after, _weights(model), checkpoint, trainstream.memory_report(model)["events"]


def _resumed(make, checkpoint: bytes, order: str, **options):
    """A fresh model (other initial weights), wrapped, loads `checkpoint` in `order` and
    trains the steps after it: (losses, final weights, events)."""
    model, opt, batch, loss_fn = _wrapped(make, 1, **options)
    saved = _read(checkpoint)
    if order == "model first":
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    else:
        opt.load_state_dict(saved["optim"])
        model.load_state_dict(saved["model"])
    losses = _train(model, opt, batch, loss_fn, SPLIT, STEPS)
    return losses, _weights(model), trainstream.memory_report(model)["events"]


ORDERS = ["model first", "optimizer first"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "options",
    [RESIDENT, PAGED, dict(RESIDENT, optimizer_mode="gpu"), dict(PAGED, optimizer_mode="gpu")],
    ids=["resident", "paged", "gpu mode resident", "gpu mode paged"],
)
def test_a_bf16_model_resumes_bit_for_bit(options, order, device):
    losses, weights, checkpoint, _ = _uninterrupted(_bf16_mlp, device=device, **options)
    saved = _read(checkpoint)["optim"]["state"]
    assert saved and all(st["master"].dtype == torch.float32 for st in saved.values())
    got_losses, got_weights, events = _resumed(_bf16_mlp, checkpoint, order, device=device, **options)
    assert got_losses == losses
    _same_weights(got_weights, weights)
    assert f"resume: {len(saved)} loaded fp32 master(s) taken\n" in events + "\n"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ORDERS)
def test_bf16_lora_adapters_in_device_state_resume_bit_for_bit(order, device):
    losses, weights, checkpoint, events = _uninterrupted(_bf16_lora, device=device, **RESIDENT)
    assert "device state: the" in events  # the adapters' whole state stays on the device
    saved = _read(checkpoint)["optim"]["state"]
    assert len(saved) == 4 * 2 * 2 and all("master" in st for st in saved.values())  # A and B of 2 modules, 4 blocks
    got_losses, got_weights, _ = _resumed(_bf16_lora, checkpoint, order, device=device, **RESIDENT)
    assert got_losses == losses
    _same_weights(got_weights, weights)


def test_the_saved_master_is_the_engines_and_not_the_weights_widened():
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 0, **RESIDENT)
    _train(model, opt, batch, loss_fn, 0, SPLIT)
    sd = opt.state_dict()
    engine = _engine_of(model)
    params = [p for g in opt.param_groups for p in g["params"]]
    slots = {s.param: s for u in engine.units for s in u.slots}
    low_bits = False
    for i, p in enumerate(params):
        master = sd["state"][i]["master"]
        assert master.shape == p.shape and master.dtype == torch.float32 and master.device.type == "cpu"
        assert_same_bits(master, slots[p].master.view(p.shape))
        assert_same_bits(master.to(torch.bfloat16), p.detach())  # the weights are its rounding
        low_bits |= not torch.equal(master, p.detach().float())
    assert low_bits
    assert "master" not in opt.state[params[0]]  # the entries are the state dict's, not the optimizer's
    _train(model, opt, batch, loss_fn, SPLIT, SPLIT + 1)
    assert not torch.equal(sd["state"][0]["master"], opt.state_dict()["state"][0]["master"])  # a copy, not live


@pytest.mark.parametrize("options", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_a_master_the_weights_do_not_round_to_is_not_taken(options):
    """The checkpoint's optimizer state with other weights (the fresh model's own): the
    weights win, the master starts from them widened, and the events say so."""
    _, _, checkpoint, _ = _uninterrupted(_bf16_mlp, **options)
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 1, **options)
    before = _weights(model)
    opt.load_state_dict(_read(checkpoint)["optim"])
    with torch.no_grad():
        loss_fn(model, batch(SPLIT))  # the next forward settles the loaded masters
    masters = {i: st["master"] for i, st in opt.state_dict()["state"].items()}
    names = list(before)  # the MLP's weights, in the optimizer's order
    assert len(masters) == len(names)
    for i, name in enumerate(names):
        assert_same_bits(masters[i], before[name].float())
    events = trainstream.memory_report(model)["events"]
    assert f"resume: 0 loaded fp32 master(s) taken; {len(names)} not" in events


def test_an_edit_after_the_loads_lets_the_weights_win_for_that_param_only():
    """Model, optimizer (every master taken there), then one weight edited in place before
    the next forward: that param's master starts from its new weights, as after any in-place
    edit (in state_dict() too, before the next update takes it); the others keep their loaded
    masters."""
    _, _, checkpoint, _ = _uninterrupted(_bf16_mlp, **RESIDENT)
    saved = _read(checkpoint)
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 1, **RESIDENT)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    with torch.no_grad():
        model[0].weight.mul_(2)  # exact in bf16
    with torch.no_grad():
        loss_fn(model, batch(SPLIT))
    sd = opt.state_dict()
    assert_same_bits(sd["state"][0]["master"], model[0].weight.detach().float())
    for i in range(1, 4):
        assert_same_bits(sd["state"][i]["master"], saved["optim"]["state"][i]["master"])
    assert "resume: 4 loaded fp32 master(s) taken\n" in trainstream.memory_report(model)["events"] + "\n"


def _torch_adamw(seed: int, start: dict | None = None):
    model, batch, loss_fn = _bf16_mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optim"])
    return model, opt, batch, loss_fn


def test_a_torch_adamw_state_dict_loads_and_the_masters_start_from_the_weights():
    model, opt, batch, loss_fn = _torch_adamw(0)
    _train(model, opt, batch, loss_fn, 0, SPLIT)
    saved = _read(_checkpoint(model, opt))
    wrapped, wopt, _, _ = _wrapped(_bf16_mlp, 1, **RESIDENT)
    wrapped.load_state_dict(saved["model"])
    wopt.load_state_dict(saved["optim"])
    _train(wrapped, wopt, batch, loss_fn, SPLIT, SPLIT + 1)
    # The reference: the same load and step, the masters made from the weights by wrap().
    ref, ropt, _, _ = _wrapped(lambda s, device: (_torch_adamw(s, saved)[0], batch, loss_fn), 1, **RESIDENT)
    ropt.load_state_dict(saved["optim"])
    _train(ref, ropt, batch, loss_fn, SPLIT, SPLIT + 1)
    _same_weights(_weights(wrapped), _weights(ref))
    got, want = wopt.state_dict()["state"], ropt.state_dict()["state"]
    for i in want:
        for key in ("step", "exp_avg", "exp_avg_sq", "master"):
            assert_same_bits(got[i][key], want[i][key])


def test_wrapped_to_torch_adamw_and_back():
    """Our checkpoint into torch AdamW (which keeps "master", cast to bf16, stale while it
    trains the params itself, and saves it again), 2 steps there, back into a wrapped model:
    the stale master is not taken, and the run is the one that loads torch's checkpoint
    with no master at all."""
    _, _, checkpoint, _ = _uninterrupted(_bf16_mlp, **RESIDENT)
    plain, popt, batch, loss_fn = _torch_adamw(1, _read(checkpoint))
    assert all(st["master"].dtype == torch.bfloat16 for st in popt.state_dict()["state"].values())
    _train(plain, popt, batch, loss_fn, SPLIT, SPLIT + 2)
    back = _read(_checkpoint(plain, popt))
    stripped = {
        "model": back["model"],
        "optim": {
            **back["optim"],
            "state": {i: {k: v for k, v in st.items() if k != "master"} for i, st in back["optim"]["state"].items()},
        },
    }
    runs = []
    for start in (back, stripped):
        model, opt, _, _ = _wrapped(_bf16_mlp, 2, **RESIDENT)
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optim"])
        losses = _train(model, opt, batch, loss_fn, SPLIT + 2, STEPS)
        runs.append((losses, _weights(model), opt.state_dict()["state"]))
    assert runs[0][0] == runs[1][0]
    _same_weights(runs[0][1], runs[1][1])
    for i, st in runs[1][2].items():
        assert_same_bits(runs[0][2][i]["master"], st["master"])


class _OffloadOnHost(trainstream.OffloadAdamW):
    """OffloadAdamW streaming CPU params as it streams GPU ones (tests/test_offload_adamw_cuda.py
    does the same): a bf16 param gets an fp32 master in host memory, saved under "master"."""

    _stream_host_params = True


def _offload_run(seed: int, start: dict | None, first: int, last: int):
    model, batch, loss_fn = _bf16_mlp(seed)
    opt = _OffloadOnHost(model.parameters(), lr=LR, weight_decay=0.01)
    if start is not None:
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["optim"])
    losses = _train(model, opt, batch, loss_fn, first, last)
    opt.synchronize()
    return losses, model, opt


def test_offload_adamw_and_the_wrapped_optimizer_resume_from_each_other_bit_for_bit():
    """The same key and format both ways: 3 steps of one, its checkpoint into the other, 3
    more steps there, against the first continuing on its own."""
    losses, weights, checkpoint, _ = _uninterrupted(_bf16_mlp, **RESIDENT)
    got, model, _ = _offload_run(1, _read(checkpoint), SPLIT, STEPS)  # wrapped -> OffloadAdamW
    assert got == losses
    _same_weights(_weights(model), weights)

    _, model, opt = _offload_run(0, None, 0, SPLIT)
    checkpoint = _checkpoint(model, opt)
    assert all(st["master"].dtype == torch.float32 for st in _read(checkpoint)["optim"]["state"].values())
    batch, loss_fn = _bf16_mlp(0)[1:]
    want = _train(model, opt, batch, loss_fn, SPLIT, STEPS)  # OffloadAdamW uninterrupted
    opt.synchronize()
    for order in ORDERS:  # OffloadAdamW -> wrapped
        got_losses, got_weights, _ = _resumed(_bf16_mlp, checkpoint, order, **RESIDENT)
        assert got_losses == want
        _same_weights(got_weights, _weights(model))


def test_the_hook_that_settles_loaded_masters_goes_at_the_next_forward():
    """A load whose masters the weights do not round to yet hooks the model's next forward;
    that forward settles them and the hook goes, so later forwards pay nothing."""
    _, _, checkpoint, _ = _uninterrupted(_bf16_mlp, **RESIDENT)
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 1, **RESIDENT)
    hooks = len(model._forward_pre_hooks)
    opt.load_state_dict(_read(checkpoint)["optim"])
    assert len(model._forward_pre_hooks) == hooks + 1
    with torch.no_grad():
        loss_fn(model, batch(SPLIT))
    assert len(model._forward_pre_hooks) == hooks
    opt.load_state_dict(_read(checkpoint)["optim"])  # and an unwrap() before the forward takes it off
    trainstream.unwrap(model)
    assert not model._forward_pre_hooks


# -- a wrapped Parameter replaced on the model ---------------------------------------------


@pytest.mark.parametrize("options", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_a_trainable_parameter_replaced_after_wrap_is_refused_at_the_next_step(options):
    """The engine updates the Parameters it was wrapped with: one replaced on its module
    (setattr of a new nn.Parameter) would train nothing the forward reads. step() refuses,
    naming it, before any update of that step."""
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 0, **options)
    _train(model, opt, batch, loss_fn, 0, 1)
    model[2].weight = torch.nn.Parameter(model[2].weight.detach().clone())  # the same values
    loss_fn(model, batch(1)).backward()
    with pytest.raises(RuntimeError, match=r"wrapped parameter '2\.weight' \(torch\.bfloat16\) was replaced"):
        opt.step()


def test_a_module_holding_wrapped_parameters_replaced_after_wrap_is_refused_at_the_next_step():
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 0, **RESIDENT)
    _train(model, opt, batch, loss_fn, 0, 1)
    model[1] = torch.nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
    loss_fn(model, batch(1)).backward()
    with pytest.raises(RuntimeError, match=r"the module '1', which holds wrapped parameters, was replaced"):
        opt.step()


def test_peft_load_adapter_casting_bf16_adapters_is_refused_and_loading_in_place_trains(tmp_path):
    """peft's load_adapter (autocast_adapter_dtype=True, its default) makes each bf16 adapter a
    new fp32 Parameter: the next step() refuses. With autocast_adapter_dtype=False it loads
    into the wrapped Parameters, which go on training."""
    model, opt, batch, loss_fn = _wrapped(_bf16_lora, 0, **RESIDENT)
    _train(model, opt, batch, loss_fn, 0, 1)
    model.save_pretrained(str(tmp_path))
    wrapped_with = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.load_adapter(str(tmp_path), "default", is_trainable=True, autocast_adapter_dtype=False)
    assert all(p is wrapped_with[n] for n, p in model.named_parameters() if p.requires_grad)
    before = {n: p.detach().clone() for n, p in wrapped_with.items()}
    _train(model, opt, batch, loss_fn, 1, 2)
    assert all(not torch.equal(p.detach(), before[n]) for n, p in wrapped_with.items())
    model.load_adapter(str(tmp_path), "default", is_trainable=True)
    loss_fn(model, batch(2)).backward()
    with pytest.raises(RuntimeError, match=r"wrapped parameter '.*lora_A\.default\.weight' .* autocast_adapter_dtype"):
        opt.step()


# -- what a load keeps, what unwrap() keeps, what a load refuses -----------------------------


def _storages_freed(tensors) -> list:
    refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
    return lambda: [r.expired() for r in refs]


def test_masters_taken_at_the_load_are_let_go_and_no_hook_waits():
    """Model first: every master is taken at the optimizer's load; the loaded tensors are not
    held (a full fine-tune's masters are 4 bytes a parameter) and no forward hook is left."""
    _, _, checkpoint, _ = _uninterrupted(_bf16_mlp, **RESIDENT)
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 1, **RESIDENT)
    hooks = len(model._forward_pre_hooks)
    saved = _read(checkpoint)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    freed = _storages_freed([st["master"] for st in saved["optim"]["state"].values()])
    del saved
    gc.collect()
    assert freed() == [True] * 4
    assert len(model._forward_pre_hooks) == hooks
    assert "resume: 4 loaded fp32 master(s) taken\n" in trainstream.memory_report(model)["events"] + "\n"


def test_masters_waiting_for_the_weights_are_let_go_once_taken():
    """Optimizer first: the masters wait (and the hook with them) until the weights round to
    them; state_dict() after the model's load takes them all, lets them go and drops the hook."""
    _, _, checkpoint, _ = _uninterrupted(_bf16_mlp, **RESIDENT)
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 1, **RESIDENT)
    hooks = len(model._forward_pre_hooks)
    saved = _read(checkpoint)
    opt.load_state_dict(saved["optim"])
    assert len(model._forward_pre_hooks) == hooks + 1
    model.load_state_dict(saved["model"])
    freed = _storages_freed([st["master"] for st in saved["optim"]["state"].values()])
    want = {i: st["master"].clone() for i, st in saved["optim"]["state"].items()}
    del saved
    sd = opt.state_dict()
    gc.collect()
    assert freed() == [True] * 4
    assert len(model._forward_pre_hooks) == hooks
    for i, master in want.items():
        assert_same_bits(sd["state"][i]["master"], master)


@pytest.mark.parametrize(
    "make, options",
    [(_bf16_mlp, RESIDENT), (_bf16_mlp, PAGED), (_bf16_lora, RESIDENT)],
    ids=["resident", "paged", "lora device state"],
)
def test_state_dict_after_unwrap_keeps_the_masters(make, options):
    """train -> unwrap() -> checkpoint: the optimizer keeps the engine's fp32 masters, so that
    checkpoint resumes bit for bit as one taken while wrapped."""
    losses, weights, wrapped_checkpoint, _ = _uninterrupted(make, **options)
    model, opt, batch, loss_fn = _wrapped(make, 0, **options)
    _train(model, opt, batch, loss_fn, 0, SPLIT)
    plain = trainstream.unwrap(model)
    checkpoint = _checkpoint(plain, opt)
    saved, want = _read(checkpoint)["optim"]["state"], _read(wrapped_checkpoint)["optim"]["state"]
    assert saved.keys() == want.keys() and all("master" in st for st in saved.values())
    for i in want:
        assert_same_bits(saved[i]["master"], want[i]["master"])
    got_losses, got_weights, _ = _resumed(make, checkpoint, "model first", **options)
    assert got_losses == losses
    _same_weights(got_weights, weights)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda m: torch.empty_like(m, device="meta"), r"state\[2\]\['master'\] is a tensor on the meta device"),
        (lambda m: m.long(), r"state\[2\]\['master'\] is a torch\.int64 tensor"),
    ],
    ids=["meta", "int64"],
)
def test_a_master_that_cannot_be_read_is_refused_before_anything_is_replaced(bad, match):
    _, _, checkpoint, _ = _uninterrupted(_bf16_mlp, **RESIDENT)
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp, 1, **RESIDENT)
    groups, group = opt.param_groups, opt.param_groups[0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    saved = _read(checkpoint)["optim"]
    saved["state"][2]["master"] = bad(saved["state"][2]["master"])
    with pytest.raises(ValueError, match=match + r"; accepted: a floating-point tensor of its parameter's shape"):
        opt.load_state_dict(saved)
    assert opt.param_groups is groups and opt.param_groups[0] is group and not opt.state
    scheduler.step()  # still drives the optimizer's groups
    assert group["lr"] == LR * 0.5


class _Scale(torch.nn.Module):
    """An fp32 parameter in a bf16 model (its own master)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.scale.to(x.dtype)


def _bf16_mlp_with_fp32_scale(seed: int, device: str = "cpu"):
    model, batch, loss_fn = _bf16_mlp(seed, device)
    return torch.nn.Sequential(*model[:2], _Scale(64), *model[2:]), batch, loss_fn


def test_a_master_of_an_fp32_param_is_ignored_and_not_counted():
    """An fp32 param is its own master: a "master" in its entry (a converter's) is not read,
    and the events count only the bf16 params' masters."""
    losses, weights, checkpoint, _ = _uninterrupted(_bf16_mlp_with_fp32_scale, **RESIDENT)
    saved = _read(checkpoint)
    assert sorted(saved["optim"]["state"]) == [0, 1, 2, 3, 4] and "master" not in saved["optim"]["state"][2]
    saved["optim"]["state"][2]["master"] = torch.full((64,), 3.0)
    model, opt, batch, loss_fn = _wrapped(_bf16_mlp_with_fp32_scale, 1, **RESIDENT)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    assert _train(model, opt, batch, loss_fn, SPLIT, STEPS) == losses
    _same_weights(_weights(model), weights)
    assert "resume: 4 loaded fp32 master(s) taken\n" in trainstream.memory_report(model)["events"] + "\n"
