"""trainstream.OffloadAdamW as a drop-in for torch.optim.AdamW on CPU parameters."""

import copy

import pytest
import torch

import trainstream
from trainstream import OffloadAdamW, options

TOL = 1e-6


class OddModel(torch.nn.Module):
    """Layer sizes with odd tails (not multiples of any vector width or chunk)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(37, 129)
        self.b = torch.nn.Linear(129, 61)
        self.c = torch.nn.Linear(61, 3, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 37, generator=gen), torch.randn(16, 3, generator=gen)) for _ in range(n)]


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def train(model, opt, data, *, clip=None, accumulate=1, scheduler=None):
    for i, (x, y) in enumerate(data):
        loss_of(model, x, y).backward()
        if accumulate > 1 and not isinstance(opt, OffloadAdamW):
            if (i + 1) % accumulate:
                continue
            for p in model.parameters():
                p.grad /= accumulate
        if clip is not None and not isinstance(opt, OffloadAdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def max_diff(m1, m2):
    return max((a - b).abs().max().item() for a, b in zip(m1.parameters(), m2.parameters()))


def twin_models():
    model = OddModel()
    return model, copy.deepcopy(model)


def groups_of(model, lr=1e-2, wd_a=0.1, wd_rest=0.0):
    return [
        {"params": model.a.parameters(), "weight_decay": wd_a},
        {"params": list(model.b.parameters()) + list(model.c.parameters()), "weight_decay": wd_rest, "lr": lr / 3},
    ]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw_after_20_steps(weight_decay):
    ours, theirs = twin_models()
    data = batches(20)
    train(ours, OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=weight_decay), data)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=weight_decay, foreach=False), data)
    assert max_diff(ours, theirs) <= TOL


def test_two_param_groups_with_their_own_lr_and_decay():
    ours, theirs = twin_models()
    data = batches(20)
    opt = OffloadAdamW(groups_of(ours), lr=1e-2)
    train(ours, opt, data)
    train(theirs, torch.optim.AdamW(groups_of(theirs), lr=1e-2, foreach=False), data)
    assert max_diff(ours, theirs) <= TOL
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-2 / 3)


def test_adam_mode_matches_torch_adam():
    ours, theirs = twin_models()
    data = batches(20)
    train(ours, OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.05, decoupled_weight_decay=False), data)
    train(theirs, torch.optim.Adam(theirs.parameters(), lr=1e-2, weight_decay=0.05, foreach=False), data)
    assert max_diff(ours, theirs) <= TOL


def test_custom_betas_and_eps():
    ours, theirs = twin_models()
    data = batches(20)
    kw = dict(lr=5e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.02)
    train(ours, OffloadAdamW(ours.parameters(), **kw), data)
    train(theirs, torch.optim.AdamW(theirs.parameters(), foreach=False, **kw), data)
    assert max_diff(ours, theirs) <= TOL


def test_gradient_clipping_matches_clip_grad_norm():
    ours, theirs = twin_models()
    data = batches(20)
    train(ours, OffloadAdamW(ours.parameters(), lr=1e-2, max_grad_norm=0.05), data)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False), data, clip=0.05)
    assert max_diff(ours, theirs) <= TOL
    # The clip must have been active for this test to mean anything.
    unclipped, _ = twin_models()
    train(unclipped, torch.optim.AdamW(unclipped.parameters(), lr=1e-2), data)
    assert max_diff(unclipped, theirs) > 1e-3


def test_accumulation_matches_mean_of_micro_batch_gradients():
    ours, theirs = twin_models()
    data = batches(40)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, accumulation_steps=4)
    before = [p.detach().clone() for p in ours.parameters()]
    loss_of(ours, *data[0]).backward()
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters())), "a micro-step moved weights"
    train(ours, opt, data[1:4])  # completes the first window
    train(ours, opt, data[4:])
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False), data, accumulate=4)
    assert max_diff(ours, theirs) <= TOL


def test_accumulation_with_clipping():
    ours, theirs = twin_models()
    data = batches(24)
    train(ours, OffloadAdamW(ours.parameters(), lr=1e-2, accumulation_steps=3, max_grad_norm=0.05), data)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False), data, accumulate=3, clip=0.05)
    assert max_diff(ours, theirs) <= TOL


def test_lr_scheduler_is_read_every_step():
    ours, theirs = twin_models()
    data = batches(20)
    opt_a = OffloadAdamW(ours.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    train(ours, opt_a, data, scheduler=torch.optim.lr_scheduler.StepLR(opt_a, step_size=3, gamma=0.5))
    train(theirs, opt_b, data, scheduler=torch.optim.lr_scheduler.StepLR(opt_b, step_size=3, gamma=0.5))
    assert max_diff(ours, theirs) <= TOL
    assert opt_a.param_groups[0]["lr"] == pytest.approx(opt_b.param_groups[0]["lr"])


def test_params_without_grad_are_skipped_like_torch():
    ours, theirs = twin_models()
    ours.c.weight.requires_grad_(False)
    theirs.c.weight.requires_grad_(False)
    data = batches(5)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    train(ours, opt, data)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False), data)
    assert max_diff(ours, theirs) <= TOL
    assert ours.c.weight not in opt.state


def test_closure_is_called_and_its_loss_returned():
    model, _ = twin_models()
    opt = OffloadAdamW(model.parameters())
    x, y = batches(1)[0]
    before = model.a.weight.detach().clone()
    calls = []

    def closure():
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        calls.append(loss)
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and loss is calls[0]
    assert not torch.equal(before, model.a.weight)


def test_state_dict_loads_into_torch_adamw_and_continues_identically():
    ours, theirs = twin_models()
    data = batches(20)
    opt = OffloadAdamW(groups_of(ours), lr=1e-2)
    train(ours, opt, data[:10])
    sd = copy.deepcopy(opt.state_dict())  # as a checkpoint would: state_dict() shares tensors
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].item() == 10
    # Continue in torch from our state, and in ours; both must agree.
    theirs.load_state_dict(ours.state_dict())
    torch_opt = torch.optim.AdamW(groups_of(theirs), lr=1e-2, foreach=False)
    torch_opt.load_state_dict(sd)
    train(ours, opt, data[10:])
    train(theirs, torch_opt, data[10:])
    assert max_diff(ours, theirs) <= TOL


def test_loads_a_torch_adamw_state_dict():
    ours, theirs = twin_models()
    data = batches(20)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    train(theirs, torch_opt, data[:10])
    ours.load_state_dict(theirs.state_dict())
    opt = OffloadAdamW(ours.parameters(), lr=1.0)  # hyper-parameters come from the state dict
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    train(ours, opt, data[10:])
    train(theirs, torch_opt, data[10:])
    assert max_diff(ours, theirs) <= TOL


def test_state_dict_round_trip_with_bf16_moments():
    model, twin = twin_models()
    data = batches(6)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, moment_dtype="bfloat16", seed=7)
    train(model, opt, data[:3])
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["exp_avg"].dtype == torch.bfloat16
    twin.load_state_dict(model.state_dict())
    opt2 = OffloadAdamW(twin.parameters(), lr=1e-2, moment_dtype="bfloat16", seed=7)
    opt2.load_state_dict(sd)
    assert opt2.state[next(twin.parameters())]["exp_avg"].dtype == torch.bfloat16
    train(model, opt, data[3:])
    train(twin, opt2, data[3:])
    assert max_diff(model, twin) == 0.0  # same seed and steps: the same bits


def test_bf16_moments_resume_with_the_saved_seed_not_the_new_optimizers():
    """The stochastic-rounding seed is part of the state_dict: an optimizer built with
    another seed (another torch.initial_seed()) continues with the saved one's bits."""
    model, twin = twin_models()
    data = batches(6)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, moment_dtype="bfloat16", seed=7)
    train(model, opt, data[:3])
    twin.load_state_dict(model.state_dict())
    opt2 = OffloadAdamW(twin.parameters(), lr=1e-2, moment_dtype="bfloat16", seed=8)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.seed == 7
    train(model, opt, data[3:])
    train(twin, opt2, data[3:])
    assert max_diff(model, twin) == 0.0


def test_torch_adamw_can_load_bf16_moment_state():
    model, twin = twin_models()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, moment_dtype="bf16")
    train(model, opt, batches(3))
    torch_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    state = torch_opt.state[next(twin.parameters())]
    assert state["exp_avg"].dtype == torch.float32  # torch casts to the parameter's dtype


def test_bf16_moments_train_like_fp32():
    # A small linear regression: bf16 moments with stochastic rounding reach the same loss.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 64, generator=gen)
    w_true = torch.randn(64, 1, generator=gen)
    y = x @ w_true + 0.01 * torch.randn(512, 1, generator=gen)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 1)
        opt = OffloadAdamW(lin.parameters(), lr=3e-2, weight_decay=0.0, moment_dtype=dtype)
        for _ in range(300):
            loss = torch.nn.functional.mse_loss(lin(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[dtype] = torch.nn.functional.mse_loss(lin(x), y).item()
    start = torch.nn.functional.mse_loss(torch.zeros_like(y), y).item()
    assert losses["float32"] < start * 1e-3
    assert losses["bfloat16"] < start * 1e-3
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.5 * losses["float32"] + 1e-4


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_thread_count_does_not_change_results(threads, monkeypatch):
    # More workers than a small test machine's cores is refused as an option; the pool itself
    # runs any count, so the option check is told of enough cores to pass 5 through.
    cores = max(threads, options.available_cores())
    monkeypatch.setattr(options, "available_cores", lambda: cores)
    model, twin = twin_models()
    data = batches(5)
    train(model, OffloadAdamW(model.parameters(), lr=1e-2, moment_dtype="bfloat16", seed=1, threads=1), data)
    train(twin, OffloadAdamW(twin.parameters(), lr=1e-2, moment_dtype="bfloat16", seed=1, threads=threads), data)
    assert max_diff(model, twin) == 0.0


THREADS_ACCEPTED = r"None, an integer from 1 to the number of cores this process may use \(\d+ here\)$"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(amsgrad=True), r"does not support amsgrad=True \(accepted: False\)"),
        (dict(maximize=True), r"does not support maximize=True"),
        (dict(capturable=True), r"does not support capturable=True"),
        (dict(differentiable=True), r"does not support differentiable=True"),
        (dict(lr=-1.0), r"OffloadAdamW\(\): option 'lr' got -1.0; accepted: a float >= 0"),
        (dict(betas=(0.9, 1.0)), r"option 'betas' got \(0.9, 1.0\); accepted: a pair of floats in \[0, 1\)"),
        (dict(betas=(0.9,)), r"option 'betas' got \(0.9,\); accepted: a pair"),
        (dict(eps=-1e-8), r"option 'eps' got -1e-08; accepted: a float >= 0"),
        (dict(weight_decay=-0.1), r"option 'weight_decay' got -0.1; accepted: a float >= 0"),
        (dict(mode="tpu"), r"option 'mode' got 'tpu'; accepted: 'cpu', 'gpu'$"),
        (dict(mode="auto"), r"option 'mode' got 'auto'; accepted: 'cpu', 'gpu'$"),
        (
            dict(moment_dtype="float16"),
            r"option 'moment_dtype' got 'float16'; accepted: 'float32', 'fp32', torch.float32, 'bfloat16', 'bf16', torch.bfloat16$",
        ),
        (dict(moment_dtype="auto"), r"option 'moment_dtype' got 'auto'; accepted: 'float32', 'fp32'"),
        (dict(moment_dtype=torch.float16), r"option 'moment_dtype' got torch.float16; accepted: 'float32'"),
        (dict(max_grad_norm=0.0), r"option 'max_grad_norm' got 0.0; accepted: None, a float > 0"),
        (dict(max_grad_norm="1"), r"option 'max_grad_norm' got '1'; accepted: None, a float > 0"),
        (dict(accumulation_steps=0), r"option 'accumulation_steps' got 0; accepted: an integer >= 1"),
        (dict(accumulation_steps=2.0), r"option 'accumulation_steps' got 2.0; accepted: an integer >= 1"),
        (dict(threads=0), rf"option 'threads' got 0; accepted: {THREADS_ACCEPTED}"),
        (dict(threads=True), rf"option 'threads' got True; accepted: {THREADS_ACCEPTED}"),
        (dict(threads=1.5), rf"option 'threads' got 1.5; accepted: {THREADS_ACCEPTED}"),
        (dict(threads=100000), rf"option 'threads' got 100000; accepted: {THREADS_ACCEPTED}"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        OffloadAdamW(torch.nn.Linear(3, 3).parameters(), **kwargs)
    assert str(err.value).startswith(("OffloadAdamW(): option ", "OffloadAdamW does not support "))


@pytest.mark.parametrize(
    "spelling, dtype",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        (torch.float32, torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_moment_dtype_takes_every_spelling_of_the_specification(spelling, dtype):
    assert OffloadAdamW(torch.nn.Linear(2, 2).parameters(), moment_dtype=spelling).moment_dtype == dtype


def test_threads_take_every_core_and_stay_unresolved_until_the_pool():
    cores = options.available_cores()
    assert OffloadAdamW(torch.nn.Linear(2, 2).parameters(), threads=cores).threads == cores
    assert OffloadAdamW(torch.nn.Linear(2, 2).parameters()).threads is None  # ops.get_pool resolves it


# Hyper-parameter values torch.optim.AdamW accepts or refuses; OffloadAdamW agrees on each.
TORCH_HYPERPARAMETERS = [
    dict(lr=0.0),
    dict(lr=-1e-3),
    dict(lr=float("nan")),
    dict(lr=float("inf")),
    dict(lr=torch.tensor(1e-3)),
    dict(lr=torch.tensor(-1e-3)),
    dict(lr=torch.tensor([1e-3, 1e-3])),
    dict(betas=(0.0, 0.0)),
    dict(betas=(0.9, 0.999)),
    dict(betas=(1.0, 0.9)),
    dict(betas=(0.9, 1.0)),
    dict(betas=(-0.1, 0.9)),
    dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
    dict(eps=0.0),
    dict(eps=-1e-8),
    dict(weight_decay=0.0),
    dict(weight_decay=-0.1),
]


@pytest.mark.parametrize("hyper", TORCH_HYPERPARAMETERS, ids=repr)
def test_hyperparameters_are_refused_where_torch_refuses_them(hyper):
    def refuses(make) -> bool:
        try:
            make(torch.nn.Linear(2, 2).parameters(), **hyper)
        except ValueError:
            return True
        return False

    assert refuses(OffloadAdamW) == refuses(torch.optim.AdamW)


def test_tensor_betas_are_held_as_floats_as_torch_holds_them():
    betas = (torch.tensor(0.8), torch.tensor(0.95))
    ours = OffloadAdamW(torch.nn.Linear(2, 2).parameters(), betas=betas)
    theirs = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), betas=betas)
    assert ours.param_groups[0]["betas"] == theirs.param_groups[0]["betas"] == (0.800000011920929, 0.949999988079071)


def test_parameter_errors():
    with pytest.raises(ValueError, match="needs float32 parameters"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="contiguous"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4, 4).t())])
    with pytest.raises(ValueError, match=r"amsgrad=True"):
        OffloadAdamW([{"params": torch.nn.Linear(2, 2).parameters(), "amsgrad": True}])
    with pytest.raises(
        ValueError, match=r"^OffloadAdamW\(\) param group: option 'lr' got -3.0; accepted: a float >= 0"
    ):
        OffloadAdamW([{"params": torch.nn.Linear(2, 2).parameters(), "lr": -3.0}])
    with pytest.raises(ValueError, match=r"^OffloadAdamW\(\) param group: option 'betas' got \(1.0, 0.9\)"):
        OffloadAdamW([{"params": torch.nn.Linear(2, 2).parameters(), "betas": (1.0, 0.9)}])


def test_loading_an_amsgrad_state_dict_is_refused():
    lin = torch.nn.Linear(2, 2)
    torch_opt = torch.optim.AdamW(lin.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        OffloadAdamW(lin.parameters()).load_state_dict(torch_opt.state_dict())


def test_sparse_gradients_are_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        OffloadAdamW(emb.parameters()).step()


def test_exported_from_the_package():
    assert trainstream.OffloadAdamW is OffloadAdamW
    assert issubclass(OffloadAdamW, torch.optim.Optimizer)


def test_gpu_mode_without_a_usable_gpu_says_what_is_missing():
    if torch.cuda.is_available():
        pytest.skip("a GPU is usable here")
    with pytest.raises(RuntimeError, match=r"OffloadAdamW\(mode='gpu'\) needs a CUDA GPU"):
        OffloadAdamW(torch.nn.Linear(2, 2).parameters(), mode="gpu")


@pytest.mark.gpu
def test_mode_and_parameter_device_must_agree():
    # mode="cpu" takes GPU parameters too (tests/test_offload_adamw_cuda.py); mode="gpu" only those.
    assert OffloadAdamW(torch.nn.Linear(2, 2).cuda().parameters())._host_updates is not None
    with pytest.raises(
        ValueError,
        match=r"mode='gpu'\) updates parameters on a GPU; parameter 0 of param group 0 \(shape \(2, 2\)\) is on cpu",
    ):
        OffloadAdamW(torch.nn.Linear(2, 2).parameters(), mode="gpu")


def cuda_twins():
    model = OddModel().cuda()
    return model, copy.deepcopy(model)


def cuda_batches(n):
    return [(x.cuda(), y.cuda()) for x, y in batches(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_gpu_mode_matches_torch_adamw_after_20_steps(weight_decay):
    ours, theirs = cuda_twins()
    data = cuda_batches(20)
    opt = OffloadAdamW(groups_of(ours, wd_a=weight_decay), lr=1e-2, mode="gpu")
    train(ours, opt, data)
    train(theirs, torch.optim.AdamW(groups_of(theirs, wd_a=weight_decay), lr=1e-2, foreach=False), data)
    assert max_diff(ours, theirs) <= TOL
    state = opt.state[ours.a.weight]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()


@pytest.mark.gpu
def test_gpu_mode_equals_cpu_mode_bit_for_bit():
    # The same update on the host and on the GPU: identical weights, bf16 moments included.
    for moment_dtype in ("float32", "bfloat16"):
        gpu_model, _ = cuda_twins()
        cpu_model = copy.deepcopy(gpu_model).cpu()
        gpu_opt = OffloadAdamW(gpu_model.parameters(), lr=1e-2, mode="gpu", moment_dtype=moment_dtype, seed=3)
        cpu_opt = OffloadAdamW(cpu_model.parameters(), lr=1e-2, mode="cpu", moment_dtype=moment_dtype, seed=3)
        for x, y in batches(8):
            loss_of(gpu_model, x.cuda(), y.cuda()).backward()
            for pg, pc in zip(gpu_model.parameters(), cpu_model.parameters()):
                pc.grad = pg.grad.cpu()  # identical gradients on both sides
            gpu_opt.step()
            gpu_opt.zero_grad()
            cpu_opt.step()
            cpu_opt.zero_grad()
        for pg, pc in zip(gpu_model.parameters(), cpu_model.parameters()):
            assert torch.equal(pg.cpu(), pc), moment_dtype


@pytest.mark.gpu
def test_gpu_mode_clipping_and_accumulation_match_torch():
    ours, theirs = cuda_twins()
    data = cuda_batches(24)
    train(ours, OffloadAdamW(ours.parameters(), lr=1e-2, mode="gpu", accumulation_steps=3, max_grad_norm=0.05), data)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False), data, accumulate=3, clip=0.05)
    assert max_diff(ours, theirs) <= TOL


@pytest.mark.gpu
def test_gpu_mode_state_dict_round_trip_with_torch():
    ours, theirs = cuda_twins()
    data = cuda_batches(20)
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, mode="gpu")
    train(ours, opt, data[:10])
    sd = copy.deepcopy(opt.state_dict())
    theirs.load_state_dict(ours.state_dict())
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    torch_opt.load_state_dict(sd)
    train(ours, opt, data[10:])
    train(theirs, torch_opt, data[10:])
    assert max_diff(ours, theirs) <= TOL
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.state[ours.a.weight]["exp_avg"].is_pinned()


def test_loading_a_state_dict_without_the_decay_flag_keeps_the_constructors_choice():
    ours, theirs = twin_models()
    data = batches(6)
    torch_opt = torch.optim.Adam(theirs.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    train(theirs, torch_opt, data[:3])
    sd = copy.deepcopy(torch_opt.state_dict())
    for g in sd["param_groups"]:
        g.pop("decoupled_weight_decay", None)  # as older torch versions wrote it
    ours.load_state_dict(theirs.state_dict())
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, weight_decay=0.05, decoupled_weight_decay=False)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["decoupled_weight_decay"] is False
    train(ours, opt, data[3:])
    train(theirs, torch_opt, data[3:])
    assert max_diff(ours, theirs) <= TOL


@pytest.mark.gpu
def test_gpu_mode_with_an_empty_parameter_and_a_side_stream():
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "empty": torch.nn.Linear(8, 0)}).cuda()
    opt = OffloadAdamW(model.parameters(), lr=1e-2, mode="gpu")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x = torch.randn(4, 8, device="cuda")
        (model["a"](x).sum() + model["empty"](x).sum()).backward()
        opt.step()
    sd = opt.state_dict()  # must wait for the side stream's kernel, not only the current stream
    s.synchronize()
    assert torch.equal(sd["state"][0]["exp_avg"], opt.state[model["a"].weight]["exp_avg"])
    assert sd["state"][0]["exp_avg"].abs().sum() > 0


def test_a_parameter_listed_twice_in_a_group_is_refused():
    """torch warns and updates such a parameter twice; here updates are per parameter, so it
    is refused, by OffloadAdamW and by wrap() converting a torch optimizer."""
    import warnings

    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"param group: parameter 1 \(shape \(3, 3\)\) is listed twice"):
        OffloadAdamW([model.weight, model.weight, model.bias])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning for the duplicate
        doubled = torch.optim.AdamW([model.weight, model.bias, model.weight])
    with pytest.raises(ValueError, match=r"parameter 2 \(shape \(3, 3\)\) is listed twice"):
        trainstream.wrap(model, doubled, device="cpu")
    assert not hasattr(model, "_trainstream_engine")


@pytest.mark.gpu
def test_gpu_synchronize_waits_for_the_step_kernels():
    """optimizer.synchronize() (SPEC.md): a gpu-mode step() returns with its kernels queued on
    the current stream; after synchronize() the host sees the new weights, read from another
    stream too, equal to torch AdamW's."""
    ours, theirs = cuda_twins()
    opt = OffloadAdamW(ours.parameters(), lr=1e-2, mode="gpu")
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    x, y = batches(1)[0]
    # The reference steps first and is waited for alone: only our kernels can still be queued.
    loss_of(theirs, x.cuda(), y.cuda()).backward()
    ref.step()
    torch.cuda.current_stream().synchronize()
    loss_of(ours, x.cuda(), y.cuda()).backward()
    opt.step()
    opt.synchronize()
    assert opt._inflight == []
    with torch.cuda.stream(torch.cuda.Stream()):
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert (p.detach() - q.detach()).abs().max().item() < TOL


def test_synchronize_in_cpu_mode_returns_with_the_weights_current():
    """A cpu-mode step() has finished when it returns; synchronize() exists all the same (the
    contract is the same in both modes) and changes nothing."""
    model = OddModel()
    reference = copy.deepcopy(model)
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    x, y = batches(1)[0]
    for m, o in ((model, opt), (reference, ref)):
        loss_of(m, x, y).backward()
        o.step()
    opt.synchronize()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.detach() - q.detach()).abs().max().item() < TOL
