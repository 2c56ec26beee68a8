"""wrap(nonfinite=...): a gradient that is not finite never reaches the weights ("skip", the
default), raises FloatingPointError naming its parameter ("raise"), or is applied as torch
applies it ("ignore"). Checked against torch.optim.AdamW on the same batches."""

import copy
import re

import pytest
import torch
from helpers import GPU_MODE, PAGED, RESIDENT, assert_same_bits, max_diff
from models import tiny_mlp

import trainstream

LAYERS = 6  # tiny_mlp: blocks "block 0" .. "block 5", one weight each ("0.weight" ...)
BAD = 3  # the block whose gradient gets a NaN


def _poison(model, block: int, value: float = float("nan")):
    """A hook that puts `value` into one element of block `block`'s weight gradient."""

    def hook(g):
        g = g.clone()
        g.view(-1)[0] = value
        return g

    return model[block].weight.register_hook(hook)


def _host_state(model) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _steps(opt) -> dict:
    """Parameter index -> its AdamW step count, for those updated at least once
    (optimizer_mode="gpu" holds a state at step 0 for every parameter from wrap() on)."""
    return {i: int(st["step"]) for i, st in opt.state_dict()["state"].items() if int(st.get("step", 0))}


def _wrapped(device="cpu", base=RESIDENT, **options):
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_mlp(layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    model, opt = trainstream.wrap(model, opt, device=device, offload=True, **base, **options)
    return model, opt, batch, loss_fn


def _stock_one_step(batch_index: int, updated: list, device="cpu"):
    """torch AdamW after one step on batch `batch_index` where only the blocks in `updated`
    are stepped (their gradients are those of the full backward)."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_mlp(layers=LAYERS)
    model = model.to(device)
    params = [model[i].weight for i in updated]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=False)
    loss_fn(model, batch(batch_index, device)).backward()
    opt.step()
    return _host_state(model)


@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize(
    "options",
    [{}, dict(max_grad_norm=1.0), dict(accumulation_steps=2), dict(accumulation_steps=2, max_grad_norm=1.0)],
    ids=["eager", "clip", "accumulation", "accumulation+clip"],
)
def test_a_nan_loss_then_zero_grad_leaves_every_weight_as_it_was(base, options):
    """Also where the window is held (clipping; accumulation, dropped after its first
    pass): the step is counted as skipped and the events name the parameter."""
    model, opt, batch, loss_fn = _wrapped(base=base, **options)
    before = _host_state(model)
    (loss_fn(model, batch(0, "cpu")) * float("nan")).backward()
    opt.zero_grad()
    assert_same_bits((None, _host_state(model)), (None, before))
    assert _steps(opt) == {}
    assert opt.skipped_steps == 1
    assert re.search(r"the gradient of \d\.weight is not finite", trainstream.memory_report(model)["events"])
    # The next step trains normally.
    loss_fn(model, batch(1, "cpu")).backward()
    opt.step()
    opt.zero_grad()
    after = _host_state(model)
    assert all(torch.isfinite(v).all() and not torch.equal(v, before[k]) for k, v in after.items())


def test_a_nan_loss_is_counted_and_reported():
    model, opt, batch, loss_fn = _wrapped()
    (loss_fn(model, batch(0, "cpu")) * float("nan")).backward()
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1
    events = trainstream.memory_report(model)["events"]
    assert "the gradient of 5.weight is not finite" in events and "nonfinite='skip'" in events
    loss_fn(model, batch(1, "cpu")).backward()
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1
    assert set(_steps(opt).values()) == {1}


# (device, optimizer mode): the CPU path runs optimizer_mode="gpu" with the host AdamW standing in.
DEVICE_MODES = [
    pytest.param("cpu", {}, id="cpu-host"),
    pytest.param("cpu", GPU_MODE, id="cpu-gpu_mode"),
    pytest.param("cuda", {}, id="cuda-host", marks=pytest.mark.gpu),
    pytest.param("cuda", GPU_MODE, id="cuda-gpu_mode", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device, mode", DEVICE_MODES)
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_eager_updates_stop_at_the_block_with_the_nan(device, mode, base):
    """Updates queued as blocks land: the blocks after the bad one in backward order
    (5, 4) are updated, as torch's AdamW updates them; it and the blocks before it in the
    model are not touched."""
    model, opt, batch, loss_fn = _wrapped(device=device, base=base, **mode)
    before = _host_state(model)
    handle = _poison(model, BAD)
    loss_fn(model, batch(0, device)).backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    after = _host_state(model)
    updated = list(range(BAD + 1, LAYERS))
    stock = _stock_one_step(0, updated, device=device)
    for i in range(LAYERS):
        key = f"{i}.weight"
        if i in updated:
            assert max_diff({key: after[key]}, {key: stock[key]}) < (1e-6 if device == "cpu" else 1e-5), key
        else:
            assert torch.equal(after[key], before[key]), key
    assert _steps(opt) == {i: 1 for i in updated}
    assert opt.skipped_steps == 1
    events = trainstream.memory_report(model)["events"]
    assert "skipped the updates of ['block 3', 'block 2', 'block 1', 'block 0']" in events


@pytest.mark.parametrize(
    "options",
    [dict(max_grad_norm=1.0), dict(accumulation_steps=2), dict(accumulation_steps=2, max_grad_norm=1.0)],
    ids=["clip", "accumulation", "accumulation+clip"],
)
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_held_updates_skip_the_whole_step_and_training_goes_on_as_if_it_never_came(base, options):
    """A NaN in one block's gradient, in one micro-batch of one window: nothing of that
    window is applied; the run then holds the bits of a run that never saw that window."""
    n = options.get("accumulation_steps", 1)

    def run(bad_window: bool):
        model, opt, batch, loss_fn = _wrapped(base=base, **options)
        windows = [0, 1, "bad", 2, 3] if bad_window else [0, 1, 2, 3]
        snapshots = []
        for w in windows:
            for micro in range(n):
                handle = _poison(model, BAD) if w == "bad" and micro == n - 1 else None
                index = 100 if w == "bad" else w * n + micro
                (loss_fn(model, batch(index, "cpu")) / n).backward()
                if handle is not None:
                    handle.remove()
            before = _host_state(model)
            opt.step()
            opt.zero_grad()
            snapshots.append((w, before, _host_state(model), _steps(opt)))
        return model, opt, snapshots

    model, opt, snapshots = run(True)
    w, before, after, steps = snapshots[2]
    assert w == "bad"
    assert_same_bits((None, after), (None, before))
    assert steps == {i: 2 for i in range(LAYERS)}  # two windows were applied before it
    assert opt.skipped_steps == 1
    clean = run(False)[2]
    assert_same_bits((None, snapshots[-1][2]), (None, clean[-1][2]))
    assert snapshots[-1][3] == clean[-1][3]


@pytest.mark.parametrize("options", [{}, dict(max_grad_norm=1.0), dict(accumulation_steps=2)])
def test_raise_names_the_parameter_and_training_goes_on(options):
    model, opt, batch, loss_fn = _wrapped(nonfinite="raise", **options)
    before = _host_state(model)
    handle = _poison(model, BAD)
    with pytest.raises(FloatingPointError, match=r"3\.weight"):
        loss_fn(model, batch(0, "cpu")).backward()
        opt.step()
    handle.remove()
    opt.zero_grad()
    after = _host_state(model)
    for i in range(BAD + 1):
        assert torch.equal(after[f"{i}.weight"], before[f"{i}.weight"])
    for i in range(3):
        loss_fn(model, batch(i + 1, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(v).all() for v in _host_state(model).values())
    assert opt.skipped_steps == 0


def test_ignore_applies_the_nan_as_torch_does():
    model, opt, batch, loss_fn = _wrapped(nonfinite="ignore")
    handle = _poison(model, BAD)
    loss_fn(model, batch(0, "cpu")).backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    wrapped = _host_state(model)

    torch.manual_seed(0)
    stock_model, batch, loss_fn = tiny_mlp(layers=LAYERS)
    stock_opt = torch.optim.AdamW(stock_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    handle = _poison(stock_model, BAD)
    loss_fn(stock_model, batch(0, "cpu")).backward()
    stock_opt.step()
    stock = _host_state(stock_model)
    for k in stock:
        assert torch.equal(torch.isnan(wrapped[k]), torch.isnan(stock[k])), k
        finite = ~torch.isnan(stock[k])
        assert (wrapped[k][finite] - stock[k][finite]).abs().max() < 1e-6, k
    assert torch.isnan(wrapped[f"{BAD}.weight"]).any()
    assert opt.skipped_steps == 0


def test_a_huge_finite_gradient_is_not_skipped():
    """A finite gradient whose square overflows fp32: the check looks at the gradient
    itself, so the update runs, as torch's does."""
    model, opt, batch, loss_fn = _wrapped()
    handle = _poison(model, BAD, 1e30)
    loss_fn(model, batch(0, "cpu")).backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 0
    assert _steps(opt) == {i: 1 for i in range(LAYERS)}
    torch.manual_seed(0)
    stock_model, batch, loss_fn = tiny_mlp(layers=LAYERS)
    stock_opt = torch.optim.AdamW(stock_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    _poison(stock_model, BAD, 1e30)
    loss_fn(stock_model, batch(0, "cpu")).backward()
    stock_opt.step()
    assert max_diff(_host_state(model), _host_state(stock_model)) < 1e-6


def test_accumulation_dropped_by_zero_grad_after_a_nan_names_it_and_counts_the_window_once():
    """A NaN in the first pass of a two-pass window, then zero_grad() before the second:
    reported (the parameter, the units) and counted once; the next window trains as torch
    does from the same weights."""
    model, opt, batch, loss_fn = _wrapped(accumulation_steps=2)
    handle = _poison(model, BAD)
    (loss_fn(model, batch(0, "cpu")) / 2).backward()
    handle.remove()
    opt.zero_grad()
    events = trainstream.memory_report(model)["events"]
    assert f"the gradient of {BAD}.weight is not finite" in events
    assert "skipped the updates of ['block 0', 'block 1', 'block 2', 'block 3', 'block 4', 'block 5']" in events
    assert opt.skipped_steps == 1
    for micro in range(2):
        (loss_fn(model, batch(1 + micro, "cpu")) / 2).backward()
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1
    assert _steps(opt) == {i: 1 for i in range(LAYERS)}

    torch.manual_seed(0)
    stock_model, batch, loss_fn = tiny_mlp(layers=LAYERS)
    stock_opt = torch.optim.AdamW(stock_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for micro in range(2):
        (loss_fn(stock_model, batch(1 + micro, "cpu")) / 2).backward()
    stock_opt.step()
    assert max_diff(_host_state(model), _host_state(stock_model)) < 1e-6


def test_clipping_dropped_by_zero_grad_after_an_overflowing_norm_is_not_a_skip():
    """A huge finite gradient overflows the global norm, not the gradient: zero_grad()
    dropping that window reports nothing, as step() would have applied it."""
    model, opt, batch, loss_fn = _wrapped(max_grad_norm=1.0)
    handle = _poison(model, BAD, 1e30)
    loss_fn(model, batch(0, "cpu")).backward()
    handle.remove()
    opt.zero_grad()
    assert opt.skipped_steps == 0
    assert "not finite" not in trainstream.memory_report(model)["events"]


class _UnusedParam(torch.nn.Module):
    """A block whose second parameter no forward uses: its unit never completes in a pass
    and is handed on at the pass's end, with the other incomplete ones."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim, bias=False)
        self.unused = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("bad", [3, 8, 12])
def test_eager_skip_of_incomplete_units_follows_backward_order(bad):
    """Every unit incomplete (an unused parameter each), so all are handed on at the end of
    the pass: the bad block and those before it in the model (after it in backward) are
    skipped, those after it updated as torch updates them. The hand-on order used to be a
    set's, so which were skipped changed from run to run."""
    blocks = 16

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[_UnusedParam(16) for _ in range(blocks)])
        return model, torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    model, x = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, **RESIDENT)
    before = _host_state(model)
    handle = model[bad].lin.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    model(x).pow(2).mean().backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    events = trainstream.memory_report(model)["events"]
    assert f"skipped the updates of {[f'block {i}' for i in range(bad, -1, -1)]}" in events

    stock, x = build()
    updated = [stock[i].lin.weight for i in range(bad + 1, blocks)]
    stock_opt = torch.optim.AdamW(updated, lr=1e-2, weight_decay=0.01, foreach=False)
    stock(x).pow(2).mean().backward()
    stock_opt.step()
    after, expected = _host_state(model), _host_state(stock)
    for i in range(blocks):
        key = f"{i}.lin.weight"
        if i > bad:
            assert max_diff({key: after[key]}, {key: expected[key]}) < 1e-6, key
        else:
            assert torch.equal(after[key], before[key]), key


def test_the_check_takes_no_host_memory_per_batch(monkeypatch):
    """The squared norms land in buffers allocated at wrap(), not in a new (on a GPU,
    pinned) one per batch of gradients."""
    model, opt, batch, loss_fn = _wrapped()
    backend = model._trainstream_engine.backend
    calls = []
    host_empty = backend.host_empty
    monkeypatch.setattr(backend, "host_empty", lambda *a, **k: calls.append(a) or host_empty(*a, **k))
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert calls == []


def test_each_batch_of_a_unit_keeps_its_own_squared_norms(monkeypatch):
    """One batch per gradient (every gradient counts as large), so a unit's squared norms
    of one pass arrive in eight batches: a NaN in any of its parameters, whichever batch
    carries it, is found and named; the first pass of the same run was clean."""
    from models import tiny_gpt

    from trainstream.engine.grads import GradStreamer

    monkeypatch.setattr(GradStreamer, "SMALL_GRAD_BYTES", 0)
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt(layers=2)
    model, opt = trainstream.wrap(model, None, device="cpu", offload=True, **RESIDENT)
    names = [n for n, _ in model.layers[1].named_parameters()]
    assert len(names) == 8
    for i, name in enumerate(names):
        loss_fn(model, batch(2 * i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
        handle = model.layers[1].get_parameter(name).register_hook(lambda g: g * float("nan"))
        loss_fn(model, batch(2 * i + 1, "cpu")).backward()
        handle.remove()
        opt.step()
        opt.zero_grad()
        assert opt.skipped_steps == i + 1, name
        assert f"the gradient of layers.1.{name} is not finite" in trainstream.memory_report(model)["events"]


def test_nonfinite_accepts_only_its_values():
    with pytest.raises(ValueError, match=r"'nonfinite'.*'skip', 'raise', 'ignore'"):
        _wrapped(nonfinite="warn")


# -- optimizer_mode="gpu" with the gradients on the device: the check decided on the device ---


def _flags_at_each_update(monkeypatch) -> list:
    """(unit name, the skip flag's value when its kernels ran) for every device update."""
    from trainstream.engine.optimizer import StreamedAdamW

    seen = []
    queue = StreamedAdamW.queue_on_device

    def recording(self, device, slots, *args, skip_flag=None, **kwargs):
        if len(args) > 6:  # skip_flag passed by position
            args, skip_flag = args[:6], args[6]
        seen.append((slots[0].unit.name, None if skip_flag is None else int(skip_flag)))
        return queue(self, device, slots, *args, skip_flag=skip_flag, **kwargs)

    monkeypatch.setattr(StreamedAdamW, "queue_on_device", recording)
    return seen


@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_gpu_mode_queues_every_update_at_once_and_the_device_flag_skips(monkeypatch, base):
    """No host read decides: every unit's update is queued as it lands, behind the device
    flag, which the bad block's check sets and which stays set for the rest of the pass."""
    seen = _flags_at_each_update(monkeypatch)
    model, opt, batch, loss_fn = _wrapped(base=base, **GPU_MODE)
    handle = _poison(model, BAD)
    loss_fn(model, batch(0, "cpu")).backward()
    handle.remove()
    assert seen == [(f"block {i}", int(i <= BAD)) for i in range(LAYERS - 1, -1, -1)]
    opt.step()
    opt.zero_grad()
    seen.clear()
    loss_fn(model, batch(1, "cpu")).backward()  # a new window: the flag is clear again
    assert seen == [(f"block {i}", 0) for i in range(LAYERS - 1, -1, -1)]


def test_gpu_mode_with_ignore_has_no_device_check(monkeypatch):
    seen = _flags_at_each_update(monkeypatch)
    model, opt, batch, loss_fn = _wrapped(nonfinite="ignore", **GPU_MODE)
    loss_fn(model, batch(0, "cpu")).backward()
    assert seen and all(flag is None for _, flag in seen)


class _InFlight:
    """An event whose work the device has not reached: query() says so until it is waited for."""

    def __init__(self):
        self.passed = False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True


def _bad_step_then_a_clean_one(model, opt, batch, loss_fn):
    handle = _poison(model, BAD)
    loss_fn(model, batch(0, "cpu")).backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    yield
    loss_fn(model, batch(1, "cpu")).backward()
    opt.step()
    opt.zero_grad()


def test_gpu_mode_a_skip_learned_after_the_step_is_taken_back_before_the_next_update(monkeypatch):
    """The device's updates still in flight when step() returns (as on a GPU): the host has
    read nothing yet. The skipped blocks' step counts go back before their next update is
    queued, so the run holds the bits of the host optimizer's run, which skips at once (and
    is torch's with those blocks not stepped in the bad step); reading
    optimizer.skipped_steps waits and counts it, and the events name the step it was."""
    model, opt, batch, loss_fn = _wrapped(**GPU_MODE)
    engine = model._trainstream_engine
    monkeypatch.setattr(engine.backend, "record", lambda stream=None: _InFlight())
    run = _bad_step_then_a_clean_one(model, opt, batch, loss_fn)
    next(run)
    assert len(engine.grads.device_check.pending()) == LAYERS  # nothing read on the host yet
    assert opt._skipped_steps == 0
    next(run, None)
    assert opt.skipped_steps == 1
    events = trainstream.memory_report(model)["events"]
    assert "step 1: the gradient of 3.weight is not finite: skipped the updates of " in events
    assert "['block 3', 'block 2', 'block 1', 'block 0']" in events
    assert _steps(opt) == {i: (2 if i > BAD else 1) for i in range(LAYERS)}

    host_model, host_opt, batch, loss_fn = _wrapped()
    for _ in _bad_step_then_a_clean_one(host_model, host_opt, batch, loss_fn):
        pass
    assert_same_bits((None, _host_state(model)), (None, _host_state(host_model)))

    torch.manual_seed(0)
    stock_model, batch, loss_fn = tiny_mlp(layers=LAYERS)
    stock_opt = torch.optim.AdamW(stock_model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    loss_fn(stock_model, batch(0, "cpu")).backward()
    for i in range(BAD + 1):
        stock_model[i].weight.grad = None  # torch steps only the parameters that have a gradient
    stock_opt.step()
    stock_opt.zero_grad()
    loss_fn(stock_model, batch(1, "cpu")).backward()
    stock_opt.step()
    # A first AdamW step is g / (|g| + eps): where |g| is tiny, rounding in g shows (about 1e-5 here).
    assert max_diff(_host_state(model), _host_state(stock_model)) < 1e-4


@pytest.mark.parametrize("read", ["skipped_steps", "memory_report", "synchronize", "state_dict"])
def test_gpu_mode_each_reader_of_the_outcome_waits_for_it(monkeypatch, read):
    """The updates still in flight after step(): each of these waits for them, and then the
    count, the events and the step counts are those of the step."""
    model, opt, batch, loss_fn = _wrapped(**GPU_MODE)
    monkeypatch.setattr(model._trainstream_engine.backend, "record", lambda stream=None: _InFlight())
    next(_bad_step_then_a_clean_one(model, opt, batch, loss_fn))
    assert opt._skipped_steps == 0
    {
        "skipped_steps": lambda: opt.skipped_steps,
        "memory_report": lambda: trainstream.memory_report(model),
        "synchronize": opt.synchronize,
        "state_dict": opt.state_dict,
    }[read]()
    assert opt._skipped_steps == 1
    assert "step 1: the gradient of 3.weight is not finite" in trainstream.memory_report(model)["events"]
    assert _steps(opt) == {i: 1 for i in range(BAD + 1, LAYERS)}


def test_gpu_mode_raise_at_the_end_of_backward_updates_nothing_from_the_bad_gradient():
    model, opt, batch, loss_fn = _wrapped(nonfinite="raise", **GPU_MODE)
    before = _host_state(model)
    handle = _poison(model, BAD)
    with pytest.raises(FloatingPointError, match=r"the gradient of 3\.weight is not finite"):
        loss_fn(model, batch(0, "cpu")).backward()
    handle.remove()
    opt.zero_grad()
    after = _host_state(model)
    for i in range(LAYERS):
        assert torch.equal(after[f"{i}.weight"], before[f"{i}.weight"]) == (i <= BAD), i
    assert _steps(opt) == {i: 1 for i in range(BAD + 1, LAYERS)}  # the skipped ones' counts went back
    assert opt.skipped_steps == 0
    for i in range(2):
        loss_fn(model, batch(i + 1, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(v).all() for v in _host_state(model).values())
    assert _steps(opt) == {i: (3 if i > BAD else 2) for i in range(LAYERS)}


# -- on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [{}, GPU_MODE], ids=["host", "gpu"])
@pytest.mark.parametrize("options", [{}, dict(max_grad_norm=1.0), dict(accumulation_steps=2)])
def test_gpu_a_nan_loss_then_training_goes_on(mode, options):
    model, opt, batch, loss_fn = _wrapped(device="cuda", **mode, **options)
    before = _host_state(model)
    (loss_fn(model, batch(0, "cuda")) * float("nan")).backward()
    opt.zero_grad()
    assert_same_bits((None, _host_state(model)), (None, before))
    n = options.get("accumulation_steps", 1)
    for i in range(2):
        for micro in range(n):
            (loss_fn(model, batch(1 + i * n + micro, "cuda")) / n).backward()
        opt.step()
        opt.zero_grad()
    after = _host_state(model)
    assert all(torch.isfinite(v).all() and not torch.equal(v, before[k]) for k, v in after.items())
    assert opt.skipped_steps == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [{}, GPU_MODE], ids=["host", "gpu"])
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_gpu_a_nan_after_clean_steps_is_found(mode, base):
    """The check's host buffers are reused every step: three clean steps, then a NaN in
    block BAD's gradient is still found there (eager updates stop at it)."""
    model, opt, batch, loss_fn = _wrapped(device="cuda", base=base, **mode)
    for i in range(3):
        loss_fn(model, batch(i, "cuda")).backward()
        opt.step()
        opt.zero_grad()
    assert opt.skipped_steps == 0
    before = _host_state(model)
    handle = _poison(model, BAD)
    loss_fn(model, batch(3, "cuda")).backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    after = _host_state(model)
    assert opt.skipped_steps == 1
    assert f"the gradient of {BAD}.weight is not finite" in trainstream.memory_report(model)["events"]
    assert all(torch.equal(after[f"{i}.weight"], before[f"{i}.weight"]) for i in range(BAD + 1))
    assert not any(torch.equal(after[f"{i}.weight"], before[f"{i}.weight"]) for i in range(BAD + 1, LAYERS))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [{}, GPU_MODE], ids=["host", "gpu"])
def test_gpu_raise_names_the_parameter(mode):
    model, opt, batch, loss_fn = _wrapped(device="cuda", nonfinite="raise", **mode)
    handle = _poison(model, BAD)
    with pytest.raises(FloatingPointError, match=r"3\.weight"):
        loss_fn(model, batch(0, "cuda")).backward()
    handle.remove()
    opt.zero_grad()
    loss_fn(model, batch(1, "cuda")).backward()
    opt.step()
    assert all(torch.isfinite(v).all() for v in _host_state(model).values())


@pytest.mark.gpu
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("copied", [True, False], ids=["copied", "mapped"])
def test_gpu_mode_a_nan_skips_its_block_and_every_later_one_bit_for_bit(base, moment_dtype, copied, monkeypatch):
    """optimizer_mode="gpu", the check on the device: after a NaN in block BAD's gradient,
    it and the blocks after it in backward keep their weights, moments (copied through VRAM
    and home, or mapped) and step counts bit for bit; the blocks before it were updated; the
    next steps train every block."""
    from trainstream.engine.moments import MomentStager

    monkeypatch.setattr(MomentStager, "room", lambda self: None if copied else 0)  # None: no limit
    model, opt, batch, loss_fn = _wrapped(device="cuda", base=base, moment_dtype=moment_dtype, **GPU_MODE)
    loss_fn(model, batch(0, "cuda")).backward()
    opt.step()
    opt.zero_grad()
    # state_dict() holds the live moment tensors (as torch's does): copies, to compare later
    weights, state = _host_state(model), copy.deepcopy(opt.state_dict()["state"])
    handle = _poison(model, BAD)
    loss_fn(model, batch(1, "cuda")).backward()
    handle.remove()
    opt.step()
    opt.zero_grad()
    after, after_state = _host_state(model), copy.deepcopy(opt.state_dict()["state"])
    for i in range(LAYERS):
        same = torch.equal(after[f"{i}.weight"], weights[f"{i}.weight"])
        assert same == (i <= BAD), i
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(after_state[i][key], state[i][key]) == (i <= BAD), (i, key)
    assert opt.skipped_steps == 1
    assert f"the gradient of {BAD}.weight is not finite" in trainstream.memory_report(model)["events"]
    loss_fn(model, batch(2, "cuda")).backward()
    opt.step()
    opt.zero_grad()
    final = _host_state(model)
    assert all(not torch.equal(final[k], after[k]) and torch.isfinite(final[k]).all() for k in final)
    assert _steps(opt) == {i: (3 if i > BAD else 2) for i in range(LAYERS)}
    assert opt.skipped_steps == 1
    stager = model._trainstream_engine.moments
    assert (stager.copies > 0, stager.mapped > 0) == (copied, not copied)


@pytest.mark.gpu
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_gpu_mode_a_skip_then_three_steps_hold_the_host_optimizers_bits(base):
    """The bad step's skipped blocks take their next update with the step count they would
    have had: three more steps give the bits of the host optimizer (optimizer_mode="cpu"),
    which skips on the host at once, as the CUDA AdamW gives the host AdamW's bits."""

    def run(mode):
        model, opt, batch, loss_fn = _wrapped(device="cuda", base=base, **mode)
        handle = _poison(model, BAD)
        for i in range(4):
            loss_fn(model, batch(i, "cuda")).backward()
            if i == 0:
                handle.remove()
            opt.step()
            opt.zero_grad()
        return _host_state(model), _steps(opt), opt.skipped_steps

    on_device, on_host = run(GPU_MODE), run({})
    assert_same_bits((None, on_device[0]), (None, on_host[0]))
    assert on_device[1] == on_host[1] == {i: (4 if i > BAD else 3) for i in range(LAYERS)}
    assert on_device[2] == on_host[2] == 1
