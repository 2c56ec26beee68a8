"""The device-state update (a LoRA's adapters and their AdamW state on the compute device) and
the host path answer a non-finite gradient alike (docs/semantics.md): the same parameter named
when several are not finite, the same exception when backward itself raises with one found
before; and OffloadAdamW refuses a saved state without its step count, as torch's AdamW does."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import RESIDENT

import trainstream
from engine.test_device_state import _host_path, lora_mlp


def _wrapped(nonfinite: str, clip, accumulation: int, device: str = "cpu", **options):
    torch.manual_seed(0)
    model, batch, loss_fn = lora_mlp()
    model, opt = trainstream.wrap(
        model,
        None,
        device=device,
        lr=1e-2,
        offload=True,
        nonfinite=nonfinite,
        max_grad_norm=clip,
        accumulation_steps=accumulation,
        **RESIDENT,
        **options,
    )
    return model, opt, (lambda i, _device: batch(i, device)), loss_fn


def _nan_into(model, names) -> None:
    """Every backward pass from here on makes the gradients of `names` NaN."""
    params = dict(model.named_parameters())
    for name in names:
        params[name].register_hook(lambda g: g * float("nan"))


def _named(nonfinite: str, clip, accumulation: int, bad, **options) -> tuple:
    """One step (a window) with the gradients of `bad` NaN: (whether the adapters are in device
    state, the parameter the FloatingPointError or the skip event names)."""
    model, opt, batch, loss_fn = _wrapped(nonfinite, clip, accumulation, **options)
    _nan_into(model, bad)
    named = None
    try:
        for i in range(accumulation):
            loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
    except FloatingPointError as e:
        named = re.search(r"the gradient of (\S+) is not finite", str(e)).group(1)
    opt.zero_grad()
    events = trainstream.memory_report(model)["events"]
    found = re.findall(r"the gradient of (\S+) is not finite: skipped", events)
    if nonfinite == "skip":
        assert named is None and len(found) == 1, events
        named = found[0]
    else:
        assert not found, events
    return bool(model._trainstream_engine.plan.device_state), named


# Backward reaches block 2 before block 1, and in a block fc2 before fc1 (the reverse of forward).
TWO_NOT_FINITE = {
    "two blocks": (["layers.1.fc1.lora_a", "layers.2.fc1.lora_a"], "layers.2.fc1.lora_a"),
    "one block": (["layers.2.fc1.lora_a", "layers.2.fc2.lora_a"], "layers.2.fc2.lora_a"),
}


@pytest.mark.parametrize("where", list(TWO_NOT_FINITE))
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no clip", "clip"])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_two_gradients_not_finite_name_the_first_in_backwards_order_on_both_paths(
    nonfinite, clip, accumulation, where, monkeypatch
):
    """docs/semantics.md: the error and the events name the first parameter whose gradient is
    not finite in the order backward produced them (the order eager updates hand units on),
    whatever holds the updates (clipping, accumulation) and on either path."""
    bad, first = TWO_NOT_FINITE[where]
    on_device = _named(nonfinite, clip, accumulation, bad)
    with monkeypatch.context() as m:
        _host_path(m)
        on_host = _named(nonfinite, clip, accumulation, bad)
    assert on_device == (True, first)
    assert on_host == (False, first)


def test_offload_adamw_refuses_a_state_without_its_step_count_as_torch_does():
    """torch's AdamW refuses a param's state without "step" at load_state_dict (a KeyError);
    OffloadAdamW refuses it there too, naming the param's index and the key, before anything
    is replaced. An empty state (a param never stepped) loads, as in torch."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = trainstream.OffloadAdamW([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    fresh = torch.nn.Parameter(torch.randn(4, 3))
    target = trainstream.OffloadAdamW([fresh], lr=1e-2)
    before = target.state_dict()
    for state in (
        {"master": saved["state"][0]["exp_avg"].clone()},
        {k: v for k, v in saved["state"][0].items() if k != "step"},
    ):
        broken = dict(saved, state={0: state})
        with pytest.raises(KeyError, match="step"):
            reference = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 3))])
            reference.load_state_dict(dict(broken, state={0: dict(state)}))
        with pytest.raises(ValueError, match=r"state\[0\] has no 'step'"):
            target.load_state_dict(broken)
        assert target.state_dict()["state"] == before["state"]  # nothing replaced
    target.load_state_dict(dict(saved, state={}))  # a param never stepped
    assert target.state_dict()["state"] == {}


@pytest.mark.parametrize("where", list(TWO_NOT_FINITE))
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_the_check_on_the_device_names_a_units_gradients_in_their_order(nonfinite, where, monkeypatch):
    """optimizer_mode="gpu" with eager updates (the host path's check on the device, here with
    the host AdamW standing in: tests/conftest.py): a unit's gradients are named in the order
    they came, as the host check and device state name them (was the unit's own order)."""
    bad, first = TWO_NOT_FINITE[where]
    on_device = _named(nonfinite, None, 1, bad, optimizer_mode="gpu")
    with monkeypatch.context() as m:
        _host_path(m)
        on_host = _named(nonfinite, None, 1, bad, optimizer_mode="gpu")
    assert on_device == (True, first)
    assert on_host == (False, first)


class _UsersOwn(Exception):
    """The exception a user's hook raises inside backward."""


def _raised_inside_backward(nonfinite: str, clip, accumulation: int, device: str = "cpu") -> tuple:
    """A NaN gradient in block 3 (reached first by backward), then the user's own exception
    from a hook on block 1, in the window's last pass; then a step of training. Returns (the
    exception's type, the events' lines about gradients not finite, skipped_steps, the weights
    after the failed window, the weights after one more step)."""
    model, opt, batch, loss_fn = _wrapped(nonfinite, clip, accumulation, device)
    params = dict(model.named_parameters())
    failing = [True]
    params["layers.3.fc1.lora_a"].register_hook(lambda g: g * float("nan") if failing[0] else g)

    def users_hook(g):
        if failing[0]:
            raise _UsersOwn("the user's own")
        return g

    params["layers.1.fc1.lora_a"].register_hook(users_hook)
    raised = None
    try:
        for i in range(accumulation):
            loss_fn(model, batch(i, "cpu")).backward()
    except BaseException as e:  # noqa: BLE001 (the test compares what each path raises)
        raised = type(e)
    opt.zero_grad()
    opt.synchronize()
    failed = {k: v.to("cpu", copy=True) for k, v in model.state_dict().items()}
    failing[0] = False
    for i in range(accumulation):
        loss_fn(model, batch(10 + i, "cpu")).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    lines = [line.split("] ", 1)[-1] for line in trainstream.memory_report(model)["events"].splitlines()]
    lines = [line for line in lines if "not finite" in line]
    after = {k: v.to("cpu", copy=True) for k, v in model.state_dict().items()}
    return bool(model._trainstream_engine.plan.device_state), raised, lines, opt.skipped_steps, failed, after


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no clip", "clip"])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_an_exception_inside_backward_after_a_nonfinite_gradient_surfaces_as_itself(
    nonfinite, clip, accumulation, monkeypatch
):
    """docs/semantics.md: the user's own exception from backward surfaces as itself on either
    path (the check's FloatingPointError, which comes at the end of backward, never replaces
    it), and a gradient found not finite before it is not lost: the events name it (eager
    "skip": the blocks skipped, counted), alike on both paths; nothing else differs, and the
    next step trains on both."""
    on_device = _raised_inside_backward(nonfinite, clip, accumulation)
    with monkeypatch.context() as m:
        _host_path(m)
        on_host = _raised_inside_backward(nonfinite, clip, accumulation)
    assert on_device[0] and not on_host[0]
    assert on_device[1] is _UsersOwn and on_host[1] is _UsersOwn
    assert on_device[2] == on_host[2]
    assert on_device[3] == on_host[3] == (1 if nonfinite == "skip" and clip is None and accumulation == 1 else 0)
    if clip is None:  # the check ran during backward (with clipping it is the global norm at step())
        assert len(on_host[2]) == 1 and "layers.3.fc1.lora_a" in on_host[2][0]
    else:
        assert on_host[2] == []
    for k in on_host[4]:
        assert torch.equal(on_device[4][k], on_host[4][k]), k
        assert torch.equal(on_device[5][k], on_host[5][k]), k
        assert torch.isfinite(on_device[5][k]).all(), k


def _named_over_two_passes(nonfinite: str, clip, end: str) -> tuple:
    """Two backward passes of an accumulation window, a NaN gradient of block 1 in the first
    and of block 2 in the second. `end`: "last pass" (accumulation_steps=2, then step()), or
    of a window of 3 ended early by "step" or dropped by "zero_grad". (Whether in device
    state, the parameter named, skipped_steps.)"""
    model, opt, batch, loss_fn = _wrapped(nonfinite, clip, 2 if end == "last pass" else 3)
    params = dict(model.named_parameters())
    passes = [0]
    for name, bad_pass in (("layers.1.fc1.lora_a", 0), ("layers.2.fc1.lora_a", 1)):
        params[name].register_hook(lambda g, bad_pass=bad_pass: g * float("nan") if passes[0] == bad_pass else g)
    named = None
    try:
        for i in range(2):
            passes[0] = i
            loss_fn(model, batch(i, "cpu")).backward()
        if end != "zero_grad":
            opt.step()
    except FloatingPointError as e:
        named = re.search(r"the gradient of (\S+) is not finite", str(e)).group(1)
    opt.zero_grad()
    found = re.findall(r"the gradient of (\S+) is not finite: skipped", trainstream.memory_report(model)["events"])
    if nonfinite == "skip":
        assert named is None and len(found) == 1
        named = found[0]
    return bool(model._trainstream_engine.plan.device_state), named, opt.skipped_steps


# (nonfinite, max_grad_norm, how the window ends); "raise" under clipping checks at step() only,
# so a window zero_grad() drops is dropped unchecked there, and is not a case.
TWO_PASSES = [
    (nonfinite, clip, end)
    for nonfinite in ("skip", "raise")
    for clip in (None, 0.05)
    for end in ("last pass", "step", "zero_grad")
    if not (nonfinite == "raise" and clip is not None and end == "zero_grad")
]


@pytest.mark.parametrize(("nonfinite", "clip", "end"), TWO_PASSES)
def test_gradients_not_finite_in_two_passes_of_a_window_name_the_same_parameter(nonfinite, clip, end, monkeypatch):
    """docs/semantics.md: "raise" without clipping raises at the first pass that has one (block
    1's); "skip" (and "raise" under clipping, at step()) names by the window's sums, in its
    last pass's order: block 2's, reached before block 1's. Alike on both paths."""
    on_device = _named_over_two_passes(nonfinite, clip, end)
    with monkeypatch.context() as m:
        _host_path(m)
        on_host = _named_over_two_passes(nonfinite, clip, end)
    first = "layers.1.fc1.lora_a" if nonfinite == "raise" and clip is None else "layers.2.fc1.lora_a"
    skipped = 1 if nonfinite == "skip" else 0
    assert on_device == (True, first, skipped)
    assert on_host == (False, first, skipped)


# -- on a GPU: device state's lazy check (marks read once its kernels have run) and the host
# path's asynchronous gradient copies name and raise as on the CPU path ------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("where", list(TWO_NOT_FINITE))
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no clip", "clip"])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_gpu_two_gradients_not_finite_name_the_first_in_backwards_order_on_both_paths(
    nonfinite, clip, accumulation, where, monkeypatch
):
    bad, first = TWO_NOT_FINITE[where]
    on_device = _named(nonfinite, clip, accumulation, bad, device="cuda")
    with monkeypatch.context() as m:
        _host_path(m)
        on_host = _named(nonfinite, clip, accumulation, bad, device="cuda")
    assert on_device == (True, first)
    assert on_host == (False, first)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_gpu_an_exception_inside_backward_after_a_nonfinite_gradient_surfaces_as_itself(
    nonfinite, accumulation, monkeypatch
):
    on_device = _raised_inside_backward(nonfinite, None, accumulation, "cuda")
    with monkeypatch.context() as m:
        _host_path(m)
        on_host = _raised_inside_backward(nonfinite, None, accumulation, "cuda")
    assert on_device[:4] == (True, _UsersOwn, on_host[2], on_host[3])
    assert on_host[1] is _UsersOwn
    assert len(on_host[2]) == 1 and "layers.3.fc1.lora_a" in on_host[2][0]
    assert all(torch.isfinite(v).all() for v in on_device[5].values())
