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


# -- the hooks' host work per step (issue 23): counted, never timed ---------------------------------

BLOCKS = 28


def _lora_llama(quantize, device="cpu", **options):
    """A 28-block Llama (tiny widths) with peft's LoRA r=2 on the 7 block Linears: the adapters
    are about 5% of the parameters, so they train as device state, as the issue's 3B run does;
    wrapped with its weights resident, quantized or not, and a step function."""
    peft = pytest.importorskip("peft")
    from hf_models import batch, build, loss_fn

    torch.manual_seed(0)
    model = build("llama", num_hidden_layers=BLOCKS)
    config = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        lora_dropout=0.0,
        bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = peft.get_peft_model(model, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    options = {**RESIDENT, **options}
    model, opt = trainstream.wrap(model, opt, device=device, offload=True, quantize=quantize, **options)
    engine = model._trainstream_engine
    assert engine.plan.device_state and len(engine.block_units) == BLOCKS

    def step(i):
        loss_fn(model, batch(i, device)).backward()
        opt.step()
        opt.zero_grad()

    for i in range(4):  # past the measured and timed passes and the settling replans
        step(i)
    return engine, step


def _counting(monkeypatch, owner, name, counts):
    """Count the reads of property `owner.name` (its getter runs as before)."""
    getter = getattr(owner, name).fget

    def counted(self):
        counts[name] = counts.get(name, 0) + 1
        return getter(self)

    monkeypatch.setattr(owner, name, property(counted))


def test_a_lora_step_reads_what_each_unit_streams_a_few_times_per_block(monkeypatch):
    """What a unit streams changes only with the plan: the hooks read it a few times per block,
    not once per block and unit (whether backward marks the blocks was decided by asking every
    block at every block's end: 954 reads of Unit.streamed per step here, each a pass over the
    unit's slots)."""
    from trainstream.engine.layout import Unit

    _, step = _lora_llama(None)
    counts: dict = {}
    for name in ("streamed", "streamed_slots", "fetch_nbytes"):
        _counting(monkeypatch, Unit, name, counts)
    step(4)
    assert sum(counts.values()) <= 8 * BLOCKS, counts  # about 6 per block, each a cached value


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_a_lora_step_computes_no_units_views_again(monkeypatch, quantize):
    """Each read of what a unit streams is the cached Unit.views after the first step: none is
    made again while no plan field changes (every read was a pass over the unit's slots)."""
    from trainstream.engine import layout

    _, step = _lora_llama(quantize)
    made = []

    class Counted(layout.UnitViews):
        __slots__ = ()

        def __init__(self, unit):
            made.append(unit.name)
            super().__init__(unit)

    monkeypatch.setattr(layout, "UnitViews", Counted)
    step(4)
    assert made == []


def test_a_lora_step_reads_the_allocator_once_per_measuring_point(monkeypatch):
    """Each measuring point of the adapter (a block's start and end in forward; its backward's
    start, before and after the block above is let go) reads the allocator's counters once:
    a read costs tens of microseconds on a GPU, and 28 blocks read them 179 times a step when
    current and peak were two reads and a backward start read them three times. A stand-in
    backend that counts its reads (the CPU backend reads nothing). The base is quantized, so
    every block is dequantized for each use and backward marks each block's start."""
    engine, step = _lora_llama("nf4")
    adapter = engine.adapter

    class CountingBackend:
        is_cuda = True

        def __init__(self, real):
            self.real, self.reads = real, 0

        def __getattr__(self, name):
            return getattr(self.real, name)

        def allocated(self):
            self.reads += 1
            return {"current": 0, "peak": 0}

    counting = CountingBackend(adapter.backend)
    monkeypatch.setattr(adapter, "backend", counting)
    step(4)
    assert 4 * BLOCKS <= counting.reads <= 4 * BLOCKS + 12, counting.reads


def test_backward_marks_the_blocks_once_a_unit_leaves_the_device_between_steps():
    """Whether backward marks each block (block_backward_starts) is decided again when a unit's
    plan fields change: a resident LoRA step marks none; once a block pages its activations
    (as the guard or a replan sets it) every block's backward start is marked from the next
    pass on, and its paged activations come back through it."""
    engine, step = _lora_llama(None, min_offload_bytes=0)
    calls = []
    real = engine.block_backward_starts
    engine.block_backward_starts = lambda unit: (calls.append(unit.block), real(unit))[1]
    step(4)
    assert not calls and not engine.marks_blocks()
    engine.acts.page(engine.block_units[5], True)
    paged_before = engine.acts.paged_bytes
    step(5)
    assert sorted(calls) == list(range(BLOCKS))
    assert engine.acts.paged_bytes > paged_before  # block 5's activations left and came back


@pytest.mark.gpu
def test_gpu_a_lora_step_reads_the_allocator_once_per_measuring_point(monkeypatch):
    """On CUDA: the reads of the allocator's counters in a warm resident NF4 LoRA step, four
    per block (forward's start and end, backward's start before and after the block above is
    let go) and a few per pass."""
    from trainstream.engine.device import Backend

    engine, step = _lora_llama("nf4", device="cuda")
    reads = []
    real = Backend.allocated

    def allocated(self):
        reads.append(1)
        return real(self)

    monkeypatch.setattr(Backend, "allocated", allocated)
    step(4)
    torch.cuda.synchronize()
    assert 4 * BLOCKS <= len(reads) <= 4 * BLOCKS + 12, len(reads)
