"""Each unit's update, queued as its gradients arrive: it waits for the host sums it reads."""

import pytest
import torch
from helpers import GPU_MODE, RESIDENT, assert_same_bits, train
from models import tiny_gpt, tiny_mlp

import trainstream


class _LateAccumulation:
    """An accumulation job that says it is finished only once someone has waited for it."""

    def __init__(self, job):
        self.job, self.waited = job, False

    def done(self) -> bool:
        return self.waited and self.job.done()

    def wait(self) -> None:
        self.job.wait()
        self.waited = True


def test_gpu_mode_waits_for_the_host_sum_before_the_update_reads_it(monkeypatch):
    """With accumulation the last pass adds into the host sums on the thread pool; the kernel
    is not in that pool, so the update must wait for the adds before it is queued."""
    from trainstream.engine.device import DeviceUpdate

    real = trainstream.ops.accumulate_
    monkeypatch.setattr(trainstream.ops, "accumulate_", lambda *a, **k: _LateAccumulation(real(*a, **k)))
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(
        model, None, device="cpu", offload=True, optimizer_mode="gpu", accumulation_steps=2, **RESIDENT
    )
    queue = opt.queue_on_device
    checked = []

    def checking(device, slots, *args, **kwargs):
        for s in slots:
            assert s.reader is None or isinstance(s.reader, DeviceUpdate) or s.reader.done(), s.name
        checked.append(len(slots))
        return queue(device, slots, *args, **kwargs)

    monkeypatch.setattr(opt, "queue_on_device", checking)
    for i in range(4):
        loss_fn(model, batch(i, "cpu")).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    assert checked


@pytest.mark.gpu
def test_gpu_optimizer_mode_gpu_accumulation_of_large_gradients_on_one_thread():
    """Large host sums added on one pool thread: an update that did not wait for the adds
    would read a half-summed gradient."""
    factory = lambda: tiny_mlp(layers=4, dim=2048, rows=2)  # noqa: E731
    opts = dict(RESIDENT, threads=1)
    assert_same_bits(
        train("mlp", opts, device="cuda", steps=3, accumulation=2, lr=1e-3, model_factory=factory),
        train("mlp", dict(opts, **GPU_MODE), device="cuda", steps=3, accumulation=2, lr=1e-3, model_factory=factory),
    )


def test_the_switch_to_stock_lets_go_of_the_moment_regions():
    """optimizer_mode="gpu" keeps the moments in regions of one pinned arena. After the switch
    to stock training the engine stays (the model still names it) but holds no region: the
    stock optimizer has its own copy of the moments."""
    import gc
    import weakref

    from helpers import gpt_steps

    from trainstream.engine.adapt import SwitchToStock

    model, opt = gpt_steps("gpu")
    engine = model._trainstream_engine
    stager = weakref.ref(engine.moments)
    engine.apply(SwitchToStock({}))
    gc.collect()
    assert engine.mode == "stock" and stager() is None


def _lr_changed_after_backward(wrap_options: dict, steps: int = 2) -> list:
    """Train tiny_mlp, halving the lr between each backward() and step(); the warnings."""
    import warnings

    torch.manual_seed(0)
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **RESIDENT, **wrap_options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            loss_fn(model, batch(i, "cpu")).backward()
            opt.param_groups[0]["lr"] /= 2
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if "trainstream" in str(w.message)]


def test_an_lr_changed_after_updates_were_queued_warns_once_naming_the_group():
    """Updates queued during backward read the lr of their time: step() says so, once."""
    messages = _lr_changed_after_backward({})
    assert len(messages) == 1
    assert "param group 0's lr changed from 0.01 to 0.005" in messages[0]
    assert "block 5" in messages[0]


def test_an_lr_changed_before_the_updates_are_queued_does_not_warn():
    """With clipping every update is queued by step(), with the lr of that moment."""
    assert _lr_changed_after_backward(dict(max_grad_norm=1.0)) == []
