"""model.state_dict() / load_state_dict() and the optimizer's while wrapped, and unwrap()."""

import copy

import pytest
import torch
from helpers import (
    GPU_MODE,
    PAGED,
    gpt_steps,
    machine,
    max_diff,
    train,
)
from models import tiny_gpt

import trainstream


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


def test_a_paged_weight_in_the_state_dict_is_its_own_storage_over_the_live_weights():
    """A paged param's entry is its host weights with a storage of exactly its bytes (torch.save
    writes a tensor's whole storage, and the weights are carved from larger pieces): the same
    memory, not a copy, and it outlives the wrapped model."""
    import gc

    _, _, (model, opt) = train("gpt", PAGED, steps=1)
    engine = model._trainstream_engine
    slot = next(s for u in engine.block_units for s in u.slots if s.name == "layers.0.qkv.weight")
    host = slot.host[slot.dtype]
    assert host.untyped_storage().nbytes() > host.numel() * host.element_size()  # carved from a piece
    entry = model.state_dict()["layers.0.qkv.weight"]
    assert entry.untyped_storage().nbytes() == entry.numel() * entry.element_size()
    assert entry.data_ptr() == host.data_ptr() and torch.equal(entry, host)
    values = entry.clone()
    del model, opt, engine, slot, host
    gc.collect()
    assert torch.equal(entry, values)


def test_state_dict_keep_vars_gives_real_values():
    _, state, (model, _) = train("gpt", PAGED, steps=1)
    kept = model.state_dict(keep_vars=True)
    for k, v in kept.items():
        assert torch.equal(v.detach(), state[k]), k


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


def test_gpu_mode_state_dicts_unwrap_and_switch():
    (host_model, host_opt), (model, opt) = gpt_steps("cpu"), gpt_steps("gpu")
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
