"""A refused wrap() leaves the model exactly as it was (SPEC.md), whatever stage refused it,
and frozen parameters in the optimizer are skipped, as torch skips them."""

import pytest
import torch
from helpers import PAGED, RESIDENT, max_diff
from models import tiny_gpt

import trainstream
from trainstream import api
from trainstream.engine import engine as engine_module
from trainstream.engine.device import HostArena
from trainstream.engine.engine import Engine
from trainstream.engine.optimizer import StreamedAdamW
from trainstream.engine.params import WeightPager
from trainstream.engine.state import StateHooks

_MODULE_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _snapshot(model) -> dict:
    """Everything wrap() changes on a model: each parameter's tensor (storage, device, dtype,
    values), its hooks and Python attributes; each module's hook dicts and instance methods;
    each buffer's tensor."""
    params = {
        name: (
            p.untyped_storage().data_ptr(),
            p.device,
            p.dtype,
            p.shape,
            p.stride(),
            p.detach().clone(),
            p.requires_grad,
            dict(p._post_accumulate_grad_hooks or {}),
            dict(p._backward_hooks or {}),
            sorted(vars(p)),
        )
        for name, p in model.named_parameters()
    }
    modules = {
        name: (
            {h: list(getattr(m, h).items()) for h in _MODULE_HOOKS},
            {k: v for k, v in vars(m).items() if callable(v) and not isinstance(v, torch.nn.Module)},
        )
        for name, m in model.named_modules()
    }
    buffers = {name: (b.untyped_storage().data_ptr(), b.device, b.dtype) for name, b in model.named_buffers()}
    return {"params": params, "modules": modules, "buffers": buffers}


def _assert_same(before: dict, after: dict) -> None:
    assert before["modules"] == after["modules"]
    assert before["buffers"] == after["buffers"]
    assert before["params"].keys() == after["params"].keys()
    for name, was in before["params"].items():
        now = after["params"][name]
        assert was[:5] == now[:5], name
        assert torch.equal(was[5], now[5]), name
        assert was[6:] == now[6:], name


def _fail_on_call(n: int):
    """A replacement that raises on its n-th call and calls the original before that."""

    def patch(original):
        calls = []

        def failing(*args, **kwargs):
            calls.append(None)
            if len(calls) >= n:
                raise RuntimeError("injected failure")
            return original(*args, **kwargs)

        return failing

    return patch


# (object, attribute, the call that raises): every stage of wrap(), in its order, and inside
# install() the steps that change the model, some after part of their work is done.
STAGES = {
    "options": (api._options, "parse", 1),
    "find_blocks": (api, "find_blocks", 1),
    "convert_optimizer": (api, "convert_optimizer", 1),
    "lay_out_model": (api, "lay_out_model", 1),
    "profile": (api, "_profile_for", 1),
    "plan_run": (api, "plan_run", 1),
    "engine": (api, "Engine", 1),
    "place_midway": (HostArena, "take", 7),
    "place_end": (WeightPager, "place", 1),
    "block_forwards_midway": (Engine, "_block_forward", 3),
    "grad_hooks_midway": (torch.Tensor, "register_post_accumulate_grad_hook", 5),
    "state_hooks": (StateHooks, "install", 1),
    # The 43rd thing install() puts on the model is a module's _apply: 2 model hooks, 4 block
    # forwards and 32 gradient hooks come first.
    "conversion_guards_midway": (engine_module, "_Installed", 43),
    "attach": (StreamedAdamW, "attach", 1),
    "share_param_groups": (StreamedAdamW, "share_param_groups", 1),
}


def _gpt_with_frozen_fc():
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    for name, p in model.named_parameters():
        if name.endswith("fc.weight"):
            p.requires_grad_(False)
    return model, batch, loss_fn


QUANTIZED = dict(RESIDENT, quantize="int8")
CASES = [(stage, PAGED) for stage in STAGES] + [
    (stage, QUANTIZED) for stage in ("place_midway", "place_end", "conversion_guards_midway")
]


@pytest.mark.parametrize(
    "stage, options", CASES, ids=[f"{stage}-{'quantized' if o is QUANTIZED else 'paged'}" for stage, o in CASES]
)
def test_a_refused_wrap_leaves_the_model_as_it_was(stage, options, monkeypatch):
    model, batch, loss_fn = _gpt_with_frozen_fc()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    before = _snapshot(model)
    groups = opt.param_groups
    owner, attr, n = STAGES[stage]
    monkeypatch.setattr(owner, attr, _fail_on_call(n)(getattr(owner, attr)))
    with pytest.raises(RuntimeError, match="injected failure"):
        trainstream.wrap(model, opt, device="cpu", offload=True, **options)
    monkeypatch.undo()
    assert not hasattr(model, "_trainstream_engine")
    _assert_same(before, _snapshot(model))
    assert opt.param_groups is groups
    # The same model and optimizer wrap and train afterwards, as torch trains them.
    reference, _, _ = _gpt_with_frozen_fc()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    model, wrapped = trainstream.wrap(model, opt, device="cpu", offload=True, **options)
    for i in range(3):
        for m, o in ((model, wrapped), (reference, ref_opt)):
            loss_fn(m, batch(i, "cpu")).backward()
            o.step()
            o.zero_grad()
    if "quantize" not in options:  # quantized frozen weights compute with their dequantized values
        assert max_diff(reference.state_dict(), model.state_dict()) < 2e-5


def test_frozen_parameters_in_the_optimizer_are_skipped_as_torch_skips_them():
    """AdamW(model.parameters()) on a peft model holds the frozen base too: wrap() trains the
    adapters as torch does and leaves the base alone."""
    peft = pytest.importorskip("peft")

    def lora():
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        config = peft.LoraConfig(r=4, target_modules=["qkv", "fc"], init_lora_weights=False)
        return peft.get_peft_model(model, config), batch, loss_fn

    reference, batch, loss_fn = lora()
    model, _, _ = lora()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and any(p.requires_grad for p in model.parameters())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    model, opt = trainstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), device="cpu", offload=True, **PAGED
    )
    for i in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            loss_fn(m, batch(i, "cpu")).backward()
            o.step()
            o.zero_grad()
    state = model.state_dict()
    assert max_diff(reference.state_dict(), state) < 2e-5
    for name, value in frozen.items():
        assert torch.equal(state[name], value), name
    # Its state_dict is torch's: the frozen parameters are listed, with no state.
    sd = opt.state_dict()
    assert len(sd["param_groups"][0]["params"]) == len(list(model.parameters()))
    assert len(sd["state"]) == sum(p.requires_grad for p in model.parameters())
