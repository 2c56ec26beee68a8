"""The native host AdamW (trainstream.ops.adamw_step) against its pure-torch twin."""

import itertools

import pytest
import torch
from helpers import assert_same_bits, bits

from trainstream import _native, ops, options
from trainstream.ops import reference

C = _native.lib()
LEVELS = [
    lvl
    for lvl in ("scalar", "avx2", "avx512")
    if ("scalar", "avx2", "avx512").index(lvl) <= ("scalar", "avx2", "avx512").index(C.best_simd_level())
]


def make_state(n, grad_dtype=torch.float32, moment_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 0.1).to(moment_dtype)
    v = (torch.rand(n, generator=gen) * 0.01).to(moment_dtype)
    return p, g, m, v


def clone_all(*ts):
    return [t.clone() for t in ts]


HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_native_matches_reference_bit_for_bit(grad_dtype, moment_dtype, copy_dtype, decoupled):
    # Sizes with odd tails, one smaller than a vector and one spanning several chunks.
    sizes = [1, 7, 33, 1000, 70_001]
    native, ref = [], []
    for i, n in enumerate(sizes):
        state = make_state(n, grad_dtype, moment_dtype, seed=i)
        native.append(clone_all(*state))
        ref.append(clone_all(*state))
    copies = None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype) for n in sizes]
    ref_copies = None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype) for n in sizes]
    steps = [1, 2, 5, 17, 1000]
    seeds = [11, 12, 13, 14, 2**63 + 5]
    kw = dict(HYPER, decoupled=decoupled, grad_scale=0.75, seeds=seeds)
    ops.adamw_step(*[[s[k] for s in native] for k in range(4)], steps, param_copies=copies, **kw).wait()
    reference.adamw_step(*[[s[k] for s in ref] for k in range(4)], steps, param_copies=ref_copies, **kw)
    for i in range(len(sizes)):
        for k in (0, 2, 3):  # param, exp_avg, exp_avg_sq
            assert_same_bits(native[i][k], ref[i][k])
        if copies is not None:
            assert_same_bits(copies[i], ref_copies[i])
            # The copy is torch's own round-to-nearest-even conversion of the new weight.
            assert_same_bits(copies[i], native[i][0].to(copy_dtype))


def test_copy_conversion_special_values():
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.0,
            65520.0,
            1e6,
            -1e6,
            6e-8,
            3e-8,
            1e-5,
            -1e-7,
            2.0**-24,
            2.0**-25,
            1.5 * 2.0**-24,
            3.4e38,
            float("inf"),
            float("-inf"),
            float("nan"),
            -float("nan"),
            1.00390625,
            1.01171875,
        ]
    )
    n = specials.numel()
    # With lr=0 and no decay the update leaves the weight unchanged, so the copy is a pure conversion.
    for dtype in (torch.bfloat16, torch.float16):
        p = specials.clone()
        copy = torch.empty(n, dtype=dtype)
        ops.adamw_step(
            [p], [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)], [1], lr=0.0, param_copies=[copy]
        ).wait()
        expected = specials.to(dtype)
        nan = expected.isnan()
        assert torch.equal(copy.isnan(), nan)
        assert_same_bits(copy[~nan], expected[~nan])


@pytest.mark.parametrize("level", LEVELS)
def test_simd_levels_give_identical_bits(level):
    n = 50_017
    results = {}
    for lvl in ("scalar", level):
        C.set_simd_level(lvl)
        try:
            p, g, m, v = make_state(n, torch.bfloat16, torch.bfloat16)
            c = torch.empty(n, dtype=torch.float16)
            ops.adamw_step([p], [g], [m], [v], [4], seeds=[9], param_copies=[c], **HYPER).wait()
            results[lvl] = (p, m, v, c)
        finally:
            C.set_simd_level(C.best_simd_level())
    for a, b in zip(results["scalar"], results[level]):
        assert_same_bits(a, b)


def test_unsupported_simd_level_is_refused():
    order = ["scalar", "avx2", "avx512"]
    above = order[order.index(C.best_simd_level()) + 1 :]
    for lvl in above:
        with pytest.raises(ValueError, match="does not support SIMD level"):
            C.set_simd_level(lvl)
    with pytest.raises(ValueError, match="'scalar', 'avx2' or 'avx512'"):
        C.set_simd_level("sse9")


def test_thread_counts_give_identical_bits(monkeypatch):
    # threads is bounded by the cores; told of 7, a small test machine runs 7 workers too.
    cores = max(7, options.available_cores())
    monkeypatch.setattr(options, "available_cores", lambda: cores)
    sizes = [3, 100_000, 250_001]
    outs = []
    for threads in (1, 2, 7):
        tensors = [make_state(n, torch.float32, torch.bfloat16, seed=i) for i, n in enumerate(sizes)]
        ops.adamw_step(
            *[[t[k] for t in tensors] for k in range(4)], [3] * 3, seeds=[1, 2, 3], threads=threads, **HYPER
        ).wait()
        outs.append(tensors)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            for k in (0, 2, 3):
                assert_same_bits(a[k], b[k])


def test_stochastic_rounding_is_reproducible_and_seeded():
    def run(seed, step):
        p, g, m, v = make_state(10_000, torch.float32, torch.bfloat16)
        ops.adamw_step([p], [g], [m], [v], [step], seeds=[seed], **HYPER).wait()
        return m

    assert_same_bits(run(5, 3), run(5, 3))
    assert not torch.equal(bits(run(5, 3)), bits(run(6, 3)))
    assert not torch.equal(bits(run(5, 3)), bits(run(5, 4)))


def test_stochastic_rounding_is_unbiased():
    # beta1 = 0.5 and a zero first moment make the new exp_avg exactly g / 2 in fp32; stored
    # in bf16 with stochastic rounding, its mean over many elements must approach g / 2,
    # where round-to-nearest would be off by a fixed amount.
    n = 1 << 20
    value = 1.0 + 3.0 / 1024  # between two bf16 neighbours (spacing 1/128), 3/8 of the way up
    g = torch.full((n,), 2 * value)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    ops.adamw_step([torch.zeros(n)], [g], [m], [v], [1], lr=0.0, beta1=0.5, seeds=[123]).wait()
    stored = m.float()
    lo, hi = 1.0, 1.0 + 1.0 / 128
    assert set(stored.unique().tolist()) == {lo, hi}
    frac_up = (stored == hi).float().mean().item()
    assert abs(frac_up - 3.0 / 8) < 3e-3  # ~5 standard errors at n = 2^20
    rne_error = abs(value - torch.tensor(value).to(torch.bfloat16).float().item())
    assert abs(stored.double().mean().item() - value) < rne_error / 20


def test_stochastic_rounding_keeps_special_values():
    n = 8
    g = torch.tensor([0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3e38, -3e38])
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    ops.adamw_step([torch.zeros(n)], [g], [m], [v], [1], lr=0.0, beta1=0.0, seeds=[1]).wait()
    out = m.float()
    assert out[0] == 0 and out[1] == float("inf") and out[2] == -float("inf") and out[3].isnan()
    assert abs(out[4]) <= 2e-40 and abs(out[5]) <= 2e-40
    # 3e38 lies between the largest finite bf16 values: it may round up to inf, never to NaN,
    # and keeps its sign.
    assert not out[6:].isnan().any()
    assert out[6] > 2.9e38 and out[7] < -2.9e38


def test_queue_returns_before_work_and_orders_updates_of_one_tensor():
    n = 4_000_000
    p, g, m, v = make_state(n)
    ref = clone_all(p, g, m, v)
    # Several queued updates of the same tensors must apply in order: the result equals
    # three sequential reference steps.
    handles = [ops.adamw_step([p], [g], [m], [v], [s], threads=2, **HYPER) for s in (1, 2, 3)]
    for h in handles:
        h.wait()
        assert h.done()
    for s in (1, 2, 3):
        reference.adamw_step([ref[0]], [ref[1]], [ref[2]], [ref[3]], [s], **HYPER)
    assert_same_bits(p, ref[0])
    assert_same_bits(m, ref[2])


def test_priority_never_reorders_updates_of_one_tensor():
    n = 2_000_000
    p, g, m, v = make_state(n)
    ref = clone_all(p, g, m, v)
    # Later updates ask to run first; sharing buffers, they still run in queue order.
    handles = [ops.adamw_step([p], [g], [m], [v], [s], threads=2, priority=10 - s, **HYPER) for s in (1, 2, 3)]
    for h in handles:
        h.wait()
    for s in (1, 2, 3):
        reference.adamw_step([ref[0]], [ref[1]], [ref[2]], [ref[3]], [s], **HYPER)
    assert_same_bits(p, ref[0])
    assert_same_bits(m, ref[2])


def test_priority_picks_which_independent_job_runs_next():
    # One worker: the running job C finishes first; of the two queued meanwhile, the lower
    # number goes next. C is long enough (tens of ms) that A and B are both queued before it ends.
    states = {name: make_state(12_000_000 if name == "C" else 1_000_000, seed=i) for i, name in enumerate("CAB")}
    priority = {"C": 0, "A": 5, "B": 1}
    handles = {
        name: ops.adamw_step([t[0]], [t[1]], [t[2]], [t[3]], [1], threads=1, priority=priority[name], **HYPER)
        for name, t in states.items()
    }
    # Read once A, the last by priority, has finished: C and B must be done by then (a
    # scheduler running A earlier leaves one of them running). Not by polling all three in
    # turn: a poll descheduled between reading C and reading B sees B finish first (it did
    # once on a loaded 2-core CI machine); done() only turns true, so this read cannot.
    handles["A"].wait()
    assert handles["C"].done() and handles["B"].done()


def test_independent_jobs_run_concurrently_and_correctly():
    tensors = [make_state(300_000, seed=i) for i in range(6)]
    refs = [clone_all(*t) for t in tensors]
    handles = [ops.adamw_step([t[0]], [t[1]], [t[2]], [t[3]], [1], threads=2, **HYPER) for t in tensors]
    for h in handles:
        h.wait()
    for t, r in zip(tensors, refs):
        reference.adamw_step([r[0]], [r[1]], [r[2]], [r[3]], [1], **HYPER)
        assert_same_bits(t[0], r[0])


def test_empty_call_and_empty_tensor():
    ops.adamw_step([], [], [], [], [], lr=1e-3).wait()
    p, g, m, v = make_state(0)
    ops.adamw_step([p], [g], [m], [v], [1], lr=1e-3).wait()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(params=[torch.randn(4, dtype=torch.float64)]), "params dtype must be one of"),
        (dict(grads=[torch.randn(4, dtype=torch.float16)]), "grads dtype must be one of"),
        (dict(exp_avgs=[torch.zeros(4, dtype=torch.bfloat16)]), "same dtype"),
        (dict(grads=[torch.randn(5)]), r"grads\[0\] has 5 elements"),
        (dict(grads=[torch.randn(4, 2)[:, 0]]), r"grads\[0\] must be contiguous"),
        (dict(steps=[0]), r"steps\[0\] must be >= 1"),
        (dict(steps=[1, 2]), "steps has 2 entries"),
        (dict(param_copies=[torch.empty(4)]), "param_copies dtype must be one of"),
        (dict(threads=0), "threads must be None or an integer >= 1"),
    ],
)
def test_argument_errors(bad, match):
    args = dict(
        params=[torch.zeros(4)],
        grads=[torch.zeros(4)],
        exp_avgs=[torch.zeros(4)],
        exp_avg_sqs=[torch.zeros(4)],
        steps=[1],
    )
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ops.adamw_step(
            args.pop("params"),
            args.pop("grads"),
            args.pop("exp_avgs"),
            args.pop("exp_avg_sqs"),
            args.pop("steps"),
            lr=1e-3,
            **args,
        )


def test_reference_hash_matches_known_values():
    # lowbias32 values computed independently (pure Python, 32-bit wraparound).
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 0xFFFFFFFF, 0x12345678, 0x80000000]
    assert [reference.mix32(x) for x in xs] == [lowbias32(x) for x in xs]
    t = torch.tensor(xs, dtype=torch.int64)
    assert reference.mix32(t).tolist() == [lowbias32(x) for x in xs]


@pytest.mark.parametrize("step", [1, 10, 1000])
def test_bias_correction_at_many_steps(step):
    p, g, m, v = make_state(1024)
    r = clone_all(p, g, m, v)
    ops.adamw_step([p], [g], [m], [v], [step], **HYPER).wait()
    reference.adamw_step([r[0]], [r[1]], [r[2]], [r[3]], [step], **HYPER)
    assert_same_bits(p, r[0])


def test_many_small_tensors_in_one_call():
    sizes = [1 + (i * 37) % 300 for i in range(200)]
    ts = [make_state(n, seed=i) for i, n in enumerate(sizes)]
    rs = [clone_all(*t) for t in ts]
    ops.adamw_step(*[[t[k] for t in ts] for k in range(4)], [2] * len(ts), **HYPER).wait()
    reference.adamw_step(*[[t[k] for t in rs] for k in range(4)], [2] * len(rs), **HYPER)
    for t, r in itertools.zip_longest(ts, rs):
        assert_same_bits(t[0], r[0])


@pytest.mark.gpu
def test_pinned_host_buffers_and_the_weight_copy_the_gpu_receives():
    # The engine's path: state in pinned host memory, the bf16 copy written in the same
    # pass then sent to the GPU. The GPU must receive exactly the reference's rounding.
    n = 3_000_001
    p, g, m, v = (t.pin_memory() for t in make_state(n, torch.bfloat16, torch.bfloat16))
    copy = torch.empty(n, dtype=torch.bfloat16).pin_memory()
    r = clone_all(p, g, m, v)
    ops.adamw_step([p], [g], [m], [v], [2], seeds=[4], param_copies=[copy], **HYPER).wait()
    on_gpu = copy.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    reference.adamw_step([r[0]], [r[1]], [r[2]], [r[3]], [2], seeds=[4], **HYPER)
    assert_same_bits(p, r[0])
    assert_same_bits(m, r[2])
    assert_same_bits(on_gpu.cpu(), r[0].to(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_tensors_are_refused_with_a_clear_error():
    p = torch.zeros(4, device="cuda")
    with pytest.raises(ValueError, match=r"params\[0\] must be in host memory \(cpu\), got cuda:0"):
        ops.adamw_step([p], [p], [p], [p], [1], lr=1e-3)


def _gpu_case(n, grad_dtype, moment_dtype, seed):
    p, g, m, v = make_state(n, grad_dtype, moment_dtype, seed=seed)
    return p, g, m.pin_memory(), v.pin_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_gpu_adamw_equals_host_adamw_bit_for_bit(grad_dtype, moment_dtype, decoupled):
    # Sizes around the 4-wide vector slots and the 16K-element chunks.
    sizes = [1, 3, 4, 5, 1023, 16384, 16385, 100_003]
    cases = [_gpu_case(n, grad_dtype, moment_dtype, i) for i, n in enumerate(sizes)]
    host = [clone_all(*c) for c in cases]
    steps = [1, 2, 3, 4, 5, 6, 7, 1000]
    seeds = list(range(100, 108))
    kw = dict(HYPER, decoupled=decoupled, grad_scale=0.5, seeds=seeds)
    params = [c[0].cuda() for c in cases]
    ops.adamw_step_gpu(params, [c[1].cuda() for c in cases], [c[2] for c in cases], [c[3] for c in cases], steps, **kw)
    torch.cuda.synchronize()
    ops.adamw_step(*[[h[k] for h in host] for k in range(4)], steps, **kw).wait()
    for i in range(len(sizes)):
        assert_same_bits(params[i].cpu(), host[i][0])
        assert_same_bits(cases[i][2], host[i][2])
        assert_same_bits(cases[i][3], host[i][3])


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_gpu_adamw_on_a_capped_grid_updates_device_masters(grad_dtype, moment_dtype):
    """No host masters (the fp32 device params are the master), gradients read from pinned
    host memory, fewer blocks than chunks."""
    from trainstream.ops.adamw import adamw_step_mapped

    sizes = [16385, 100_003, 7]
    cases = [_gpu_case(n, grad_dtype, moment_dtype, 20 + i) for i, n in enumerate(sizes)]
    host = [clone_all(*c) for c in cases]
    params = [c[0].cuda() for c in cases]
    steps, seeds = [3, 1, 2], [4, 5, 6]
    adamw_step_mapped(
        params[0].device,
        params,
        [c[1].pin_memory() for c in cases],
        [c[2] for c in cases],
        [c[3] for c in cases],
        steps,
        seeds=seeds,
        max_blocks=2,
        **HYPER,
    )
    torch.cuda.synchronize()
    ops.adamw_step(*[[h[k] for h in host] for k in range(4)], steps, seeds=seeds, **HYPER).wait()
    for i in range(len(sizes)):
        assert_same_bits(params[i].cpu(), host[i][0])
        assert_same_bits(cases[i][2], host[i][2])
        assert_same_bits(cases[i][3], host[i][3])


@pytest.mark.gpu
@pytest.mark.parametrize("max_blocks", [1, 3, 64])
def test_gpu_adamw_on_a_capped_grid_with_mapped_host_tensors(max_blocks):
    """The engine's launch: fewer blocks than chunks (each loops), gradients and the written
    weights in pinned host memory as well as on the device."""
    from trainstream.ops.adamw import adamw_step_mapped

    sizes = [5, 16385, 100_003, 40_000]
    cases = [_gpu_case(n, torch.float32, torch.float32, i) for i, n in enumerate(sizes)]
    host = [clone_all(*c) for c in cases]
    masters = [c[0].clone().pin_memory() for c in cases]
    targets = [torch.empty(n, device="cuda") if i % 2 else torch.empty(n).pin_memory() for i, n in enumerate(sizes)]
    grads = [c[1].cuda() if i % 2 == 0 else c[1].pin_memory() for i, c in enumerate(cases)]
    steps, seeds = [1, 2, 3, 4], [7, 8, 9, 10]
    adamw_step_mapped(
        torch.device("cuda", torch.cuda.current_device()),
        targets,
        grads,
        [c[2] for c in cases],
        [c[3] for c in cases],
        steps,
        masters=masters,
        seeds=seeds,
        max_blocks=max_blocks,
        **HYPER,
    )
    torch.cuda.synchronize()
    ops.adamw_step(*[[h[k] for h in host] for k in range(4)], steps, seeds=seeds, **HYPER).wait()
    for i in range(len(sizes)):
        assert_same_bits(masters[i], host[i][0])
        assert_same_bits(targets[i].cpu(), host[i][0])
        assert_same_bits(cases[i][2], host[i][2])


def _device_state_case(device, moment_dtype: torch.dtype, with_masters: bool):
    """The device state's launch: weights, gradients, moments and (for bf16 weights) fp32
    masters, all on `device`, fresh copies of the same values at every call."""
    cases = [make_state(n, torch.float32, moment_dtype, seed=30 + i) for i, n in enumerate([5, 16385, 40_000, 7])]
    masters = [c[0].to(device) for c in cases] if with_masters else None
    weights = [c[0].to(device, torch.bfloat16 if with_masters else torch.float32) for c in cases]
    grads, exp_avgs, exp_avg_sqs = ([c[k].to(device) for c in cases] for k in (1, 2, 3))
    return weights, grads, exp_avgs, exp_avg_sqs, masters


@pytest.mark.gpu
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_masters", [False, True], ids=["fp32 weights", "bf16 weights, device masters"])
def test_gpu_adamw_mapped_tensor_skip_leaves_only_the_skipped_tensors_alone(moment_dtype, with_masters):
    """tensor_skip set for tensors 1 and 3: they keep their bits (weights, moments, masters);
    tensors 0 and 2 get exactly the bits of the same launch without tensor_skip."""
    from trainstream.ops.adamw import adamw_step_mapped

    device = torch.device("cuda", torch.cuda.current_device())
    skipped, plain = (
        _device_state_case(device, moment_dtype, with_masters),
        _device_state_case(device, moment_dtype, with_masters),
    )
    groups = [g for k, g in enumerate(skipped) if k != 1 and g is not None]  # what the kernel writes
    before = [[t.clone() for t in g] for g in groups]
    steps, seeds = [1, 2, 3, 4], [7, 8, 9, 10]
    skip = torch.tensor([0, 1, 0, 1], dtype=torch.int32, device=device)
    w, g, m, v, mst = skipped
    adamw_step_mapped(device, w, g, m, v, steps, masters=mst, seeds=seeds, tensor_skip=skip, **HYPER)
    w, g, m, v, mst = plain
    adamw_step_mapped(device, w, g, m, v, steps, masters=mst, seeds=seeds, **HYPER)
    torch.cuda.synchronize()
    updated = [g for k, g in enumerate(plain) if k != 1 and g is not None]
    for k, (group, old, new) in enumerate(zip(groups, before, updated)):
        for i in range(4):
            if i in (1, 3):
                assert_same_bits(group[i], old[i])
            else:
                assert_same_bits(group[i], new[i])
                if not (k == 0 and with_masters):  # a bf16 weight may round back to its old value
                    assert not torch.equal(group[i], old[i])


@pytest.mark.gpu
def test_gpu_adamw_refuses_a_tensor_skip_that_is_not_one_device_int32_per_tensor():
    from trainstream.ops.adamw import adamw_step_mapped

    device = torch.device("cuda", torch.cuda.current_device())
    p = [torch.zeros(4, device=device), torch.zeros(4, device=device)]
    m, v = [t.clone() for t in p], [t.clone() for t in p]
    for bad in (
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int64, device=device),
        torch.zeros(3, dtype=torch.int32, device=device),
        torch.zeros(4, dtype=torch.int32, device=device)[::2],
    ):
        with pytest.raises(ValueError, match=r"^adamw_step_gpu: tensor_skip must be a contiguous int32 tensor of 2"):
            adamw_step_mapped(device, p, [t.clone() for t in p], m, v, [1, 1], lr=1e-3, tensor_skip=bad)
    with pytest.raises(TypeError, match=r"^adamw_step_gpu: tensor_skip must be a torch.Tensor"):
        adamw_step_mapped(device, p, [t.clone() for t in p], m, v, [1, 1], lr=1e-3, tensor_skip=[0, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_adamw_with_host_masters_writes_the_gpu_copy(param_dtype):
    n = 50_001
    p, g, m, v = _gpu_case(n, torch.bfloat16, torch.bfloat16, 0)
    master = p.clone().pin_memory()
    gpu_param = torch.empty(n, dtype=param_dtype, device="cuda")
    host = clone_all(p, g, m, v)
    ops.adamw_step_gpu([gpu_param], [g.cuda()], [m], [v], [3], masters=[master], seeds=[1], **HYPER)
    torch.cuda.synchronize()
    ops.adamw_step([host[0]], [host[1]], [host[2]], [host[3]], [3], seeds=[1], **HYPER).wait()
    assert_same_bits(master, host[0])
    assert_same_bits(gpu_param.cpu(), host[0].to(param_dtype))


@pytest.mark.gpu
def test_gpu_adamw_unaligned_views_and_device_grad_scale():
    # Views one element into their storage defeat the 16-byte vector path: the scalar path
    # must give the same bits. The device-side scale must act like the host-side one.
    n = 40_000
    p, g, m, v = make_state(n + 1)
    pd, gd = p.cuda()[1:], g.cuda()[1:]
    mh, vh = m.pin_memory()[1:], v.pin_memory()[1:]
    host = clone_all(p[1:], g[1:], m[1:], v[1:])
    scale = torch.tensor(0.25, device="cuda")
    ops.adamw_step_gpu([pd], [gd], [mh], [vh], [2], grad_scale_tensor=scale, **HYPER)
    torch.cuda.synchronize()
    ops.adamw_step([host[0]], [host[1]], [host[2]], [host[3]], [2], grad_scale=0.25, **HYPER).wait()
    assert_same_bits(pd.cpu(), host[0])
    assert_same_bits(mh, host[2])


@pytest.mark.gpu
def test_gpu_adamw_orders_with_the_stream_under_heavy_transfers():
    # Large state, tiny arithmetic: the next kernel on the stream must see the new weights
    # without any explicit synchronization, and repeated steps must compound correctly.
    n = 1 << 24
    p, g, m, v = _gpu_case(n, torch.float32, torch.float32, 1)
    host = clone_all(p, g, m, v)
    pd, gd = p.cuda(), g.cuda()
    sums = []
    for step in (1, 2, 3):
        ops.adamw_step_gpu([pd], [gd], [m], [v], [step], **HYPER)
        sums.append(pd.double().sum())  # reads the weights on the same stream, no sync
    for step in (1, 2, 3):
        ops.adamw_step([host[0]], [host[1]], [host[2]], [host[3]], [step], **HYPER).wait()
        ref_sum = host[0].double().sum()
    assert_same_bits(pd.cpu(), host[0])
    assert sums[-1].item() == ref_sum.item()


def test_gpu_adamw_argument_errors_need_no_gpu_to_explain():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="must be in pinned host memory"):
            ops.adamw_step_gpu(
                [torch.zeros(4, device="cuda")],
                [torch.zeros(4, device="cuda")],
                [torch.zeros(4)],
                [torch.zeros(4)],
                [1],
                lr=1e-3,
            )
    else:
        with pytest.raises(RuntimeError, match="the GPU AdamW needs a CUDA GPU"):
            ops.adamw_step_gpu([torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4)], [1], lr=1e-3)


def test_scalars_the_gpu_path_packs_are_the_host_paths():
    # adamw_scalars feeds the CUDA kernel; it must be make_scalars itself, which the bit-exact
    # host tests above already pin to the reference arithmetic.
    import math

    lr, b1, b2, eps, wd, gs, step = 3e-3, 0.9, 0.999, 1e-8, 0.05, 0.75, 7
    floats, key = C.adamw_scalars(lr, b1, b2, eps, wd, gs, step, 12345)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()
    expected = [
        f32(1 - lr * wd),
        f32(wd),
        f32(1 - b1),
        f32(b2),
        f32(1 - b2),
        f32(math.sqrt(1 - b2**step)),
        f32(eps),
        f32(-(lr / (1 - b1**step))),
        f32(gs),
    ]
    assert floats == expected
    assert key == reference.rng_key(12345, step)
