"""ops.mark_nonfinite_ (the non-finite check the engine runs on the device before an update)
and the GPU AdamW's skip_flag, which makes the kernel write nothing once the check has set
it. The CPU path is the pure-torch twin; the CUDA kernel is checked against it."""

import pytest
import torch

from trainstream import ops
from trainstream.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (value, whether it counts): values, not squares, decide, so a huge finite one does not
SPECIALS = [
    (float("nan"), True),
    (float("inf"), True),
    (float("-inf"), True),
    (3e38, False),
    (-3e38, False),
    (0.0, False),
]


def _marks(tensors, device="cpu", found_on="host"):
    found = torch.zeros(len(tensors), dtype=torch.int32, device=device if found_on == "device" else "cpu")
    if found_on == "pinned":
        found = found.pin_memory()
    flag = torch.zeros((), dtype=torch.int32, device=device)
    ops.mark_nonfinite_([t.to(device) for t in tensors], found, flag)
    if device != "cpu":
        torch.cuda.synchronize()
    return found.tolist(), int(flag)


def _in(dtype, value: float) -> float:
    """`value`, with the huge finite ones brought inside fp16's range (its largest is 65504)."""
    return value if dtype != torch.float16 or abs(value) != 3e38 else 6e4 * (1 if value > 0 else -1)


def _cases(dtype):
    """An empty tensor, then one tensor per special value (in one element), of sizes around
    the kernel's 8192-element chunks."""
    torch.manual_seed(0)
    out = [torch.zeros(0, dtype=dtype)]
    for i, (n, (value, _)) in enumerate(zip([1, 7, 8192, 8193, 40_000, 3], SPECIALS)):
        t = torch.randn(n).to(dtype)
        t[(i * 7919) % n] = _in(dtype, value)
        out.append(t)
    odd = torch.zeros(64, dtype=dtype)
    odd[33] = float("nan")  # the high half of a 32-bit word, for the 16-bit dtypes
    unaligned = torch.zeros(1001, dtype=dtype)[1:]  # not 16-byte aligned: the element-wise path
    unaligned[998] = float("inf")
    return out + [odd, unaligned]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value, counts", SPECIALS)
def test_a_value_that_is_not_finite_marks_its_tensor_and_the_flag(dtype, value, counts):
    bad = torch.zeros(100, dtype=dtype)
    bad[37] = _in(dtype, value)
    found, flag = _marks([torch.ones(5, dtype=dtype), bad, torch.zeros(0, dtype=dtype)])
    assert found == [0, int(counts), 0]
    assert flag == int(counts)


def test_a_huge_finite_value_whose_square_overflows_does_not_count():
    t = torch.full((10,), 3e38)
    assert torch.isinf(t.pow(2)).all()
    assert _marks([t]) == ([0], 0)


def test_the_flag_and_marks_are_never_cleared():
    """The engine's window flag: a later, finite call leaves it set, and leaves marks alone."""
    found = torch.tensor([1, 0], dtype=torch.int32)
    flag = torch.ones((), dtype=torch.int32)
    ops.mark_nonfinite_([torch.zeros(3), torch.zeros(3)], found, flag)
    assert found.tolist() == [1, 0] and int(flag) == 1


def test_the_tensors_are_only_read():
    t = torch.tensor([1.0, float("nan"), float("inf")])
    before = t.clone()
    _marks([t])
    assert torch.equal(t.view(torch.int32), before.view(torch.int32))


def test_no_tensors_marks_nothing():
    found = torch.zeros(0, dtype=torch.int32)
    flag = torch.zeros((), dtype=torch.int32)
    ops.mark_nonfinite_([], found, flag)
    assert int(flag) == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda f, g: ops.mark_nonfinite_(torch.zeros(2), f, g), r"^mark_nonfinite_: tensors must be a list or tuple"),
        (
            lambda f, g: ops.mark_nonfinite_([torch.zeros(2)], None, g),
            r"^mark_nonfinite_: found must be a torch.Tensor",
        ),
        (lambda f, g: ops.mark_nonfinite_([torch.zeros(2)], f, 0), r"^mark_nonfinite_: flag must be a torch.Tensor"),
        (
            lambda f, g: ops.mark_nonfinite_([torch.zeros(2, dtype=torch.float64)], f, g),
            r"^mark_nonfinite_: tensors must share one of float32, bfloat16, float16",
        ),
        (
            lambda f, g: ops.mark_nonfinite_(
                [torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], f[:1].repeat(2), g
            ),
            r"^mark_nonfinite_: tensors must share one",
        ),
        (
            lambda f, g: ops.mark_nonfinite_([torch.zeros(4, 2)[:, 0]], f, g),
            r"^mark_nonfinite_: tensors\[0\] must be contiguous",
        ),
        (
            lambda f, g: ops.mark_nonfinite_([torch.zeros(2)], f.float(), g),
            r"^mark_nonfinite_: found must be a contiguous int32 tensor of 1 values",
        ),
        (
            lambda f, g: ops.mark_nonfinite_([torch.zeros(2), torch.zeros(2)], f, g),
            r"^mark_nonfinite_: found must be a contiguous int32 tensor of 2 values",
        ),
        (
            lambda f, g: ops.mark_nonfinite_([torch.zeros(2)], f, torch.zeros(2, dtype=torch.int32)),
            r"^mark_nonfinite_: flag must be one int32 value on cpu",
        ),
        (
            lambda f, g: ops.mark_nonfinite_([torch.zeros(2)], f, g, max_blocks=-1),
            r"^mark_nonfinite_: max_blocks must be >= 0",
        ),
    ],
)
def test_bad_arguments_name_the_argument(call, message):
    found = torch.zeros(1, dtype=torch.int32)
    flag = torch.zeros((), dtype=torch.int32)
    with pytest.raises((TypeError, ValueError), match=message):
        call(found, flag)
    assert int(flag) == 0


# -- on a GPU --------------------------------------------------------------------------------


def _on_cuda(t):
    """`t` on the GPU at the same offset into its storage (a misaligned view stays misaligned)."""
    view = torch.empty(t.storage_offset() + t.numel(), dtype=t.dtype, device="cuda")[t.storage_offset() :]
    view.copy_(t)
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("found_on", ["device", "pinned"])
@pytest.mark.parametrize("max_blocks", [0, 1, 3])
def test_gpu_kernel_agrees_with_its_twin(dtype, found_on, max_blocks):
    """NaN, +inf, -inf, huge finite values, an empty tensor; the marks on the device or in
    pinned host memory (the engine's), a capped grid that loops over the chunks."""
    cases = _cases(dtype)
    found = torch.zeros(len(cases), dtype=torch.int32, device="cuda" if found_on == "device" else "cpu")
    if found_on == "pinned":
        found = found.pin_memory()
    flag = torch.zeros((), dtype=torch.int32, device="cuda")
    ops.mark_nonfinite_([_on_cuda(t) for t in cases], found, flag, max_blocks=max_blocks)
    torch.cuda.synchronize()
    twin_found = torch.zeros(len(cases), dtype=torch.int32)
    twin_flag = torch.zeros((), dtype=torch.int32)
    reference.mark_nonfinite_(cases, twin_found, twin_flag)
    assert found.cpu().tolist() == twin_found.tolist()
    assert int(flag) == int(twin_flag) == 1
    assert twin_found.tolist() == [0] + [int(counts) for _, counts in SPECIALS] + [1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernel_finite_tensors_leave_the_flag_clear(dtype):
    tensors = [torch.full((n,), _in(dtype, 3e38)).to(dtype).cuda() for n in (0, 5, 20_000)]
    found = torch.zeros(3, dtype=torch.int32, device="cuda")
    flag = torch.zeros((), dtype=torch.int32, device="cuda")
    ops.mark_nonfinite_(tensors, found, flag)
    torch.cuda.synchronize()
    assert found.tolist() == [0, 0, 0] and int(flag) == 0


def _adamw_case(n, moment_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g)
    m = (torch.randn(n, generator=g) * 0.1).to(moment_dtype).pin_memory()
    v = torch.rand(n, generator=g).to(moment_dtype).pin_memory()
    return p, grad, m, v


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8).clone()


@pytest.mark.gpu
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masters", [False, True], ids=["device_master", "host_master_and_copy"])
def test_gpu_adamw_with_the_skip_flag_set_writes_nothing(moment_dtype, masters):
    """Params (the compute copy with host masters), masters and both moments keep their
    bits; the same launch with the flag clear updates them."""
    sizes = [5, 16385, 70_001]
    cases = [_adamw_case(n, moment_dtype, i) for i, n in enumerate(sizes)]
    hyper = dict(lr=1e-2, weight_decay=0.1, seeds=[1, 2, 3])

    def launch(flag_value):
        params = [c[0].to(torch.bfloat16 if masters else torch.float32).cuda() for c in cases]
        master = [c[0].clone().pin_memory() for c in cases] if masters else None
        m = [c[2].clone().pin_memory() for c in cases]
        v = [c[3].clone().pin_memory() for c in cases]
        before = [_bits(t) for t in params + (master or []) + m + v]
        flag = torch.full((), flag_value, dtype=torch.int32, device="cuda")
        ops.adamw_step_gpu(
            params, [c[1].cuda() for c in cases], m, v, [3, 3, 3], masters=master, skip_flag=flag, **hyper
        )
        torch.cuda.synchronize()
        after = [_bits(t) for t in params + (master or []) + m + v]
        return before, after

    before, after = launch(1)
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    before, after = launch(0)
    assert all(not torch.equal(b, a) for b, a in zip(before, after))


@pytest.mark.gpu
def test_gpu_adamw_mapped_with_the_skip_flag_set_leaves_staged_moments_alone():
    """The engine's launch: moments staged in VRAM (as moments.py copies a region), host
    masters, a paged unit's host weights as the target; the flag set: nothing changes."""
    from trainstream.ops.adamw import adamw_step_mapped

    p, grad, m, v = _adamw_case(40_000, torch.float32, 7)
    m_dev, v_dev = m.cuda(), v.cuda()
    target = p.to(torch.bfloat16).pin_memory()
    master = p.clone().pin_memory()
    before = [_bits(t) for t in (m_dev, v_dev, target, master)]
    flag = torch.ones((), dtype=torch.int32, device="cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    adamw_step_mapped(
        device, [target], [grad.cuda()], [m_dev], [v_dev], [2], masters=[master], max_blocks=3, skip_flag=flag, lr=1e-2
    )
    torch.cuda.synchronize()
    assert all(torch.equal(b, _bits(t)) for b, t in zip(before, (m_dev, v_dev, target, master)))


@pytest.mark.gpu
def test_gpu_adamw_refuses_a_skip_flag_that_is_not_one_device_int32():
    p = torch.zeros(4, device="cuda")
    m, v = torch.zeros(4).pin_memory(), torch.zeros(4).pin_memory()
    for bad in (torch.zeros((), dtype=torch.int32), torch.zeros(2, dtype=torch.int32, device="cuda")):
        with pytest.raises(ValueError, match=r"skip_flag must be one int32 value on cuda"):
            ops.adamw_step_gpu([p], [p.clone()], [m], [v], [1], lr=1e-3, skip_flag=bad)
