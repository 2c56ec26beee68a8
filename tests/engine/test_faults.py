"""Fault injection: an exception raised at each point where the engine runs inside a training
step (the model's forward pre- and post-hooks, a block's entry and exit, each gradient hook,
the end of backward, the update, the lander's push). Afterwards every parameter's weights,
moments and step count agree (a unit is updated whole or not at all; with held updates,
nothing of the failed step is applied), training goes on, and nothing is left behind: the
engine, its lander thread and, on a GPU, its device memory go with the model."""

import threading
import weakref

import pytest
import torch
from helpers import PAGED, RESIDENT, collected, cuda_bytes_held, live_cuda_tensors
from models import tiny_gpt

import trainstream
from trainstream.engine.engine import Engine
from trainstream.engine.grads import GradStreamer
from trainstream.engine.params import WeightPager
from trainstream.engine.updates import Updater


class Injected(Exception):
    """The fault the tests raise."""


class Fault:
    """Replace `owner.name` so that its `at`-th call from now (0: the first) raises Injected
    (only on a thread named `thread`, if given); every other call goes through."""

    def __init__(self, monkeypatch, owner, name: str, at: int = 0, thread: str | None = None):
        self.calls, self.fired, self.armed = 0, False, False
        real = getattr(owner, name)
        fault = self

        def injected(*args, **kwargs):
            if fault.armed and not fault.fired and (thread is None or threading.current_thread().name == thread):
                if fault.calls == at:
                    fault.fired = True
                    raise Injected(f"{owner.__name__}.{name}")
                fault.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, injected)


# (owner, method, call index, thread): every point a step runs engine code at.
POINTS = {
    "forward pre-hook": (Engine, "before_forward", 0, None),
    "forward post-hook": (Engine, "after_forward", 0, None),
    "block entry": (Engine, "enter_block", 2, None),
    "block exit": (Engine, "exit_block", 1, None),
    "first gradient": (GradStreamer, "on_grad", 0, None),
    "a block's gradient": (GradStreamer, "on_grad", 12, None),
    "last gradient": (GradStreamer, "on_grad", 35, None),  # tiny_gpt has 36 trainable tensors
    "end of backward": (GradStreamer, "end_pass", 0, None),
    "first update": (Updater, "queue", 0, None),
    "a later update": (Updater, "queue", 3, None),
    "the lander": (WeightPager, "push", 0, "trainstream-lander"),
}


def _step(model, opt, batch, loss_fn, i, device="cpu"):
    loss = loss_fn(model, batch(i, device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _snapshot(model, opt) -> dict:
    """name -> (weights, exp_avg or None, step count), host copies, every update finished."""
    opt.synchronize()
    state = opt.state_dict()["state"]
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        st = state.get(i, {})
        avg = st.get("exp_avg")
        out[name] = (
            p.detach().to("cpu", copy=True),
            None if avg is None else avg.to("cpu", copy=True),
            int(st.get("step", 0)),
        )
    return out


def _assert_consistent(before: dict, after: dict, units, held: bool) -> set:
    """Each parameter moved one step with its weights and moments, or none with neither;
    a unit's parameters all alike; with held updates, none moved. Returns the names moved."""
    moved = set()
    for name, (w0, m0, t0) in before.items():
        w1, m1, t1 = after[name]
        assert t1 - t0 in (0, 1), name
        if t1 == t0:
            assert torch.equal(w1, w0), f"{name}: weights changed without a step"
            assert (m1 is None and m0 is None) or torch.equal(m1, m0), f"{name}: moments changed without a step"
        else:
            assert not torch.equal(w1, w0), f"{name}: stepped without an update"
            assert m0 is None or not torch.equal(m1, m0), f"{name}: stepped without its moments"
            moved.add(name)
    for unit in units:
        names = {s.name for s in unit.trainable}
        assert names <= moved or not (names & moved), f"{unit.name} was updated in part: {sorted(names & moved)}"
    if held:
        assert not moved, sorted(moved)
    return moved


def _run_with_fault(monkeypatch, point: str, base: dict, options: dict, device: str = "cpu"):
    owner, name, at, thread = POINTS[point]
    fault = Fault(monkeypatch, owner, name, at, thread)
    if thread is not None:
        # Only the lander pushes finished updates: step() would otherwise push those done by
        # then itself, on the CPU path all of them.
        monkeypatch.setattr(WeightPager, "land_updates", lambda self: self.lander.raise_error())
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = trainstream.wrap(model, opt, device=device, offload=True, **base, **options)
    engine = model._trainstream_engine
    _step(model, opt, batch, loss_fn, 0, device)
    before = _snapshot(model, opt)
    fault.armed = True
    try:
        _step(model, opt, batch, loss_fn, 1, device)
        if thread is not None:  # the lander works after step() returns: the next guard reports it
            assert collected(lambda: fault.fired)
            _step(model, opt, batch, loss_fn, 2, device)
    except Injected:
        pass
    except RuntimeError as e:  # the lander's failure, as the training thread reports it
        assert isinstance(e.__cause__, Injected), e
    assert fault.fired, f"{point}: the fault never ran"
    opt.zero_grad()
    after = _snapshot(model, opt)
    # Held updates: a fault before step() queues them applies none. One in step()'s queuing
    # (the update itself) leaves the units queued before it updated, each whole.
    held = options.get("max_grad_norm") is not None and owner is not Updater and thread is None
    _assert_consistent(before, after, engine.units, held)
    if thread is not None:  # the failed push is done by the next guard: the device has the host's weights
        for unit in engine.units:
            if not unit.paged:
                for s in unit.trainable:
                    assert torch.equal(s.param.detach().float().cpu(), s.master), s.name
    # Training goes on: every parameter steps once per step, and the loss stays finite.
    losses = [_step(model, opt, batch, loss_fn, 3 + i, device) for i in range(3)]
    final = _snapshot(model, opt)
    for n in after:
        assert final[n][2] == after[n][2] + 3, n
    assert all(torch.isfinite(torch.tensor(losses)))
    return model, opt, engine


def _landers() -> list:
    return [t for t in threading.enumerate() if t.name == "trainstream-lander" and t.is_alive()]


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize(
    "base, options",
    [(RESIDENT, {}), (PAGED, {}), (RESIDENT, dict(max_grad_norm=1.0))],
    ids=["resident", "paged", "clip"],
)
def test_a_fault_at_each_hook_point_leaves_a_consistent_run(monkeypatch, point, base, options):
    landers = _landers()
    model, opt, engine = _run_with_fault(monkeypatch, point, base, options)
    refs = [weakref.ref(model), weakref.ref(engine), weakref.ref(opt)]
    del model, opt, engine
    assert collected(lambda: all(r() is None for r in refs)), [r() is None for r in refs]
    assert collected(lambda: len(_landers()) <= len(landers)), _landers()


class Interrupt(torch.autograd.Function):
    """Identity forward; its backward raises KeyboardInterrupt (a user's Ctrl-C mid-backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise KeyboardInterrupt


def test_a_keyboard_interrupt_in_backward_with_eager_updates_says_which_units_were_updated():
    """A module whose backward raises KeyboardInterrupt halfway through the blocks: the
    blocks above it were updated whole, the rest not at all, and the events say which."""

    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **RESIDENT)
    engine = model._trainstream_engine
    before = _snapshot(model, opt)
    handle = model.layers[1].register_forward_hook(lambda m, args, out: Interrupt.apply(out))
    with pytest.raises(KeyboardInterrupt):
        loss_fn(model, batch(0, "cpu")).backward()
    handle.remove()
    opt.zero_grad()
    moved = _assert_consistent(before, _snapshot(model, opt), engine.units, held=False)
    updated = {u.name for u in engine.units if {s.name for s in u.trainable} <= moved}
    assert {"block 2", "block 3"} <= updated and not {"block 0", "block 1"} & updated
    events = trainstream.memory_report(model)["events"]
    assert "a backward pass raised" in events
    assert "updates queued before it stand, for" in events and "'block 3'" in events
    _step(model, opt, batch, loss_fn, 1)


@pytest.mark.parametrize("options", [dict(max_grad_norm=1.0), dict(accumulation_steps=2)], ids=["clip", "accumulation"])
def test_a_keyboard_interrupt_in_backward_with_held_updates_applies_nothing(options):
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **RESIDENT, **options)
    engine = model._trainstream_engine
    n = options.get("accumulation_steps", 1)
    before = _snapshot(model, opt)
    for micro in range(n - 1):
        loss_fn(model, batch(micro, "cpu")).backward()
    handle = model.layers[1].register_forward_hook(lambda m, args, out: Interrupt.apply(out))
    with pytest.raises(KeyboardInterrupt):
        loss_fn(model, batch(n, "cpu")).backward()
    handle.remove()
    opt.zero_grad()
    _assert_consistent(before, _snapshot(model, opt), engine.units, held=True)
    assert "no unit was updated from them" in trainstream.memory_report(model)["events"]
    for micro in range(n):
        loss_fn(model, batch(10 + micro, "cpu")).backward()
    opt.step()
    assert all(t == 1 for *_, t in _snapshot(model, opt).values())


# optimizer_mode="gpu" updates resident weights in place on the device: no lander pushes them.
_GPU_POINTS = [
    pytest.param(point, base, options, id=f"{mode}-{point}")
    for mode, base, options in (
        ("resident", RESIDENT, {}),
        ("paged", PAGED, {}),
        ("gpu-mode", RESIDENT, dict(optimizer_mode="gpu")),
    )
    for point in POINTS
    if not (mode == "gpu-mode" and point == "the lander")
]


@pytest.mark.gpu
@pytest.mark.parametrize("point, base, options", _GPU_POINTS)
def test_gpu_a_fault_at_each_hook_point_leaks_no_device_memory(monkeypatch, point, base, options):
    before = cuda_bytes_held()
    model, opt, engine = _run_with_fault(monkeypatch, point, base, options, device="cuda")
    del model, opt, engine
    freed = collected(lambda: cuda_bytes_held() - before < (1 << 20))
    assert freed, (before, cuda_bytes_held(), live_cuda_tensors())
