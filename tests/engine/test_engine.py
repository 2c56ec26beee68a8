"""The engine as a whole on the CPU path (device="cpu": the same hooks and bookkeeping as
on a GPU, with streams as no-ops) and, for tests marked gpu, on CUDA: paging is bit-exact,
wrapped training matches torch's AdamW, a wrapped model is freed."""

import gc

import pytest
import torch
from helpers import PAGED, RESIDENT, assert_same_bits, collected, cuda_bytes_held, live_cuda_tensors, max_diff, train
from models import tiny_gpt, tiny_mlp

import trainstream

CPU_MODELS = ["gpt", "mlp", "llama", "qwen2"]


@pytest.mark.parametrize("name", CPU_MODELS)
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_paging_is_bit_exact(name, autocast):
    resident = train(name, RESIDENT, autocast=autocast)
    paged = train(name, PAGED, autocast=autocast)
    assert_same_bits(resident, paged)
    report = trainstream.memory_report(paged[2][0])
    assert report["params"]["paged_blocks"] and report["paged_activation_bytes"] > 0


@pytest.mark.parametrize(
    "opts",
    [dict(accumulation=3), dict(clip=0.05), dict(accumulation=2, clip=0.05)],
    ids=["accumulation", "clip", "accumulation+clip"],
)
def test_paging_bit_exact_with_clipping_and_accumulation(opts):
    assert_same_bits(train("gpt", RESIDENT, steps=4, **opts), train("gpt", PAGED, steps=4, **opts))


def test_paging_bit_exact_bf16_model_and_frozen_params():
    frozen = lambda n: n.endswith("fc.weight")  # noqa: E731  (a LoRA-like mix of frozen and trained)
    for dtype in (torch.float32, torch.bfloat16):
        a = train("gpt", RESIDENT, steps=4, dtype=dtype, freeze=frozen)
        b = train("gpt", PAGED, steps=4, dtype=dtype, freeze=frozen)
        assert_same_bits(a, b)
    assert a[0][-1] < a[0][0]


@pytest.mark.parametrize(
    "opts",
    [{}, dict(clip=0.05), dict(accumulation=3), dict(accumulation=2, clip=0.05)],
    ids=["plain", "clip", "accumulation", "accumulation+clip"],
)
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_matches_torch_adamw(name, opts):
    stock = train(name, None, **opts)
    wrapped = train(name, PAGED, **opts)
    assert max_diff(stock[1], wrapped[1]) < 5e-5  # lr 1e-2 for 10 steps; the update itself matches to ~1e-7
    assert wrapped[0] == pytest.approx(stock[0], rel=1e-4, abs=1e-5)
    if opts.get("clip"):
        assert wrapped[2][0]._trainstream_engine.last_grad_norm > opts["clip"]  # clipping was active


def test_a_no_grad_forward_between_forward_and_backward():
    """An fp32 evaluation forward after an autocast forward must not change what the
    pending backward sees (its weights were fetched in bf16)."""
    runs = []
    for opts in (RESIDENT, PAGED):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **opts)
        losses = []
        for i in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model, batch(i, "cpu"))
            with torch.no_grad():
                losses.append(loss_fn(model, batch(100 + i, "cpu")).item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    assert_same_bits(runs[0], runs[1])


@pytest.mark.parametrize("opts", [RESIDENT, PAGED, {}], ids=["resident", "paged", "auto"])
def test_a_deleted_wrapped_model_is_freed(opts):
    """Hooks torch keeps in C++ (invisible to the cycle collector) must not hold the engine:
    otherwise every model wrapped in a process keeps its device memory until exit."""
    import weakref

    _, _, (model, opt) = train("mlp", opts, steps=3)
    refs = [weakref.ref(model), weakref.ref(model._trainstream_engine), *map(weakref.ref, model.parameters())]
    del model, opt
    assert collected(lambda: all(r() is None for r in refs))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gpu_paging_is_bit_exact(name, autocast):
    resident = train(name, RESIDENT, device="cuda", autocast=autocast)
    paged = train(name, PAGED, device="cuda", autocast=autocast)
    assert_same_bits(resident, paged)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [RESIDENT, PAGED, dict(PAGED, max_inflight_bytes=1)], ids=["resident", "paged", "cap"])
def test_gpu_synchronization_stress(opts):
    """Tiny compute, large tensors: a missing wait on any stream shows up as a wrong number."""
    factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)  # noqa: E731
    stock = train("mlp", None, device="cuda", steps=8, lr=1e-3, model_factory=factory)
    wrapped = train("mlp", opts, device="cuda", steps=8, lr=1e-3, model_factory=factory)
    assert max_diff(stock[1], wrapped[1]) < 1e-5
    assert wrapped[0] == pytest.approx(stock[0], rel=1e-4)


@pytest.mark.gpu
def test_gpu_paging_lowers_the_peak():
    factory = lambda: tiny_mlp(layers=8, dim=2048, rows=512)  # noqa: E731
    peaks = {}
    trainstream.profile_hardware("cuda")  # measured (and cached) outside the peaks compared
    # The CPU outruns this tiny compute: without max_inflight_bytes holding it back, released
    # blocks and gradients waiting for their copies would pile up in VRAM.
    for label, opts in (
        ("resident", RESIDENT),
        ("paged", dict(PAGED, min_offload_bytes=1 << 20, max_inflight_bytes=40 << 20)),
    ):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # What this run adds: earlier tests in the process may leave tensors allocated (on the
        # H200 a pytest run started this test with 100-240 MB held that a lone run did not).
        before = torch.cuda.memory_allocated()
        train("mlp", opts, device="cuda", steps=3, lr=1e-3, model_factory=factory)
        peaks[label] = torch.cuda.max_memory_allocated() - before
    weights = 8 * 2048 * 2048 * 4
    # Resident: all weights plus gradient transients; paged: about two blocks plus transfers.
    assert peaks["paged"] < peaks["resident"] - 0.5 * weights, peaks


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [RESIDENT, PAGED], ids=["resident", "paged"])
def test_gpu_a_deleted_wrapped_model_frees_its_device_memory(opts):
    gc.collect()
    before = cuda_bytes_held()
    factory = lambda: tiny_mlp(layers=4, dim=1024, rows=64)  # noqa: E731
    _, _, (model, opt) = train("mlp", opts, device="cuda", steps=3, model_factory=factory)
    del model, opt
    freed = collected(lambda: cuda_bytes_held() - before < (1 << 20))
    assert freed, (before, cuda_bytes_held(), live_cuda_tensors())


def test_a_step_interrupted_before_its_updates_are_queued_applies_them_when_retried(monkeypatch):
    """With clipping every update waits for step(). If step() raises before it has queued
    them (a KeyboardInterrupt, an allocation failing), the window's units stay pending: the
    retried step() applies the same updates an uninterrupted run does."""
    from trainstream.engine.updates import Updater

    queue, raised = Updater.queue, []

    def interrupted(self, unit, grad_scale=1.0):
        if not raised:
            raised.append(unit)
            raise KeyboardInterrupt
        return queue(self, unit, grad_scale)

    def run(interrupt: bool):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        model, opt = trainstream.wrap(model, None, lr=1e-2, device="cpu", offload=True, max_grad_norm=0.1, **RESIDENT)
        for i in range(3):
            loss_fn(model, batch(i, "cpu")).backward()
            if interrupt and i == 1:
                monkeypatch.setattr(Updater, "queue", interrupted)
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
                monkeypatch.setattr(Updater, "queue", queue)
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain, retried = run(False), run(True)
    for k in plain:
        assert_same_bits(plain[k], retried[k])


def test_a_wrapped_model_refuses_a_copy_or_a_pickle_at_once_and_allows_both_unwrapped():
    import copy
    import io

    from helpers import gpt_steps

    model, _ = gpt_steps("cpu", steps=1)
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*unwrap\(model\) first"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict\(\)"):
        torch.save(model, io.BytesIO())
    copy.deepcopy(model._trainstream_engine.opts)  # the options themselves copy
    trainstream.unwrap(model)
    twin = copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_bf16_moments_resume_bit_exactly_whatever_the_initial_seed():
    """The stochastic-rounding seed travels in optimizer.state_dict(): a run resumed in a
    process seeded otherwise gives the bits of the run that never stopped."""

    def run(steps, start=None, seed=0):
        torch.manual_seed(seed)  # torch.initial_seed(): the default rounding seed
        model, batch, loss_fn = tiny_gpt()
        if start is not None:
            model.load_state_dict(start[0])
        model, opt = trainstream.wrap(
            model, None, device="cpu", lr=1e-2, offload=True, moment_dtype="bfloat16", **RESIDENT
        )
        if start is not None:
            opt.load_state_dict(start[1])
        first = 0 if start is None else start[2]
        for i in range(first, first + steps):
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()
            opt.zero_grad()
        return (
            {k: v.clone() for k, v in model.state_dict().items()},
            opt.state_dict(),
            first + steps,
        )

    whole = run(4)
    half = run(2)
    resumed = run(2, start=half, seed=1234)
    assert_same_bits((None, resumed[0]), (None, whole[0]))
    for pid, st in whole[1]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_bits(resumed[1]["state"][pid][key], st[key])


@pytest.mark.parametrize("opts", [RESIDENT, dict(PAGED, min_offload_bytes=1 << 30)], ids=["resident", "paged"])
def test_a_forward_never_taken_backward_does_not_keep_the_model(opts):
    """A grad-enabled forward whose loss is dropped (an evaluation without no_grad, a step
    that failed before backward) under the engine's saved-tensor hooks (the measured first
    passes, streamed blocks): its graph, and the model with it, is freed."""
    import weakref

    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, **opts)
    loss = loss_fn(model, batch(0, "cpu"))
    del loss
    refs = [weakref.ref(model), weakref.ref(model._trainstream_engine)]
    del model, opt
    assert collected(lambda: all(r() is None for r in refs), timeout_s=3.0)
