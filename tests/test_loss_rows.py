"""ops.loss_rows.loss_and_dlogits_ (the fused CUDA cross-entropy rows of the chunked loss)
against its pure-torch twin trainstream.loss._loss_and_dlogits, its argument checks, and
which of the two the chunked loss takes."""

import pytest
import torch
import torch.nn.functional as F

import trainstream.loss as loss_module
from trainstream import chunked_cross_entropy
from trainstream.loss import _loss_and_dlogits
from trainstream.ops.loss_rows import loss_and_dlogits_

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _logits(rows, vocab, dtype, device, *, sliced=False, spread=3.0, shift=0.0):
    """A (rows, vocab) block of logits in dtype. sliced: columns 1 .. vocab of a tensor of
    vocab + 5 columns, so no row starts 16-byte aligned and the row stride is not vocab."""
    if sliced:
        wide = torch.randn(rows, vocab + 5, device=device) * spread + shift
        return wide.to(dtype)[:, 1 : vocab + 1]
    return (torch.randn(rows, vocab, device=device) * spread + shift).to(dtype)


def _row_args(rows, vocab, dtype, device):
    """column, valid (every fifth row ignored) and scale of each row; fp16's rows carry the
    chunked loss's 2**15 factor (loss.py's [Note: fp16 range]), the others at most 1."""
    column = torch.randint(0, vocab, (rows,), device=device)
    valid = torch.arange(rows, device=device) % 5 != 3
    scale = torch.rand(rows, device=device) * (2.0**15 if dtype == torch.float16 else 1.0)
    return column, valid, scale


def _twin(z, column, valid, scale, write_dlogits):
    """The twin on a copy of z: (loss, the copy, now holding d_logits when written)."""
    copy = z.clone()
    loss = _loss_and_dlogits(copy, column.unsqueeze(1), valid, scale, write_dlogits)
    return loss, copy


def _ulp(x, dtype):
    """The spacing of dtype's numbers at each magnitude of x (float64, finite): eps * 2**(e-1)
    for |x| in [2**(e-1), 2**e), and the subnormal step at zero and below the normal range."""
    info = torch.finfo(dtype)
    subnormal_step = info.smallest_normal * info.eps
    _, exponent = torch.frexp(x)
    step = torch.ldexp(torch.full_like(x, info.eps), exponent - 1)
    return torch.where(x == 0, subnormal_step, step).clamp_min(subnormal_step)


def _assert_losses_close(ours, twin):
    """log(s) in another summation order: its rounding is relative to s, so the difference is
    bounded in absolute terms near 0 and relative to the loss above 1."""
    a, b = ours.double(), twin.double()
    same = (a == b) | (a.isnan() & b.isnan())
    bad = ~same & ~((a - b).abs() <= 2e-6 * b.abs().clamp_min(1.0))
    assert not bad.any(), (a[bad][:5].tolist(), b[bad][:5].tolist())


def _assert_dlogits_close(ours, twin, column, valid, scale):
    """Within one unit in the last place of the twin's value in their dtype (fp32: 1e-6
    absolute); at a valid row's target, e_t - s carries the two sums' difference in rounding
    (scale * p_t times it, p_t <= 1), so there scale * 8e-6 more is allowed."""
    a, b = ours.double(), twin.double()
    if ours.dtype == torch.float32:
        tol = torch.full_like(b, 1e-6)
    else:
        tol = _ulp(b.abs().nan_to_num(0.0, 0.0, 0.0), ours.dtype)
    rows = torch.arange(b.shape[0], device=b.device)[valid]
    tol[rows, column[valid]] += 8e-6 * scale[valid].double()
    same = (a == b) | (a.isnan() & b.isnan())
    bad = ~same & ~((a - b).abs() <= tol)
    where = bad.nonzero()[:5].tolist()
    assert not bad.any(), (int(bad.sum()), where, a[bad][:5].tolist(), b[bad][:5].tolist())


def _bits(t):
    """t's elements as integers of their size (NaN equals itself bit for bit)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _check_against_twin(z, column, valid, scale, write_dlogits=True):
    twin_loss, twin_z = _twin(z, column, valid, scale, write_dlogits)
    before = z.clone()
    loss = loss_and_dlogits_(z, column, valid, scale, write_dlogits)
    assert loss.dtype == torch.float32 and loss.shape == (z.shape[0],)
    _assert_losses_close(loss, twin_loss)
    if write_dlogits:
        _assert_dlogits_close(z, twin_z, column, valid, scale)
    else:
        assert torch.equal(_bits(z), _bits(before))


# GPU: the kernel against the twin on the same inputs.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 4099, 152064])
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("sliced", [False, True])
def test_gpu_matches_the_twin(dtype, vocab, rows, sliced):
    z = _logits(rows, vocab, dtype, "cuda", sliced=sliced)
    assert (z.data_ptr() % 16 != 0) == sliced  # a sliced block starts one element past an aligned base
    _check_against_twin(z, *_row_args(rows, vocab, dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 4099])
def test_gpu_without_dlogits_leaves_the_logits(dtype, vocab):
    z = _logits(300, vocab, dtype, "cuda", sliced=True)
    _check_against_twin(z, *_row_args(300, vocab, dtype, "cuda"), write_dlogits=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large_logits(dtype):
    """Logits near 1e4 (fp16 reaches 65504): the max is taken out before exp, as the twin does."""
    z = _logits(64, 4099, dtype, "cuda", spread=5.0, shift=1e4)
    _check_against_twin(z, *_row_args(64, 4099, dtype, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_very_negative_and_infinite_logits(dtype):
    """Three quarters of each row at the dtype's lowest value or at -inf (exp gives 0 there),
    targets among them (a large and an infinite loss), and rows the twin makes NaN: all -inf,
    one +inf, one NaN."""
    rows, vocab = 40, 4099
    z = _logits(rows, vocab, dtype, "cuda")
    z[:, ::2] = torch.finfo(dtype).min
    z[:, 1::4] = -float("inf")
    column, valid, scale = _row_args(rows, vocab, dtype, "cuda")
    column = column % 1024 * 4 + 3  # a finite logit
    column[0] = 0  # at the dtype's lowest value: a large loss
    column[1] = 1  # at -inf: the loss is inf
    z[2] = -float("inf")
    z[5, 100] = float("inf")
    z[6, 3000] = float("nan")
    twin_loss, _ = _twin(z, column, valid, scale, False)
    assert twin_loss[1].item() == float("inf")
    assert all(twin_loss[r].isnan() for r in (2, 5, 6)) and twin_loss[7:].isfinite().all()
    assert twin_loss[0].isfinite() and twin_loss[0].item() >= -torch.finfo(dtype).min
    _check_against_twin(z, column, valid, scale)


@pytest.mark.gpu
def test_gpu_a_column_outside_the_row_is_nan():
    """A column the caller failed to clamp reads nothing outside the row: its loss and
    d_logits are NaN, the other rows as the twin gives them."""
    z = _logits(3, 100, torch.bfloat16, "cuda")
    column, valid, scale = _row_args(3, 100, torch.bfloat16, "cuda")
    twin_loss, twin_z = _twin(z, column, valid, scale, True)
    column[1] = 100
    loss = loss_and_dlogits_(z, column, valid, scale, True)
    assert loss[1].isnan() and z[1].isnan().all()
    keep = torch.tensor([0, 2], device="cuda")
    _assert_losses_close(loss[keep], twin_loss[keep])
    _assert_dlogits_close(z[keep], twin_z[keep], column[keep], valid[keep], scale[keep])


@pytest.mark.gpu
def test_gpu_writes_into_out_and_bumps_the_version():
    z = _logits(8, 50, torch.float32, "cuda")
    column, valid, scale = _row_args(8, 50, torch.float32, "cuda")
    out = torch.full((8,), float("nan"), device="cuda")
    version = z._version
    assert loss_and_dlogits_(z, column, valid, scale, True, out=out) is out
    assert not out.isnan().any() and z._version > version


# GPU: the chunked loss through the kernel.


def _reference(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


@pytest.mark.gpu
def test_gpu_chunked_loss_with_unaligned_rows_matches_full_logits():
    """fp32, vocab 4099 (a chunk's rows start 0, 12, 8 and 4 bytes past 16-byte alignment,
    in turn), a ragged last chunk, ignored tokens: the loss within 1e-6 of the full logits' and the gradients as
    close to the fp64 truth as the full logits' (cuBLAS rounds a chunk's logits and the whole
    matrix's differently)."""
    vocab, dim, n = 4099, 128, 1000
    hidden = torch.randn(n, dim, device="cuda", requires_grad=True)
    weight = (torch.randn(vocab, dim, device="cuda") / dim**0.25).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda")
    targets[::7] = -100
    ours = chunked_cross_entropy(hidden, weight, targets, chunk_size=256)
    ref = _reference(hidden, weight, targets)
    assert abs(ours.item() - ref.item()) <= 1e-6 * abs(ref.item())
    got = torch.autograd.grad(ours, [hidden, weight])
    want = torch.autograd.grad(ref, [hidden, weight])
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    truth = torch.autograd.grad(F.cross_entropy(F.linear(*exact), targets), exact)
    for o, r, t in zip(got, want, truth):
        scale = t.abs().max().item()
        assert (o.double() - t).abs().max().item() <= (r.double() - t).abs().max().item() + 1e-6 * scale


def _count_calls(monkeypatch, name):
    calls = []
    original = getattr(loss_module, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(loss_module, name, counted)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_gpu_chunked_loss_takes_the_kernel_for_its_dtypes(monkeypatch, dtype):
    """bf16, fp16 and fp32 on CUDA: one kernel call per chunk, on the chunk whole, and the
    twin never; fp64: the twin, on row blocks."""
    fused, twin = _count_calls(monkeypatch, "loss_and_dlogits_"), _count_calls(monkeypatch, "_loss_and_dlogits")
    hidden = torch.randn(40, 16, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(30, 16, device="cuda", dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 30, (40,), device="cuda")
    chunked_cross_entropy(hidden, weight, targets, chunk_size=16).backward()
    if dtype == torch.float64:
        assert not fused and len(twin) == 3 * 4  # three chunks of 4 row blocks
    else:
        assert fused == [(16, 30), (16, 30), (8, 30)] and not twin


# CPU: the path the chunked loss takes, and the op's argument checks.


def test_fused_rows_only_on_cuda_for_its_dtypes():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert all(loss_module._fused_rows(cuda, d) for d in DTYPES)
    assert not loss_module._fused_rows(cuda, torch.float64)
    assert not any(loss_module._fused_rows(cpu, d) for d in DTYPES + [torch.float64])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cpu_chunked_loss_keeps_the_torch_path(monkeypatch, dtype):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was called on the CPU")

    monkeypatch.setattr(loss_module, "loss_and_dlogits_", refuse)
    twin = _count_calls(monkeypatch, "_loss_and_dlogits")
    hidden = torch.randn(40, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(30, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 30, (40,))
    chunked_cross_entropy(hidden, weight, targets, chunk_size=16).backward()
    assert twin == [(4, 30)] * 8 + [(2, 30)] * 4  # three chunks, each in 4 row blocks


def _good(rows=4, vocab=10, dtype=torch.float32):
    return dict(
        z=torch.randn(rows, vocab, dtype=dtype),
        column=torch.zeros(rows, dtype=torch.int64),
        valid=torch.ones(rows, dtype=torch.bool),
        scale=torch.ones(rows),
        write_dlogits=True,
    )


def _bad_cases():
    g = _good()
    return [
        ("z", dict(g, z=[[1.0]]), TypeError),
        ("column", dict(g, column=None), TypeError),
        ("valid", dict(g, valid=1), TypeError),
        ("scale", dict(g, scale=1.0), TypeError),
        ("out", dict(g, out=[0.0]), TypeError),
        ("write_dlogits", dict(g, write_dlogits=1), TypeError),
        ("z", dict(g, z=torch.randn(4, 10, dtype=torch.float64)), ValueError),
        ("z", dict(g, z=torch.randn(40)), ValueError),
        ("z", dict(g, z=torch.randn(4, 10, 1)), ValueError),
        ("z", dict(g, z=torch.randn(10, 4).t()), ValueError),  # rows not contiguous
        ("z", dict(g, z=torch.randn(1, 10).expand(4, 10)), ValueError),  # rows overlap
        ("z", dict(g, z=torch.randn(4, 0)), ValueError),
        ("z", dict(g, z=torch.randn(4, 10, requires_grad=True)), ValueError),
        ("column", dict(g, column=torch.zeros(4, dtype=torch.int32)), ValueError),
        ("column", dict(g, column=torch.zeros(4, 1, dtype=torch.int64)), ValueError),
        ("column", dict(g, column=torch.zeros(8, dtype=torch.int64)[::2]), ValueError),
        ("valid", dict(g, valid=torch.ones(4)), ValueError),
        ("valid", dict(g, valid=torch.ones(3, dtype=torch.bool)), ValueError),
        ("scale", dict(g, scale=torch.ones(4, dtype=torch.float16)), ValueError),
        ("scale", dict(g, scale=torch.ones(5)), ValueError),
        ("out", dict(g, out=torch.empty(4, dtype=torch.float64)), ValueError),
        ("out", dict(g, out=torch.empty(5)), ValueError),
        ("z must be a CUDA tensor", g, ValueError),  # all well formed, but on the CPU
    ]


@pytest.mark.parametrize("name,kwargs,error", _bad_cases())
def test_bad_arguments_name_themselves(name, kwargs, error):
    with pytest.raises(error, match=rf"^loss_and_dlogits_: {name}\b"):
        loss_and_dlogits_(**kwargs)


def test_z_requiring_grad_is_refused_only_when_overwritten():
    kwargs = dict(_good(), z=torch.randn(4, 10, requires_grad=True), write_dlogits=False)
    with pytest.raises(ValueError, match="z must be a CUDA tensor"):
        loss_and_dlogits_(**kwargs)
