"""Gradients during backward: streamed to host memory (or left on the device), summed over
an accumulation window, and a pass that raises or repeats a gradient."""

import gc

import pytest
import torch
from helpers import GPU_MODE, PAGED, RESIDENT, assert_same_bits, max_diff, train
from models import checkpointed_gpt, tiny_gpt, tiny_mlp

import trainstream
from trainstream.engine.layout import GradWindow


@pytest.mark.parametrize(
    "opts",
    [dict(accumulation=3), dict(clip=0.05), dict(accumulation=2, clip=0.05)],
    ids=["accumulation", "clip", "accumulation+clip"],
)
def test_gpu_mode_with_clipping_and_accumulation_lands_gradients_on_the_host(opts):
    for base in (RESIDENT, PAGED):
        device = train("gpt", dict(base, **GPU_MODE), steps=4, **opts)
        assert_same_bits(train("gpt", base, steps=4, **opts), device)
        assert not device[2][0]._trainstream_engine.device_grads
        assert "land in host memory" in trainstream.memory_report(device[2][0])["events"]


def test_too_many_backward_passes_is_an_error():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", accumulation_steps=2)
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps=2"):
        loss_fn(model, batch(2, "cpu")).backward()


def test_zero_grad_drops_an_unfinished_window():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", accumulation_steps=2, lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn(model, batch(0, "cpu")).backward()
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_training_goes_on_after_a_backward_that_raised():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", **PAGED)
    loss = loss_fn(model, batch(0, "cpu"))
    hidden = model[2].weight  # a failure partway through backward, after some gradients landed

    def fail(grad):
        raise RuntimeError("boom")

    handle = hidden.register_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    handle.remove()
    opt.zero_grad()
    _trains_on_after_the_raise(model, opt, batch, loss_fn)


def _trains_on_after_the_raise(model, opt, batch, loss_fn):
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert "a backward pass raised" in trainstream.memory_report(model)["events"]


@pytest.mark.parametrize("closed_by", [None, "zero_grad", "step"])
@pytest.mark.parametrize("opts", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_a_backward_run_again_over_a_graph_whose_backward_raised_is_refused_clearly(opts, closed_by):
    """retain_graph=True kept the graph, but the pass that raised gave its blocks' gradients and
    let their weights and activations go: a second backward over it is refused as such (not as
    a parameter's second gradient), also once zero_grad() or step() closed the pass that
    raised (it would train on what that pass left), and the next forward trains on."""
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", **opts)
    loss = loss_fn(model, batch(0, "cpu"))
    failing = [True]

    def fail_once(grad):
        if failing.pop() if failing else False:
            raise RuntimeError("boom")
        return grad

    model[2].weight.register_hook(fail_once)  # partway through backward, after some gradients landed
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward(retain_graph=True)
    if closed_by is not None:
        getattr(opt, closed_by)()
    with pytest.raises(RuntimeError, match="ran again over a graph whose earlier backward raised"):
        loss.backward()
    _trains_on_after_the_raise(model, opt, batch, loss_fn)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_output_gradient_in_a_nested_backward_of_a_pass_that_never_raised_trains_as_stock():
    """The model's output reached inside a reentrant checkpoint's own backward (a head that
    reads it from its closure), after a device-state regulariser's gradient began the pass in
    the outer one: a pass of its own, not a retry over a graph whose backward raised."""
    import copy

    from torch.utils.checkpoint import checkpoint

    from engine.test_device_state import lora_mlp

    def losses(model, opt):
        scale = torch.ones((), requires_grad=True)
        out = []
        for i in range(3):
            y = model(torch.randn(8, 64, generator=torch.Generator().manual_seed(i)))
            head = checkpoint(lambda s, y=y: (y * s).pow(2).mean(), scale, use_reentrant=True)
            loss = head + 1e-3 * model.layers[0].fc1.lora_a.pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    torch.manual_seed(0)
    model, _, _ = lora_mlp()
    stock = copy.deepcopy(model)
    expected = losses(stock, torch.optim.AdamW([p for p in stock.parameters() if p.requires_grad], lr=1e-2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, **RESIDENT)
    assert model._trainstream_engine.plan.device_state
    assert losses(model, opt) == expected


def test_the_last_backward_of_a_window_updates_units_used_earlier_only():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.extra = torch.nn.Linear(8, 8)

        def forward(self, x, use_extra):
            for b in self.blocks:
                x = b(x)
            return (self.extra(x) if use_extra else x).square().mean()

    model, opt = trainstream.wrap(Net(), None, device="cpu", accumulation_steps=2)
    model(torch.randn(4, 8), True).backward()
    model(torch.randn(4, 8), False).backward()
    engine = model._trainstream_engine
    assert all(u.window is GradWindow.QUEUED for u in engine.units)  # before step(): the window is complete
    opt.step()


def test_small_gradients_leave_in_one_batch_per_unit(monkeypatch):
    """Gradients under GradStreamer.SMALL_GRAD_BYTES wait for their unit's last one and go
    to host memory together (one D2H batch per unit and pass); a large one goes at once."""
    from trainstream.engine.grads import GradStreamer

    sends = []
    send = GradStreamer._send

    def counting(self, unit):
        sends.append((unit.name, len(unit.waiting)))
        return send(self, unit)

    monkeypatch.setattr(GradStreamer, "_send", counting)
    _, _, (model, _) = train("gpt", RESIDENT, steps=1)  # every gradient of the tiny GPT is small
    units = [u for u in model._trainstream_engine.units if u.trainable]
    assert sorted(sends) == sorted((u.name, len(u.trainable)) for u in units)
    sends.clear()
    monkeypatch.setattr(GradStreamer, "SMALL_GRAD_BYTES", 0)  # every gradient counts as large
    train("gpt", RESIDENT, steps=1)
    assert all(n == 1 for _, n in sends) and len(sends) == sum(len(u.trainable) for u in units)


@pytest.mark.parametrize("opts", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_reentrant_checkpointing_with_a_frozen_head(opts):
    """The first trainable gradient arrives inside a checkpoint's own backward: the pass must
    still end with the whole backward (it starts at the model's output)."""
    frozen = lambda n: n.startswith(("head", "norm"))  # noqa: E731
    stock = train("ckpt", None, steps=3, freeze=frozen, model_factory=checkpointed_gpt(reentrant=True))
    wrapped = train("ckpt", opts, steps=3, freeze=frozen, model_factory=checkpointed_gpt(reentrant=True))
    assert max_diff(stock[1], wrapped[1]) < 5e-5


def test_a_second_gradient_in_one_pass_is_an_error_not_a_wrong_update():
    torch.manual_seed(0)
    model, batch, loss_fn = checkpointed_gpt(reentrant=True, shared_gain=True)()
    model, opt = trainstream.wrap(model, None, lr=1e-2, device="cpu", offload=True, **RESIDENT)
    with pytest.raises(RuntimeError, match="norm.gain got a second gradient in one backward pass"):
        loss_fn(model, batch(0, "cpu")).backward()
    opt.zero_grad()  # the pass is closed; updates queued before the error stand, as for any failed backward
    assert "a backward pass raised" in trainstream.memory_report(model)["events"]


def test_a_failure_at_the_end_of_backward_leaves_no_half_landed_state(monkeypatch):
    from trainstream.engine.grads import GradStreamer

    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(model, None, lr=1e-2, device="cpu", offload=True, **RESIDENT)
    end_pass = GradStreamer.end_pass

    def failing_end(self):
        # The first thing end_pass does with every unit: fail on the second unit, with the
        # first already sent (a failed host job surfacing there, say).
        calls = []

        def send(unit):
            calls.append(unit)
            if len(calls) == 2:
                raise RuntimeError("a host job failed")
            return []

        self._send = send
        for unit in self.units[:2]:  # two units still waiting, as after unused parameters
            unit.waiting = [(unit.trainable[0], torch.zeros(1), None)]
        try:
            yield from end_pass(self)
        finally:
            del self._send

    monkeypatch.setattr(GradStreamer, "end_pass", failing_end)
    with pytest.raises(RuntimeError, match="a host job failed"):
        loss_fn(model, batch(0, "cpu")).backward()
    monkeypatch.setattr(GradStreamer, "end_pass", end_pass)
    engine = model._trainstream_engine
    assert all(not u.waiting and u.landed == 0 and not any(s.fresh for s in u.trainable) for u in engine.units)
    assert "the end of a backward pass raised" in trainstream.memory_report(model)["events"]
    loss_fn(model, batch(1, "cpu")).backward()  # the next pass counts only its own gradients
    opt.step()
    opt.zero_grad()


def test_a_parameter_in_two_reentrant_segments_of_one_block_sums_its_gradients():
    """The second segment's backward gives ln its first gradient; the first segment's gives
    the second one before the block's last gradient (a's, which ln follows in forward), so it
    arrives while the first still waits on the device, and the two are summed, as torch does."""
    from torch.utils.checkpoint import checkpoint

    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.a, self.b = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            h = checkpoint(lambda x: x + self.ln(self.a(x)), x, use_reentrant=True)
            return checkpoint(lambda h: h + self.b(self.ln(h)), h, use_reentrant=True)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.layers = torch.nn.ModuleList([Halves() for _ in range(3)])
            self.head = torch.nn.Linear(16, 32)

        def forward(self, idx):
            x = self.emb(idx)
            for layer in self.layers:
                x = layer(x)
            return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), idx.flatten())

    def factory():
        return (
            Model(),
            (lambda i, device: torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i)).to(device)),
            (lambda m, idx: m(idx)),
        )

    stock = train("halves", None, steps=3, model_factory=factory)
    wrapped = train("halves", RESIDENT, steps=3, model_factory=factory)
    assert max_diff(stock[1], wrapped[1]) < 5e-5


class _PassedEvent:
    """An event whose work is done, as a GPU's is once passed; unlike the CPU backend's
    DONE, which TransferLedger.add ignores, the ledger keeps it."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_gradients_left_on_the_device_count_once_as_released(monkeypatch):
    """optimizer_mode="gpu", gradients left on the device and checked for non-finite values:
    the ledger's released bytes are memory let go of, so each gradient counts once, when
    its update is queued (the updater, at its kernel's end); the check lets go of nothing."""
    model, batch, loss_fn = tiny_mlp(layers=4)
    model, opt = trainstream.wrap(model, None, device="cpu", offload=True, **RESIDENT, **GPU_MODE)
    engine = model._trainstream_engine
    assert engine.device_grads and engine.grads.device_check is not None  # the check runs on the device
    monkeypatch.setattr(engine.backend, "record", lambda stream=None: _PassedEvent())
    added, homes = [], []
    add, send_home = engine.ledger.add, engine.moments.send_home
    monkeypatch.setattr(engine.ledger, "add", lambda event, n: (added.append((event, n)), add(event, n)))
    monkeypatch.setattr(engine.moments, "send_home", lambda *a: homes.append(send_home(*a)) or homes[-1])
    steps = 2
    for i in range(steps):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    gradient_bytes = sum(n for event, n in added if not any(event is home for home in homes))
    assert gradient_bytes == steps * sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(accumulation=2), dict(clip=0.05)], ids=["accumulation", "clip"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gpu_optimizer_mode_gpu_reads_gradients_from_host_memory(opts, autocast):
    for base in (RESIDENT, PAGED):
        assert_same_bits(
            train("gpt", base, device="cuda", steps=4, autocast=autocast, **opts),
            train("gpt", dict(base, **GPU_MODE), device="cuda", steps=4, autocast=autocast, **opts),
        )


@pytest.mark.gpu
def test_gpu_optimizer_mode_gpu_keeps_gradients_out_of_vram():
    """Resident weights, gradients updated on the device as they come: the peak stays under
    weights + all gradients (stock's), like the host mode's."""
    factory = lambda: tiny_mlp(layers=8, dim=2048, rows=64)  # noqa: E731
    trainstream.profile_hardware("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    train(
        "mlp",
        dict(RESIDENT, **GPU_MODE, max_inflight_bytes=64 << 20),
        device="cuda",
        steps=3,
        lr=1e-3,
        model_factory=factory,
    )
    weights = 8 * 2048 * 2048 * 4
    assert torch.cuda.max_memory_allocated() - before < 1.5 * weights
