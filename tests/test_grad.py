"""Gradient helpers: host accumulation and per-tensor squared norms."""

import pytest
import torch

from trainstream import ops
from trainstream.ops import reference


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_matches_torch_add_bit_for_bit(src_dtype):
    sizes = [1, 17, 65_537, 300_001]
    dsts = [torch.randn(n) for n in sizes]
    srcs = [torch.randn(n).to(src_dtype) for n in sizes]
    expected = [d.clone() for d in dsts]
    reference.accumulate_(expected, srcs)
    ops.accumulate_(dsts, srcs, threads=2).wait()
    for d, e in zip(dsts, expected):
        assert torch.equal(d, e)


def test_accumulate_then_adamw_on_the_same_buffer_run_in_order():
    # Both queued without waiting: the update must read the finished sum.
    n = 2_000_000
    total, g = torch.zeros(n), torch.randn(n)
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    ref_p = p.clone()
    h1 = ops.accumulate_([total], [g], threads=2)
    h2 = ops.adamw_step([p], [total], [m], [v], [1], lr=1e-2, threads=2)
    h1.wait()
    h2.wait()
    reference.adamw_step([ref_p], [g], [torch.zeros(n)], [torch.zeros(n)], [1], lr=1e-2)
    assert torch.equal(p, ref_p)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(dsts=[torch.zeros(3, dtype=torch.bfloat16)]), r"dsts\[0\] must be float32"),
        (dict(srcs=[torch.zeros(3, dtype=torch.float16)]), "sources must all be float32 or all bfloat16"),
        (dict(srcs=[torch.zeros(4)]), r"dsts\[0\] has 3 elements, srcs\[0\] has 4"),
        (dict(srcs=[torch.zeros(3, 2)[:, 0]]), r"srcs\[0\] must be a contiguous host tensor"),
        (dict(srcs=[]), "1 destinations but 0 sources"),
    ],
)
def test_accumulate_errors(bad, match):
    args = dict(dsts=[torch.zeros(3)], srcs=[torch.zeros(3)])
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ops.accumulate_(args["dsts"], args["srcs"])


def test_sq_norms_on_cpu_are_the_reference():
    ts = [torch.randn(n) for n in (5, 1000)]
    assert torch.equal(ops.grad_sq_norms(ts), reference.grad_sq_norms(ts))


def test_sq_norms_errors():
    with pytest.raises(ValueError, match="must share one of"):
        ops.grad_sq_norms([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"tensors\[0\] must be contiguous"):
        ops.grad_sq_norms([torch.zeros(4, 2)[:, 0]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sq_norms_on_gpu(dtype):
    sizes = [1, 255, 8192, 8193, 1_000_003]
    ts = [torch.randn(n, device="cuda").to(dtype) for n in sizes]
    out = ops.grad_sq_norms(ts)
    again = ops.grad_sq_norms(ts)
    assert torch.equal(out, again)  # deterministic
    # fp32 accumulation: relative error grows with size (torch's own norm is no closer).
    exact = torch.stack([t.double().pow(2).sum() for t in ts]).float()
    torch.testing.assert_close(out, exact, rtol=2e-4, atol=0)
    # Exactly representable sums catch any element counted twice or missed.
    ones = [torch.ones(n, device="cuda", dtype=dtype) for n in sizes]
    assert ops.grad_sq_norms(ones).tolist() == [float(n) for n in sizes]


def test_dropping_a_handle_waits_for_the_work():
    # The handle is the only owner of the source tensor here; dropping it must not free
    # memory a worker still reads.
    d = torch.zeros(1 << 22)
    ops.accumulate_([d], [torch.ones(1 << 22)], threads=2)  # handle dropped at once
    assert torch.equal(d, torch.ones(1 << 22))


def _quantize_in_child(queue):
    torch.set_num_threads(1)  # torch's own OpenMP pool is not fork-safe; DataLoader workers do this too
    x = torch.randn(100_000)
    queue.put(torch.equal(ops.quantize_int8(x)[0], reference.quantize_int8(x)[0]))


def test_host_ops_work_in_a_forked_child():
    import multiprocessing as mp

    ops.quantize_int8(torch.randn(1000))  # the parent's pool exists and has run work
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_quantize_in_child, args=(queue,))
    child.start()
    try:
        child.join(timeout=60)
        assert child.exitcode == 0, "the child hung or crashed"
        assert queue.get(timeout=5) is True
    finally:
        if child.is_alive():
            child.kill()
