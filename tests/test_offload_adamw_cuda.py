"""trainstream.OffloadAdamW(mode="cpu") on a model that lives on the GPU: gradients to host
memory as backward makes them, the host AdamW, the new weights back on a copy stream.

Every test runs on "cuda" (marked gpu) and on "cpu", where `StreamedOnHost` sends CPU
parameters down the same path over the CPU backend's stand-in streams (each copy done when
it returns): the bookkeeping of hooks, landing, queuing, pushing and waiting is the same.
"""

import copy
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

from trainstream import OffloadAdamW
from trainstream.optim import convert_optimizer, update_batches


class StreamedOnHost(OffloadAdamW):
    _stream_host_params = True


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# The host AdamW against torch's single-tensor AdamW on the same device's gradients: the
# CPU path reads the very gradients torch reads; on a GPU torch's kernels may fuse (FMA).
TOL = {"cpu": 1e-6, "cuda": 1e-5}


class MLP(torch.nn.Module):
    """Odd sizes (no vector width or chunk divides them); `inner.b` is read by its parent's
    forward, never through its own (as nn.MultiheadAttention reads out_proj)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(37, 129)
        self.inner = Inner()
        self.c = torch.nn.Linear(61, 3, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.inner(torch.relu(self.a(x)))))


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Linear(129, 61)

    def forward(self, x):
        return F.linear(x, self.b.weight, self.b.bias)


def record_jobs(monkeypatch) -> list:
    """The host jobs queued from now on, each as (its tensors' shapes, its priority)."""
    import trainstream.ops

    queued = []
    adamw_step = trainstream.ops.adamw_step

    def recording(params, *args, priority, **kwargs):
        queued.append(([p.shape for p in params], priority))
        return adamw_step(params, *args, priority=priority, **kwargs)

    monkeypatch.setattr(trainstream.ops, "adamw_step", recording)
    return queued


def optimizer_class(device):
    return StreamedOnHost if device == "cpu" else OffloadAdamW


def twins(device, dtype=torch.float32):
    torch.manual_seed(0)
    model = MLP().to(device=device, dtype=dtype)
    return model, copy.deepcopy(model)


def batches(n, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 37, generator=gen).to(device), torch.randn(16, 3, generator=gen).to(device)) for _ in range(n)
    ]


def loss_of(model, x, y):
    return F.mse_loss(model(x), y)


def train(model, opt, data, *, clip=None, accumulate=1, scheduler=None):
    """Per-step losses. torch's optimizer gets torch's recipe for clipping and for the mean
    over `accumulate` micro-batches; OffloadAdamW does both itself."""
    ours = isinstance(opt, OffloadAdamW)
    losses = []
    for i, (x, y) in enumerate(data):
        loss = loss_of(model, x, y)
        losses.append(loss.item())
        loss.backward()
        if ours:
            assert all(p.grad is None for p in model.parameters()), "a gradient was left in p.grad"
        else:
            if accumulate > 1:
                if (i + 1) % accumulate:
                    continue
                for p in model.parameters():
                    p.grad /= accumulate
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    if ours:
        opt.synchronize()
    return losses


def assert_close(ours, theirs, tol):
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= tol, f"{name}: {diff}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw_step_by_step(device, weight_decay):
    ours, theirs = twins(device)
    data = batches(20, device)
    opt = optimizer_class(device)(ours.parameters(), lr=1e-2, weight_decay=weight_decay)
    got = train(ours, opt, data)
    want = train(
        theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=weight_decay, foreach=False), data
    )
    # Each step's loss is the next forward reading the new weights.
    assert got == pytest.approx(want, abs=TOL[device], rel=0)
    assert_close(ours, theirs, TOL[device])
    state = opt.state[ours.a.weight]
    assert state["exp_avg"].device.type == "cpu" and state["step"].item() == 20


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_params_keep_an_fp32_master_in_host_memory(device):
    """A bf16 param: the fp32 master is updated and rounded to nearest into the param, as
    torch AdamW over fp32 masters fed the bf16 gradients, then copied into the bf16 model.
    The reference model reads our bf16 weights each step (the same gradients on both sides):
    a master an ulp apart can round to another bf16 weight, and 20 steps amplify that."""
    ours, theirs = twins(device, torch.bfloat16)
    data = batches(20, device)
    opt = optimizer_class(device)(ours.parameters(), lr=1e-2, weight_decay=0.1)
    masters = [p.detach().float().clone() for p in theirs.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    for x, y in data:
        opt.synchronize()
        theirs.load_state_dict(ours.state_dict())
        with torch.autocast(device, dtype=torch.bfloat16):
            loss_of(ours, x, y).backward()
            loss_of(theirs, x, y).backward()
        opt.step()
        opt.zero_grad()
        for m, p in zip(masters, theirs.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref.step()
        with torch.no_grad():
            for m, p in zip(masters, theirs.parameters()):
                p.copy_(m)
    opt.synchronize()
    for (name, p), m in zip(ours.named_parameters(), masters):
        assert p.dtype == torch.bfloat16
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32 and master.device.type == "cpu"
        assert (master - m.cpu()).abs().max().item() <= 1e-5, name
        assert torch.equal(p.cpu(), master.to(torch.bfloat16)), name  # the param is its master, rounded


@pytest.mark.parametrize("device", DEVICES)
def test_clipping_matches_clip_grad_norm(device):
    ours, theirs = twins(device)
    data = batches(12, device)
    train(ours, optimizer_class(device)(ours.parameters(), lr=1e-2, max_grad_norm=0.05), data)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False), data, clip=0.05)
    assert_close(ours, theirs, TOL[device])
    unclipped, _ = twins(device)
    train(unclipped, torch.optim.AdamW(unclipped.parameters(), lr=1e-2, foreach=False), data)
    assert max((a - b).abs().max().item() for a, b in zip(unclipped.parameters(), theirs.parameters())) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_accumulation_and_clipping_match_torch(device):
    """accumulation_steps=N: the mean of N step() calls' gradients (OffloadAdamW's meaning)."""
    ours, theirs = twins(device)
    data = batches(24, device)
    opt = optimizer_class(device)(ours.parameters(), lr=1e-2, accumulation_steps=3, max_grad_norm=0.05)
    before = [p.detach().clone() for p in ours.parameters()]
    train(ours, opt, data[:2])
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters())), "a micro-step moved weights"
    train(ours, opt, data[2:])
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False), data, accumulate=3, clip=0.05)
    assert_close(ours, theirs, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_two_backward_passes_before_step_add_up_as_in_p_grad(device):
    ours, theirs = twins(device)
    data = batches(12, device)
    opt_a = optimizer_class(device)(ours.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    for i in range(0, 12, 3):
        for model, opt in ((ours, opt_a), (theirs, opt_b)):
            for x, y in data[i : i + 3]:
                loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    opt_a.synchronize()
    assert_close(ours, theirs, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_zero_grad_keeping_zeros_and_step_without_zero_grad_act_as_torch(device):
    """zero_grad(set_to_none=False) leaves a zero gradient, which torch's step() applies
    (the moments decay, the decay acts); step() twice applies the same gradient twice."""
    ours, theirs = twins(device)
    data = batches(4, device)
    opt_a = optimizer_class(device)(ours.parameters(), lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for model, opt in ((ours, opt_a), (theirs, opt_b)):
        for x, y in data:
            loss_of(model, x, y).backward()
            opt.step()
            opt.step()
            opt.zero_grad(set_to_none=False)
            opt.step()
    opt_a.synchronize()
    assert_close(ours, theirs, TOL[device])
    assert opt_a.state[ours.a.weight]["step"].item() == opt_b.state[theirs.a.weight]["step"].item() == 12


@pytest.mark.parametrize("device", DEVICES)
def test_params_without_a_gradient_are_not_updated(device):
    ours, theirs = twins(device)
    for model in (ours, theirs):
        model.c.weight.requires_grad_(False)
        model.unused = torch.nn.Linear(3, 3).to(device)  # in the optimizer, never in the forward
    theirs.unused.load_state_dict(ours.unused.state_dict())
    data = batches(6, device)
    opt = optimizer_class(device)(ours.parameters(), lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    train(ours, opt, data)
    train(theirs, torch_opt, data)
    assert_close(ours, theirs, TOL[device])
    assert ours.c.weight not in opt.state and ours.unused.weight not in opt.state
    assert ours.c.weight not in opt._host_updates.records, "a frozen param took host buffers"
    # Unfrozen later, it trains from its first gradient on, as with torch. That first one
    # reaches p.grad (the param had no hook) and step() takes it; the hook takes the rest.
    for model, o in ((ours, opt), (theirs, torch_opt)):
        model.c.weight.requires_grad_(True)
        loss_of(model, *data[0]).backward()
        o.step()
        o.zero_grad()
    train(ours, opt, data)
    train(theirs, torch_opt, data)
    assert_close(ours, theirs, TOL[device])
    assert opt.state[ours.c.weight]["step"].item() == len(data) + 1


@pytest.mark.parametrize("device", DEVICES)
def test_lr_scheduler_and_param_group_changes_are_read_at_each_step(device):
    ours, theirs = twins(device)
    data = batches(12, device)
    opt_a = optimizer_class(device)(ours.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=3, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5)
    train(ours, opt_a, data[:6], scheduler=sched_a)
    train(theirs, opt_b, data[:6], scheduler=sched_b)
    for opt in (opt_a, opt_b):
        opt.param_groups[0]["weight_decay"] = 0.3
    train(ours, opt_a, data[6:], scheduler=sched_a)
    train(theirs, opt_b, data[6:], scheduler=sched_b)
    assert_close(ours, theirs, TOL[device])
    assert opt_a.param_groups[0]["lr"] == pytest.approx(opt_b.param_groups[0]["lr"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer_first", [True, False])
def test_resume_from_state_dicts_is_exact(device, dtype, optimizer_first):
    """A run resumed from the model's and the optimizer's state dicts (loaded in either
    order) gives the uninterrupted run's bits; a bf16 param's master comes back with them."""
    model, _ = twins(device, dtype)
    data = batches(12, device)
    cls = optimizer_class(device)
    kw = dict(lr=1e-2, weight_decay=0.1, moment_dtype="bfloat16")
    opt = cls(model.parameters(), **kw)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def run(model, opt, data):
        for x, y in data:
            with autocast:
                loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()

    run(model, opt, data[:6])
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(model, opt, data[6:])

    torch.manual_seed(5)
    resumed = MLP().to(device=device, dtype=dtype)
    opt2 = cls(resumed.parameters(), **kw, seed=123)  # the saved seed is taken
    if optimizer_first:
        opt2.load_state_dict(saved_opt)
        resumed.load_state_dict(saved_model)
    else:
        resumed.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
    run(resumed, opt2, data[6:])
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_continues_in_torch_adamw_and_back(device):
    ours, theirs = twins(device)
    data = batches(16, device)
    opt = optimizer_class(device)(ours.parameters(), lr=1e-2)
    train(ours, opt, data[:8])
    theirs.load_state_dict(ours.state_dict())
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    back, _ = twins(device)
    back.load_state_dict(ours.state_dict())
    opt_back = optimizer_class(device)(back.parameters(), lr=1e-2)
    opt_back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    train(ours, opt, data[8:])
    train(theirs, torch_opt, data[8:])
    train(back, opt_back, data[8:])
    assert_close(ours, theirs, TOL[device])
    assert_close(back, ours, 0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_an_edit_in_place_between_steps_is_taken_into_the_master(device):
    ours, theirs = twins(device)
    data = batches(8, device)
    opt = optimizer_class(device)(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    train(ours, opt, data[:4])
    train(theirs, torch_opt, data[:4])
    with torch.no_grad():
        for model in (ours, theirs):
            model.a.weight.mul_(0.5)
            model.inner.b.bias.zero_()
    train(ours, opt, data[4:])
    train(theirs, torch_opt, data[4:])
    assert_close(ours, theirs, TOL[device])


def _without_lander(opt):
    """Only the forward (or step() itself) may push the new weights: what a forward reads
    is then what the optimizer made it wait for."""
    opt._host_updates.lander.expect = lambda unit: None
    return opt


def test_a_forward_waits_for_the_updates_of_the_params_it_reads_only():
    ours, theirs = twins("cpu")
    data = batches(6, "cpu")
    opt = _without_lander(StreamedOnHost(ours.parameters(), lr=1e-2))
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    train(ours, opt, data[:1])
    train(theirs, torch_opt, data[:1])
    x, y = data[1]
    loss_of(ours, x, y).backward()
    loss_of(theirs, x, y).backward()
    opt.step()
    torch_opt.step()

    def diff(a, b):
        return (a - b).abs().max().item()

    assert diff(ours.a.weight, theirs.a.weight) > 1e-4, "pushed before any forward read it"
    ours.a(x)  # a's forward: its params arrive, and only those
    assert diff(ours.a.weight, theirs.a.weight) <= 1e-6 and diff(ours.a.bias, theirs.a.bias) <= 1e-6
    assert diff(ours.c.weight, theirs.c.weight) > 1e-4
    # inner.b's own forward never runs: its parent's forward is where it is read and waited for.
    assert diff(ours.inner.b.weight, theirs.inner.b.weight) > 1e-4
    ours.inner(torch.relu(ours.a(x)))
    assert diff(ours.inner.b.weight, theirs.inner.b.weight) <= 1e-6
    assert diff(ours.c.weight, theirs.c.weight) > 1e-4
    opt.zero_grad()
    torch_opt.zero_grad()
    # The whole forward, inner.b read by its parent's forward included, sees the new weights.
    assert train(ours, opt, data[2:]) == pytest.approx(train(theirs, torch_opt, data[2:]), abs=1e-6, rel=0)
    assert_close(ours, theirs, 1e-6)


def test_a_param_no_module_holds_is_current_when_step_returns():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    w_ref = torch.nn.Parameter(w.detach().clone())
    opt = _without_lander(StreamedOnHost([w], lr=1e-2))
    torch_opt = torch.optim.AdamW([w_ref], lr=1e-2, foreach=False)
    x = torch.randn(4, 5)
    for _ in range(3):
        for p, o in ((w, opt), (w_ref, torch_opt)):
            (x @ p).square().sum().backward()
            o.step()
            o.zero_grad()
        assert (w - w_ref).abs().max().item() <= 1e-6


def test_a_gradient_made_before_the_optimizer_is_taken():
    ours, theirs = twins("cpu")
    x, y = batches(1, "cpu")[0]
    loss_of(ours, x, y).backward()
    loss_of(theirs, x, y).backward()
    opt = StreamedOnHost(ours.parameters(), lr=1e-2)
    opt.step()
    opt.synchronize()
    torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False).step()
    assert_close(ours, theirs, 1e-6)
    assert all(p.grad is None for p in ours.parameters())


def test_converting_for_wrap_takes_the_hooks_off():
    model, _ = twins("cpu")
    opt = StreamedOnHost(model.parameters(), lr=1e-2)
    train(model, opt, batches(2, "cpu"))
    converted = convert_optimizer(opt, model.parameters())
    x, y = batches(1, "cpu")[0]
    loss_of(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters()), "the old optimizer still takes the gradients"
    assert converted.state[model.a.weight]["step"].item() == 2


def test_parameter_dtypes_on_the_streamed_path():
    with pytest.raises(ValueError, match=r"needs float32 or bfloat16 parameters, got torch.float16"):
        StreamedOnHost([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])


@pytest.mark.gpu
def test_gpu_mode_still_refuses_host_parameters():
    with pytest.raises(
        ValueError,
        match=r"mode='gpu'\) updates parameters on a GPU; parameter 0 of param group 0 \(shape \(2, 2\)\) is on cpu",
    ):
        OffloadAdamW(torch.nn.Linear(2, 2).parameters(), mode="gpu")


@pytest.mark.gpu
def test_params_on_the_gpu_and_in_host_memory_together_are_refused():
    with pytest.raises(ValueError, match=r"every parameter in host memory, or every one on one GPU"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(2, device="cuda")), torch.nn.Parameter(torch.zeros(2))])


@pytest.mark.gpu
def test_the_state_and_the_masters_live_in_host_memory():
    model = MLP().cuda()
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    train(model, opt, batches(2, "cuda"))
    record = opt._host_updates.records[model.a.weight]
    assert record.master.device.type == "cpu" and record.master.is_pinned()
    assert record.stage.is_pinned()
    for p in model.parameters():
        assert p.device.type == "cuda"
        assert all(v.device.type == "cpu" for k, v in opt.state[p].items())


@pytest.mark.gpu
def test_no_gradient_is_held_in_vram_after_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # 32 MiB
    opt = OffloadAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")

    def backward():
        model(x).square().mean().backward()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees the copied gradients on its next call

    backward()  # warm: cuBLAS's workspaces, the first step's buffers
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    base = torch.cuda.memory_allocated()
    backward()
    held = torch.cuda.memory_allocated() - base
    assert held < grad_bytes / 8, f"{held} bytes still allocated after backward (gradients: {grad_bytes})"
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    opt.synchronize()


def test_a_new_optimizer_over_the_same_params_takes_their_gradients():
    ours, theirs = twins("cpu")
    data = batches(6, "cpu")
    first = StreamedOnHost(ours.parameters(), lr=1e-2)
    train(ours, first, data[:3])
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False), data[:3])
    kept_alive = first  # noqa: F841  (an old optimizer still referenced somewhere)
    second = StreamedOnHost(ours.parameters(), lr=1e-2)
    third_party = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    train(ours, second, data[3:])
    train(theirs, third_party, data[3:])
    assert second.state[ours.a.weight]["step"].item() == 3
    assert_close(ours, theirs, 1e-6)


def test_wrap_takes_a_streamed_optimizer_over():
    import trainstream

    ours, theirs = twins("cpu")
    data = batches(6, "cpu")
    opt = StreamedOnHost(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    train(ours, opt, data[:2])
    train(theirs, torch_opt, data[:2])
    model, wrapped = trainstream.wrap(ours, opt, offload=True, profile=False)
    for x, y in data[2:]:
        loss_of(model, x, y).backward()
        wrapped.step()
        wrapped.zero_grad()
    wrapped.synchronize()
    train(theirs, torch_opt, data[2:])
    assert_close(ours, theirs, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("lander", [True, False])
def test_each_forward_reads_the_new_weights_of_a_model_whose_update_outlasts_it(lander):
    """Updates of 4M-element tensors take the host longer than a forward takes the GPU: a
    forward that did not wait for its own parameters' copies would read old weights. Without
    the lander, each forward pushes its own (the guard)."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    theirs = copy.deepcopy(ours)
    opt = OffloadAdamW(ours.parameters(), lr=1e-3)
    if not lander:
        _without_lander(opt)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, 2048, generator=gen).cuda() for _ in range(5)]
    losses = {}
    for model, o in ((ours, opt), (theirs, torch_opt)):  # each forward right after its step()
        losses[o] = []
        for x in xs:
            loss = model(x).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses[o].append(loss)
    assert [v.item() for v in losses[opt]] == pytest.approx([v.item() for v in losses[torch_opt]], rel=1e-5)
    opt.synchronize()
    assert_close(ours, theirs, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_param_group_added_later_is_streamed_too(device):
    ours, theirs = twins(device)
    data = batches(8, device)
    opts = []
    for model, cls in ((ours, optimizer_class(device)), (theirs, torch.optim.AdamW)):
        kw = {} if cls is not torch.optim.AdamW else {"foreach": False}
        later = [*model.inner.parameters(), *model.c.parameters()]
        for p in later:
            p.requires_grad_(False)  # outside the optimizer: no gradient piles up in p.grad meanwhile
        opt = cls(model.a.parameters(), lr=1e-2, **kw)
        opts.append(opt)
        train(model, opt, data[:4])
        for p in later:
            p.requires_grad_(True)
        opt.add_param_group({"params": later, "lr": 5e-3})
        train(model, opt, data[4:])
    # The host AdamW and torch's round differently in the last bit, and a few first steps
    # of Adam, lr * g / (|g| + eps), magnify that where |g| is near eps (OffloadAdamW on host
    # params gives these same bits); not updating the group would be off by 1e-2.
    assert_close(ours, theirs, 1e-4)
    assert opts[0].state[ours.c.weight]["step"].item() == 4


class BodyAndHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(37, 64)
        self.head = torch.nn.Linear(64, 29, bias=False)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.parametrize("device", DEVICES)
def test_a_weight_read_outside_its_module_after_a_whole_model_eval_is_current(device):
    """An eval calls the whole model once (head's forward runs); training then calls only the
    body and reads head.weight directly, as a chunked loss reads lm_head.weight: nothing in
    training calls head, so step() must leave head.weight current."""
    torch.manual_seed(0)
    ours = BodyAndHead().to(device)
    theirs = copy.deepcopy(ours)
    opt = _without_lander(optimizer_class(device)(ours.parameters(), lr=1e-2))
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 37, generator=gen).to(device) for _ in range(4)]
    losses = {}
    for model, o in ((ours, opt), (theirs, torch_opt)):
        model.eval()
        with torch.no_grad():
            model(xs[0])
        model.train()
        losses[o] = []
        for x in xs:
            loss = F.linear(model.body(x), model.head.weight).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses[o].append(loss.item())
    # A head one step old moves the loss by 20% (0.19 against 0.16 at the second step).
    assert losses[opt] == pytest.approx(losses[torch_opt], abs=TOL[device], rel=TOL[device])
    opt.synchronize()
    assert_close(ours, theirs, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_an_eval_fast_path_reading_child_weights_itself_waits_for_them(device):
    """nn.TransformerEncoderLayer in eval under no_grad reads linear1, linear2 and the norms
    itself (the fast path), while training calls those modules: the layer's forward in that
    new context waits for its whole subtree."""
    torch.manual_seed(0)
    ours = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).to(device)
    theirs = copy.deepcopy(ours)
    opt = _without_lander(optimizer_class(device)(ours.parameters(), lr=1e-2))
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1)).to(device)
    evaluated = {}
    for model, o in ((ours, opt), (theirs, torch_opt)):
        for _ in range(3):
            model.train()
            model(x).square().mean().backward()
            o.step()
            o.zero_grad()
        model.eval()
        with torch.no_grad():
            evaluated[o] = model(x)  # right after step()
    # The host AdamW and torch's round differently in the last bit, and the norms magnify it
    # (1e-5 here); a weight one step old moves the output by about 1.
    assert (evaluated[opt] - evaluated[torch_opt]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_an_optimizer_dropped_after_step_without_synchronize_lands_its_last_step(device):
    import gc

    ours, theirs = twins(device)
    data = batches(2, device)
    opt = _without_lander(optimizer_class(device)(ours.parameters(), lr=1e-2))
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    for model, o in ((ours, opt), (theirs, torch_opt)):
        for x, y in data:
            loss_of(model, x, y).backward()
            o.step()
            o.zero_grad()
    del opt
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
    assert_close(ours, theirs, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_model_through_torch_adamw_and_back_keeps_torchs_steps(device):
    """OffloadAdamW 2 steps, torch AdamW 4 steps (from its state dict), OffloadAdamW 1 step
    (from torch's), against torch AdamW taking that last step from the same state. torch
    keeps the "master" it loaded (cast to bf16, two steps old) and saves it again: the master
    the last optimizer loads is stale, and the params, which torch moved, must win over it."""
    model, _ = twins(device, torch.bfloat16)
    data = batches(7, device)
    cls = optimizer_class(device)
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def run(model, opt, data):
        for x, y in data:
            with autocast:
                loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        if isinstance(opt, OffloadAdamW):
            opt.synchronize()

    first = cls(model.parameters(), lr=1e-2)
    run(model, first, data[:2])
    middle = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    middle.load_state_dict(copy.deepcopy(first.state_dict()))
    del first
    run(model, middle, data[2:6])
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    reference_opt.load_state_dict(copy.deepcopy(middle.state_dict()))
    last = cls(model.parameters(), lr=1e-2)
    last.load_state_dict(copy.deepcopy(middle.state_dict()))
    run(model, last, data[6:])
    run(reference, reference_opt, data[6:])
    # The host AdamW updates an fp32 master, torch AdamW the bf16 weights themselves: one step
    # parts them by a bf16 rounding (2**-10 of a weight near 0.16); torch's 4 steps undone
    # would put them about 4 * lr apart.
    assert_close(model, reference, 2e-3)
    assert last.state[model.a.weight]["step"].item() == 7


@pytest.mark.parametrize("device", DEVICES)
def test_another_optimizer_stepped_after_an_offload_adamw_still_referenced_trains(device):
    """An LR scheduler keeps the first optimizer alive; the user switches to torch's AdamW.
    The optimizer stepped last over a param takes its gradients: the first one's hooks give
    torch's AdamW the gradient of its first step back in p.grad, its own last update landed,
    and leave the later ones in p.grad. Stepped again, OffloadAdamW takes them back."""
    ours, theirs = twins(device)
    data = batches(9, device)
    first = _without_lander(optimizer_class(device)(ours.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(first, lambda step: 1.0)  # noqa: F841 (keeps it)
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    train(ours, first, data[:3])
    train(theirs, reference, data[:3])
    then = torch.optim.AdamW(ours.parameters(), lr=1e-2, foreach=False)
    then.load_state_dict(copy.deepcopy(reference.state_dict()))  # continue as the reference does
    train(ours, then, data[3:6])
    train(theirs, reference, data[3:6])
    assert_close(ours, theirs, TOL[device])
    assert then.state[ours.a.weight]["step"].item() == 6
    first.load_state_dict(copy.deepcopy(then.state_dict()))
    for i, (x, y) in enumerate(data[6:]):
        loss_of(ours, x, y).backward()  # the first one reaches p.grad: step() takes it
        assert all((p.grad is None) == (i > 0) for p in ours.parameters())
        first.step()
        first.zero_grad()
    first.synchronize()
    train(theirs, reference, data[6:])
    assert_close(ours, theirs, TOL[device])
    assert first.state[ours.a.weight]["step"].item() == 9


def test_an_optimizer_converted_for_wrap_lets_its_buffers_go_while_referenced():
    import gc
    import weakref

    model, _ = twins("cpu")
    opt = StreamedOnHost(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # keeps `opt` alive
    train(model, opt, batches(2, "cpu"))
    records = [weakref.ref(r) for r in opt._host_updates.records.values()]
    convert_optimizer(opt, model.parameters())
    gc.collect()
    assert scheduler.optimizer is opt
    assert all(r() is None for r in records), "the converted optimizer still holds its host buffers"
    x, y = batches(1, "cpu")[0]
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"converted by wrap\(\).*step the optimizer it returned"):
        opt.step()


def test_an_optimizer_collected_takes_its_gradient_hooks_off_the_params():
    import gc

    model, _ = twins("cpu")
    data = batches(1, "cpu")
    for _ in range(5):
        train(model, StreamedOnHost(model.parameters(), lr=1e-2), data)
        gc.collect()
    assert all(len(p._post_accumulate_grad_hooks) == 0 for p in model.parameters())


def test_an_optimizer_collected_leaves_no_owner_for_its_params():
    """Every torch optimizer's step() looks its params up while any param has an owner: a
    collected OffloadAdamW's params must not keep one."""
    import gc

    from trainstream.optim import host_updates

    model, _ = twins("cpu")
    train(model, StreamedOnHost(model.parameters(), lr=1e-2), batches(1, "cpu"))
    gc.collect()
    assert not any(id(p) in host_updates._owner_of for p in model.parameters())


def test_the_updates_step_waits_for_are_queued_first(monkeypatch):
    """head.weight is read outside every module's forward (as a chunked loss reads lm_head):
    step() waits for its update, so the pool runs it before the body's, which the next
    forward waits for."""
    torch.manual_seed(0)
    model = BodyAndHead()
    opt = StreamedOnHost(model.parameters(), lr=1e-2)
    monkeypatch.setattr(update_batches, "MAX_ELEMENTS", 1)  # a job per param, as large ones get
    queued = record_jobs(monkeypatch)
    x = torch.randn(8, 37)
    F.linear(model.body(x), model.head.weight).square().mean().backward()
    opt.step()
    priority = {shapes[0]: p for shapes, p in queued}
    head = priority[model.head.weight.shape]
    assert head < priority[model.body.weight.shape] and head < priority[model.body.bias.shape]


@pytest.mark.parametrize("streamed", [True, False])
def test_a_frozen_fp16_or_int8_param_is_skipped_as_torch_skips_it(streamed):
    """model.parameters() of a model with a frozen fp16 or int8 base (a peft model): torch's
    AdamW skips a param without a gradient, so does OffloadAdamW; one unfrozen later is
    refused at the step() that would read its gradient, naming it."""
    torch.manual_seed(0)
    ours = MLP()
    ours.base = torch.nn.Linear(4, 4).half().requires_grad_(False)
    ours.codes = torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)
    theirs = copy.deepcopy(ours)
    data = batches(4, "cpu")
    opt = (StreamedOnHost if streamed else OffloadAdamW)(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    for model, o in ((ours, opt), (theirs, torch_opt)):
        for x, y in data:
            loss_of(model, x, y).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert_close(ours, theirs, 1e-6)
    ours.base.weight.requires_grad_(True)
    ours.base(torch.randn(2, 4).half()).float().sum().backward()
    dtypes = "float32 or bfloat16" if streamed else "float32"
    with pytest.raises(
        ValueError,
        match=rf"needs {dtypes} parameters.*got torch.float16 for parameter 6 of param "
        r"group 0 \(shape \(4, 4\)\)",
    ):
        opt.step()


def test_a_refused_parameter_is_named_by_group_index_and_shape():
    ok = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"got torch.float16 for parameter 1 of param group 1 \(shape \(2, 5\)\)"):
        StreamedOnHost([{"params": [ok]}, {"params": [ok.new_zeros(1), torch.nn.Parameter(torch.zeros(2, 5).half())]}])
    with pytest.raises(ValueError, match=r"contiguous.*parameter 0 of param group 0 \(shape \(5, 4\)\) is not"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4, 5).t())])


def test_wrap_of_a_streamed_bf16_optimizer_carries_its_fp32_masters():
    """The engine's masters start from the OffloadAdamW's fp32 masters, not from the bf16
    weights (which would lose up to half a bf16 ulp of every weight): it continues as the
    OffloadAdamW would have."""
    import trainstream

    model, twin = twins("cpu", torch.bfloat16)
    data = batches(6, "cpu")
    opt = StreamedOnHost(model.parameters(), lr=1e-2)
    uninterrupted = StreamedOnHost(twin.parameters(), lr=1e-2)

    def run(model, opt, data):
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()

    run(model, opt, data[:3])
    run(twin, uninterrupted, data[:3])
    masters = {p: opt.state[p]["master"].clone() for p in model.parameters()}
    assert any(not torch.equal(m, p.float()) for p, m in masters.items())  # the bits the weights lack
    model, wrapped = trainstream.wrap(model, opt, offload=True, profile=False)
    for unit in wrapped._engine.units:
        for s in unit.slots:
            assert torch.equal(s.master, masters[s.param])
    run(model, wrapped, data[3:])
    run(twin, uninterrupted, data[3:])
    assert_close(model, twin, 0.0)


class _SteppingThrough(torch.optim.Optimizer):
    """A Lookahead-style wrapper: it shares the inner optimizer's param_groups and steps it,
    but its zero_grad() is torch's own, which only clears p.grad."""

    def __init__(self, inner):
        self.inner = inner
        super().__init__(inner.param_groups, {})
        self.param_groups = inner.param_groups

    def step(self, closure=None):
        return self.inner.step(closure)


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_after_step_without_zero_grad_warns_once(device):
    """torch sums a backward after step() without zero_grad() into p.grad, and so does the host
    gradient; a wrapper whose zero_grad() does not reach this optimizer does that every step,
    so it is said (once) rather than left silent."""
    model, _ = twins(device)
    opt = optimizer_class(device)(model.parameters(), lr=1e-2)
    data = batches(3, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, opt, data)  # zero_grad() after every step: nothing to say
    wrapper = _SteppingThrough(opt)
    with pytest.warns(UserWarning, match="its zero_grad\\(\\) must call this one's") as seen:
        for x, y in data:
            loss_of(model, x, y).backward()
            wrapper.step()
            wrapper.zero_grad()
    assert len([w for w in seen if "zero_grad" in str(w.message)]) == 1


class Landing:
    """A gradient's copy to host memory that lands when waited for, logging the wait."""

    def __init__(self, name, log):
        self.name, self.log, self.landed = name, log, False

    def query(self):
        return self.landed

    def synchronize(self):
        if not self.landed:
            self.log.append(("wait", self.name))
        self.landed = True


def test_an_update_is_queued_as_soon_as_its_gradient_lands(monkeypatch):
    """step() runs while the GPU is still in backward: each param's update is queued once its
    own gradient is in host memory, before step() waits for the next one's copy, so the host
    pool works beside the rest of backward (the copies stand in for ones still landing)."""
    import trainstream.ops

    ours, theirs = twins("cpu")
    opt = StreamedOnHost(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    names = {p: name for name, p in ours.named_parameters()}
    log = []
    adamw_step = trainstream.ops.adamw_step

    def logging(params, *args, **kwargs):
        log.append(("queue", len(params)))
        return adamw_step(params, *args, **kwargs)

    monkeypatch.setattr(trainstream.ops, "adamw_step", logging)
    data = batches(3, "cpu")
    for x, y in data:
        loss_of(ours, x, y).backward()
        for record in opt._host_updates.records.values():
            record.stage_event = Landing(names[record.param], log)
        log.clear()
        opt.step()
        opt.zero_grad()
        # One wait, then that gradient's job, for each param in turn: c's first (backward
        # reaches it first), a's last.
        assert [kind for kind, _ in log] == ["wait", "queue"] * 5, log
        assert log[0] == ("wait", "c.weight") and log[-2][1].startswith("a.")
    train(theirs, torch_opt, data)
    opt.synchronize()
    assert_close(ours, theirs, 1e-6)


def test_small_params_share_a_job_and_large_ones_get_their_own(monkeypatch):
    """Updates queued together are gathered into native jobs of at most MAX_ELEMENTS (a param
    larger than that alone), never across param groups (their hyper-parameters differ); the
    result is torch's."""
    ours, theirs = twins("cpu")
    data = batches(4, "cpu")
    groups = [{"params": [*ours.a.parameters(), *ours.inner.parameters()]}, {"params": ours.c.parameters(), "lr": 3e-3}]
    opt = StreamedOnHost(groups, lr=1e-2)
    torch_opt = torch.optim.AdamW(
        [
            {"params": [*theirs.a.parameters(), *theirs.inner.parameters()]},
            {"params": theirs.c.parameters(), "lr": 3e-3},
        ],
        lr=1e-2,
        foreach=False,
    )
    queued = record_jobs(monkeypatch)
    train(ours, opt, data[:1])
    # c's weight (its own group) alone, then the other four params in one job.
    assert sorted(len(shapes) for shapes, _ in queued) == [1, 4]
    largest = ours.inner.b.weight.numel()
    monkeypatch.setattr(update_batches, "MAX_ELEMENTS", largest - 1)
    queued.clear()
    train(ours, opt, data[1:])
    for shapes, _ in queued:
        assert len(shapes) == 1 or sum(s.numel() for s in shapes) <= largest - 1, shapes
    assert [shapes for shapes, _ in queued].count([ours.inner.b.weight.shape]) == 3  # alone at each step
    assert sum(len(shapes) for shapes, _ in queued) == 5 * 3
    train(theirs, torch_opt, data)
    assert_close(ours, theirs, 1e-6)


def hooks_of(guard) -> int:
    """How many of torch's global forward pre-hooks are `guard`'s (each holds it weakly)."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks.values()
    cells = [c.cell_contents for h in hooks for c in (getattr(h, "__closure__", None) or ())]
    return sum(isinstance(c, weakref.ref) and c() is guard for c in cells)


def test_the_forward_hook_is_off_while_nothing_is_pending_and_on_after_step():
    """The guard's global hook takes every module's call in the process off torch's fast
    path: it is on from step() to the end of the forward that waited for the updates, off for
    the forwards after it (nothing is left to wait for), and those forwards and the next
    step's read what torch's would (only the forward may push the weights here)."""
    ours, theirs = twins("cpu")
    opt = _without_lander(StreamedOnHost(ours.parameters(), lr=1e-2))
    guard = opt._host_updates.guard
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    for i, (x, y) in enumerate(batches(5, "cpu")):
        assert hooks_of(guard) == 1, "no forward before the first step() learned the readers yet"
        losses = []
        for model in (ours, theirs):
            loss = loss_of(model, x, y)
            loss.backward()
            # A second forward before step() (an evaluation, a micro-batch) reads the same weights.
            losses.append((loss.item(), loss_of(model, x, y).item()))
        assert losses[0] == pytest.approx(losses[1], abs=1e-6, rel=0)
        if i >= 2:  # the readers were learned in the first windows
            assert hooks_of(guard) == 0 and not guard.installed
        opt.step()
        torch_opt.step()
        assert hooks_of(guard) == 1
        opt.zero_grad()
        torch_opt.zero_grad()
    opt.synchronize()
    assert_close(ours, theirs, 1e-6)


def test_a_forward_waits_module_by_module_once_its_modules_are_learned():
    """A module's first call in a context moves its params out of its ancestors' readers;
    the hook stays on through such a forward, so the next forward of the whole model waits
    for each module's params at that module (a's first, c's later), not all at its root."""
    ours, theirs = twins("cpu")
    data = batches(4, "cpu")
    opt = _without_lander(StreamedOnHost(ours.parameters(), lr=1e-2))
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    train(ours, opt, data[:2])
    train(theirs, torch_opt, data[:2])
    x, y = data[2]
    for model, o in ((ours, opt), (theirs, torch_opt)):
        loss_of(model, x, y).backward()
        o.step()
        o.zero_grad()
    stale_at_a = []
    ours.a.register_forward_pre_hook(
        lambda module, args: stale_at_a.append((ours.c.weight - theirs.c.weight).abs().max().item() > 1e-4)
    )
    loss_of(ours, x, y)
    assert stale_at_a == [True], "c's weights arrived before a's forward"
    assert_close(ours, theirs, 1e-6)


class SleepInBackward(torch.autograd.Function):
    """Identity; its backward holds the GPU for about a second before the gradients of the
    layers in front of it are computed."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(2_000_000_000)
        return grad


@pytest.mark.gpu
def test_on_a_gpu_an_update_is_queued_while_backward_still_computes_earlier_gradients(monkeypatch):
    """step() is called while the GPU is still in backward: the update of the last layer,
    whose gradient has landed, is queued while the first layer's gradient is not computed yet
    (the GPU is held between them), and the result is torch's."""
    import trainstream.ops

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16)).cuda()
    theirs = copy.deepcopy(ours)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(8, 64, device="cuda")
    jobs = []
    adamw_step = trainstream.ops.adamw_step

    def recording(params, *args, **kwargs):
        first = opt._host_updates.records[ours[0].weight]
        jobs.append(({tuple(p.shape) for p in params}, len(params), first.stage_event.query()))
        return adamw_step(params, *args, **kwargs)

    monkeypatch.setattr(trainstream.ops, "adamw_step", recording)
    for model, o in ((ours, opt), (theirs, torch_opt)):
        model[1](SleepInBackward.apply(model[0](x))).square().mean().backward()
        o.step()
        o.zero_grad()
    last_layer = {(16, 32), (16,)}
    assert jobs[0][0] <= last_layer, jobs  # the last layer's weight and bias come first
    assert jobs[0][2] is False, "the last layer's update waited for the first layer's gradient"
    assert sum(n for _, n, _ in jobs) == 4
    opt.synchronize()
    assert_close(ours, theirs, TOL["cuda"])
