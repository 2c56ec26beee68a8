"""NF4 and int8 quantization: native vs the pure-torch twin vs bitsandbytes, CPU and CUDA."""

import math

import pytest
import torch
from helpers import assert_same_bits

from trainstream import QuantizedWeight, ops
from trainstream.ops import quant as qops
from trainstream.ops import reference

FORMATS = {
    "nf4": (ops.quantize_nf4, ops.dequantize_nf4, reference.quantize_nf4, reference.dequantize_nf4),
    "int8": (ops.quantize_int8, ops.dequantize_int8, reference.quantize_int8, reference.dequantize_int8),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def sample(n, dtype, seed=0, zero_block=None):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02
    if zero_block is not None:
        x[zero_block] = 0
    return x.to(dtype)


def at_each_simd_level(call):
    """call() at the scalar level and at the best one this CPU offers: the results, in that order."""
    from trainstream import _native

    C = _native.lib()
    results = []
    for level in ("scalar", C.best_simd_level()):
        C.set_simd_level(level)
        try:
            results.append(call())
        finally:
            C.set_simd_level(C.best_simd_level())
    return results


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [2, 6, 32, 64, 100, 128, 256, 4096])
@pytest.mark.parametrize("n", [1, 7, 64, 1001, 70_003])
def test_native_matches_reference(fmt, dtype, block_size, n):
    quantize, dequantize, ref_quantize, ref_dequantize = FORMATS[fmt]
    x = sample(n, dtype, seed=n + block_size, zero_block=slice(0, min(n, block_size)))
    codes, absmax = quantize(x, block_size)
    ref_codes, ref_absmax = ref_quantize(x, block_size)
    assert_same_bits(codes, ref_codes)
    assert_same_bits(absmax, ref_absmax)
    assert codes.numel() == (math.ceil(n / 2) if fmt == "nf4" else n)
    assert absmax.numel() == math.ceil(n / block_size)
    for out_dtype in DTYPES:
        got = dequantize(codes, absmax, x.shape, out_dtype, block_size)
        assert_same_bits(got, ref_dequantize(ref_codes, ref_absmax, x.shape, out_dtype, block_size))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_blocks_dequantize_to_zeros(fmt):
    quantize, dequantize = FORMATS[fmt][:2]
    x = torch.zeros(300, dtype=torch.bfloat16)
    x[128:192] = torch.randn(64).to(torch.bfloat16)
    codes, absmax = quantize(x, 64)
    y = dequantize(codes, absmax, x.shape, torch.bfloat16, 64)
    assert not y.isnan().any()
    assert (y[:128] == 0).all() and (y[192:] == 0).all()
    assert (absmax[[0, 1, 3, 4]] == 0).all()


def test_nf4_denormals_count_as_zero_like_bitsandbytes():
    tiny = torch.full((64,), 1e-40)  # fp32 denormals: bitsandbytes' kernel flushes them
    codes, absmax = ops.quantize_nf4(tiny, 64)
    assert absmax.item() == 0.0
    assert (ops.dequantize_nf4(codes, absmax, tiny.shape, torch.float32) == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_inputs_behave_as_documented(fmt):
    quantize, dequantize = FORMATS[fmt][:2]
    x = torch.randn(192)
    x[5] = float("nan")  # block 0: NaN ignored by absmax, code 0
    x[64 + 7] = float("inf")  # block 1: absmax inf, the block dequantizes to non-finite
    codes, absmax = quantize(x, 64)
    assert absmax[0] == x[:64].nan_to_num(0).abs().max()
    assert absmax[1] == float("inf")
    assert torch.isfinite(absmax[2])
    y = dequantize(codes, absmax, x.shape, torch.float32, 64)
    if fmt == "nf4":
        assert y[5] == -absmax[0]
    else:
        assert y[5] == 0
    assert not torch.isfinite(y[64:128]).any()
    assert torch.isfinite(y[128:]).all() and torch.isfinite(y[:5]).all()
    # matches the twin on these values too
    ref_codes, ref_absmax = FORMATS[fmt][2](x, 64)
    assert_same_bits(codes, ref_codes)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [32, 64, 256, 6])  # fixed-size block loops and the general one
def test_blocks_of_special_values_match_the_reference_at_every_simd_level(fmt, block_size):
    # Per block: all NaN, all zero, -0.0 with denormals, NaN beside the block's max, the max
    # in the last lane, a negative max: each block's absmax reduction sees its own case.
    n = block_size
    blocks = [
        torch.full((n,), float("nan")),
        torch.zeros(n),
        torch.full((n,), -0.0),
        torch.full((n,), 1e-40),
        torch.randn(n),
        torch.randn(n),
        torch.randn(n),
    ]
    blocks[2][n // 2] = -1e-41
    blocks[4][0], blocks[4][1] = float("nan"), 50.0
    blocks[5][-1] = 60.0
    blocks[6][n // 3] = -70.0
    x = torch.cat(blocks)
    quantize, reference_quantize = FORMATS[fmt][0], FORMATS[fmt][2]
    expected = reference_quantize(x, block_size)
    for got in at_each_simd_level(lambda: quantize(x, block_size)):
        assert_same_bits(got[0], expected[0])
        assert_same_bits(got[1], expected[1])


def test_nf4_packing_first_element_in_high_nibble():
    # Values chosen on NF4 levels: with absmax 1, each maps to its own code.
    x = torch.tensor([-1.0, 1.0, 0.0, 0.0795802995, 0.7229568362], dtype=torch.float32)
    packed, absmax = ops.quantize_nf4(x, 2 * 3)  # one block of 6 holds all five (and a pad)
    assert absmax.item() == 1.0
    assert packed.tolist() == [0x0F, 0x78, 0xE7]  # (-1, 1), (0, level 8), (level 14, zero pad)


def test_nf4_threshold_values_take_the_lower_code():
    # A value exactly on a threshold takes the lower code; one ulp above takes the upper.
    t = reference.NF4_THRESHOLDS
    above = torch.nextafter(t, torch.tensor(2.0))
    x = torch.cat([t, above, torch.tensor([1.0])])  # the 1.0 makes absmax exactly 1
    packed, _ = ops.quantize_nf4(x, 32)
    codes = torch.stack([packed >> 4, packed & 15], 1).reshape(-1)[: x.numel()]
    assert codes[:15].tolist() == list(range(15))
    assert codes[15:30].tolist() == list(range(1, 16))


@pytest.mark.parametrize("block_size", [64, 6])  # a fixed-size block loop and the general one
def test_nf4_codes_at_every_threshold_match_the_reference_at_every_simd_level(block_size):
    # Values on each threshold, one ulp either side and a dense sweep of [-1, 1], with a 1.0
    # in every block so that each value is its own normalized value: every code boundary of
    # the vectorized search is crossed, at each SIMD level the CPU offers.
    t = reference.NF4_THRESHOLDS
    vals = torch.cat(
        [
            t,
            torch.nextafter(t, torch.tensor(2.0)),
            torch.nextafter(t, torch.tensor(-2.0)),
            torch.linspace(-1, 1, 20_001),
            torch.tensor([float("nan"), -0.0, 1e-40]),
        ]
    )
    per_block = block_size - 1
    vals = torch.cat([vals, torch.zeros(-vals.numel() % per_block)]).view(-1, per_block)
    x = torch.cat([torch.ones(vals.shape[0], 1), vals], 1).reshape(-1)
    expected = reference.quantize_nf4(x, block_size)
    for got in at_each_simd_level(lambda: ops.quantize_nf4(x, block_size)):
        assert_same_bits(got[0], expected[0])
        assert_same_bits(got[1], expected[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_mean_relative_error_on_random_weights(fmt):
    quantize, dequantize = FORMATS[fmt][:2]
    x = torch.randn(1 << 18, dtype=torch.bfloat16)
    y = dequantize(*quantize(x, 64), x.shape, torch.bfloat16, 64)
    err = ((y.float() - x.float()).abs().mean() / x.float().abs().mean()).item()
    assert err == pytest.approx({"nf4": 0.091, "int8": 0.0065}[fmt], rel=0.1)


def test_thread_count_and_simd_level_do_not_change_codes():
    x = sample(300_001, torch.bfloat16, seed=3)
    expected = ops.quantize_nf4(x, 64)
    for got in at_each_simd_level(lambda: ops.quantize_nf4(x, 64)):
        assert_same_bits(got[0], expected[0])


def test_out_argument_and_shapes():
    x = sample(37 * 11, torch.float16).view(37, 11)
    packed, absmax = ops.quantize_nf4(x, 64)
    out = torch.empty(37, 11, dtype=torch.bfloat16)
    assert ops.dequantize_nf4(packed, absmax, (37, 11), torch.bfloat16, out=out) is out
    assert_same_bits(out, ops.dequantize_nf4(packed, absmax, (37, 11), torch.bfloat16))
    noncontig = sample(40 * 8, torch.float32).view(40, 8).t()  # quantize reads it as contiguous values
    assert_same_bits(ops.quantize_int8(noncontig)[0], ops.quantize_int8(noncontig.contiguous())[0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.quantize_nf4(torch.zeros(8), 3), "block_size must be an even integer >= 2 and <= 4096, got 3"),
        (lambda: ops.quantize_nf4(torch.zeros(8), 0), "block_size must be an even integer >= 2"),
        (lambda: ops.quantize_int8(torch.zeros(8), True), "block_size must be an even integer >= 2"),
        (lambda: ops.quantize_nf4(torch.zeros(8, dtype=torch.float64)), "x dtype must be one of"),
        (
            lambda: ops.dequantize_nf4(torch.zeros(3, dtype=torch.uint8), torch.zeros(1), (8,), torch.float32),
            "codes must be a contiguous torch.uint8 tensor of 4 elements",
        ),
        (
            lambda: ops.dequantize_nf4(torch.zeros(4, dtype=torch.uint8), torch.zeros(2), (8,), torch.float32),
            "absmax must be a contiguous float32 tensor of 1 elements",
        ),
        (
            lambda: ops.dequantize_int8(torch.zeros(8, dtype=torch.uint8), torch.zeros(1), (8,), torch.float32),
            "codes must be a contiguous torch.int8 tensor",
        ),
        (
            lambda: ops.dequantize_int8(torch.zeros(8, dtype=torch.int8), torch.zeros(1), (8,), torch.int32),
            "dtype must be one of",
        ),
        (
            lambda: ops.dequantize_int8(
                torch.zeros(8, dtype=torch.int8), torch.zeros(1), (8,), torch.float32, out=torch.empty(4)
            ),
            "out must be a contiguous torch.float32 tensor of shape",
        ),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck(fmt):
    x = sample(333, torch.bfloat16)
    name = fmt
    codes, absmax = getattr(ops, f"quantize_{name}")(x, 64)
    torch.library.opcheck(getattr(torch.ops.trainstream, f"quantize_{name}").default, (x, 64))
    torch.library.opcheck(
        getattr(torch.ops.trainstream, f"dequantize_{name}").default, (codes, absmax, [333], torch.bfloat16, 64)
    )
    torch.library.opcheck(
        getattr(torch.ops.trainstream, f"dequantize_{name}_out").default,
        (codes, absmax, 64, torch.empty(333, dtype=torch.bfloat16)),
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_traced_code_takes_the_registered_op_and_eager_code_the_same_values(fmt):
    # Eager calls on plain tensors skip torch.library's dispatch (ops/quant.py); traced code
    # must still see the registered op: reading data_ptr() of a fake tensor would break the
    # graph, which fullgraph=True turns into an error.
    quantize, dequantize = getattr(ops, f"quantize_{fmt}"), getattr(ops, f"dequantize_{fmt}")
    x = sample(333, torch.bfloat16)

    def round_trip(x):
        codes, absmax = quantize(x, 64)
        return dequantize(codes, absmax, [333], torch.bfloat16, 64), codes, absmax

    traced = torch.compile(round_trip, backend="aot_eager", fullgraph=True)(x)
    eager = round_trip(x)
    registered = getattr(torch.ops.trainstream, f"quantize_{fmt}")(x, 64)
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))
    assert torch.equal(eager[1], registered[0]) and torch.equal(eager[2], registered[1])
    # A dispatch mode sees the op too (FakeTensorMode: shapes only, no native call).
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_codes, fake_absmax = quantize(mode.from_tensor(x), 64)
    assert fake_codes.shape == eager[1].shape and fake_absmax.shape == eager[2].shape


def test_quantized_weight_holder():
    w = sample(96 * 40, torch.bfloat16).view(96, 40)
    for fmt in ("nf4", "int8"):
        q = QuantizedWeight.quantize(w, fmt, block_size=128)
        assert q.shape == w.shape and q.dtype == w.dtype and q.format == fmt and q.block_size == 128
        deq = q.dequantize()
        assert deq.shape == w.shape and deq.dtype == w.dtype
        expected_bytes = (w.numel() // 2 if fmt == "nf4" else w.numel()) + math.ceil(w.numel() / 128) * 4
        assert q.nbytes == expected_bytes
        out = torch.empty_like(w)
        assert q.dequantize(out=out) is out and torch.equal(out, deq)
        assert_same_bits(q.to("cpu").dequantize(), deq)
    with pytest.raises(ValueError, match="format must be one of"):
        QuantizedWeight.quantize(w, "fp4")


# -- bitsandbytes (a test-only dependency) ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [64, 128, 4096])
def test_nf4_bit_identical_to_bitsandbytes_on_cpu(dtype, block_size):
    bnb = pytest.importorskip("bitsandbytes.functional")
    x = sample(3 * 4096 + 1000, dtype, seed=block_size)  # a partial last block
    q, state = bnb.quantize_4bit(x, blocksize=block_size, quant_type="nf4", compress_statistics=False)
    packed, absmax = ops.quantize_nf4(x, block_size)
    assert_same_bits(packed, q.view(-1))
    assert_same_bits(absmax, state.absmax)
    theirs = bnb.dequantize_4bit(q, state, quant_type="nf4").view(x.shape)
    ours = ops.dequantize_nf4(packed, absmax, x.shape, dtype, block_size)
    if dtype == torch.float16:
        # bitsandbytes' AVX-512 CPU kernel rounds a few fp16 results differently from its
        # CUDA kernel (which ours matches bit for bit, see the gpu test): within one ulp.
        step = torch.finfo(torch.float16).eps * ours.float().abs().clamp(min=2.0**-14)
        assert ((ours.float() - theirs.float()).abs() <= step).all()
    else:
        assert_same_bits(ours, theirs)


# -- CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [2, 6, 8, 16, 64, 100, 256, 4096])
@pytest.mark.parametrize("n", [1, 7, 64, 1001, 70_003, (1 << 20) + 512])
def test_cuda_matches_cpu(fmt, dtype, block_size, n):
    quantize, dequantize = FORMATS[fmt][:2]
    x = sample(n, dtype, seed=n + block_size, zero_block=slice(0, min(n, block_size)))
    cpu_codes, cpu_absmax = quantize(x, block_size)
    codes, absmax = quantize(x.cuda(), block_size)
    assert_same_bits(absmax.cpu(), cpu_absmax)
    if fmt == "int8":
        assert_same_bits(codes.cpu(), cpu_codes)
    else:
        # The GPU normalizes with the approximate reciprocal (as bitsandbytes' CUDA kernel
        # does): a code may differ only where x / absmax is within 2 ulp of a threshold.
        _assert_nf4_codes_agree(x, block_size, codes.cpu(), cpu_codes, cpu_absmax)
    for out_dtype in DTYPES:  # the same codes dequantize to the same bits on both devices
        got = dequantize(codes, absmax, x.shape, out_dtype, block_size).cpu()
        assert_same_bits(got, dequantize(codes.cpu(), absmax.cpu(), x.shape, out_dtype, block_size))


def _unpack(packed, n):
    return torch.stack([packed >> 4, packed & 15], 1).reshape(-1)[:n]


def _assert_nf4_codes_agree(x, block_size, gpu_packed, cpu_packed, absmax):
    n = x.numel()
    differ = (_unpack(gpu_packed, n) != _unpack(cpu_packed, n)).nonzero().flatten()
    if differ.numel() == 0:
        return
    s = x.float()[differ] / absmax.repeat_interleave(block_size)[:n][differ]
    gap = (s.unsqueeze(1) - reference.NF4_THRESHOLDS).abs().min(1).values
    assert (gap <= 2 * torch.finfo(torch.float32).eps * s.abs().clamp(min=1e-3)).all(), differ[:10]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [64, 128, 4096])
def test_cuda_nf4_bit_identical_to_bitsandbytes_cuda(dtype, block_size):
    bnb = pytest.importorskip("bitsandbytes.functional")
    x = sample((1 << 20) + 1001, dtype, seed=block_size, zero_block=slice(0, block_size)).cuda()
    x[block_size + 3] = float("nan")
    x[2 * block_size + 5] = 3e-39 if dtype != torch.float16 else 0.0  # flushed like bitsandbytes
    q, state = bnb.quantize_4bit(x, blocksize=block_size, quant_type="nf4", compress_statistics=False)
    packed, absmax = ops.quantize_nf4(x, block_size)
    assert_same_bits(packed, q.view(-1))
    assert_same_bits(absmax, state.absmax)
    theirs = bnb.dequantize_4bit(q, state, quant_type="nf4").view(x.shape)
    ours = ops.dequantize_nf4(packed, absmax, x.shape, dtype, block_size)
    nan = theirs.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert_same_bits(ours[~nan], theirs[~nan])


@pytest.mark.gpu
def test_cuda_ops_run_on_the_current_stream_and_opcheck():
    x = sample(1 << 22, torch.bfloat16).cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        packed, absmax = ops.quantize_nf4(x)
        y = ops.dequantize_nf4(packed, absmax, x.shape, torch.bfloat16)
        total = y.float().sum()  # same stream: must see the finished output
    torch.cuda.synchronize()
    ref = ops.dequantize_nf4(*ops.quantize_nf4(x.cpu()), x.shape, torch.bfloat16)
    assert torch.allclose(total.cpu(), ref.float().sum(), rtol=1e-4)
    torch.library.opcheck(torch.ops.trainstream.quantize_nf4.default, (x[:1000], 64))


@pytest.mark.gpu
def test_cuda_unaligned_views_use_the_general_path():
    x = sample(10_000, torch.bfloat16).cuda()
    packed, absmax = ops.quantize_nf4(x[2:], 64)  # still contiguous, offset by 4 bytes
    out = torch.empty(10_000, dtype=torch.bfloat16, device="cuda")[2:]
    ops.dequantize_nf4(packed, absmax, (9998,), torch.bfloat16, out=out)
    expected = ops.dequantize_nf4(packed.cpu(), absmax.cpu(), (9998,), torch.bfloat16)
    assert_same_bits(out.cpu(), expected)


@pytest.mark.gpu
def test_quantized_weight_moves_between_host_and_gpu():
    w = sample(4096 * 8, torch.bfloat16).view(4096, 8)
    q = QuantizedWeight.quantize(w, "nf4").pin_memory()
    assert q.is_pinned()
    g = q.to("cuda", non_blocking=True)
    assert g.device.type == "cuda"
    assert_same_bits(g.dequantize().cpu(), q.dequantize())


# -- quantize into given buffers (out=) ---------------------------------------------------------


def _views_of_one_buffer(fmt, n, block_size, dtype_fill=0xA5):
    """(codes, absmax) for `n` values as views of one byte buffer filled with garbage, the
    way the engine carves them from its host transfer memory: the quantizer must write every
    code and scale itself."""
    codes_n = -(-n // 2) if fmt == "nf4" else n
    code_dtype = torch.uint8 if fmt == "nf4" else torch.int8
    blocks = -(-n // block_size)
    start = -(-codes_n // 64) * 64
    buf = torch.full((start + 4 * blocks,), dtype_fill, dtype=torch.uint8)
    return buf[:codes_n].view(code_dtype), buf[start:].view(torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, block_size", [(1, 64), (333, 64), (4096 * 3 + 17, 64), (10_000, 4096), (257, 2)])
def test_quantize_into_given_buffers_gives_the_codes_of_the_allocating_form(fmt, dtype, n, block_size):
    quantize = FORMATS[fmt][0]
    x = sample(n, dtype, seed=n).view(1, n)
    want_codes, want_absmax = quantize(x, block_size)
    codes, absmax = _views_of_one_buffer(fmt, n, block_size)
    got = quantize(x, block_size, out=(codes, absmax))
    assert got[0] is codes and got[1] is absmax
    assert_same_bits(codes, want_codes)
    assert_same_bits(absmax, want_absmax)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_into_a_strided_input_quantizes_its_values(fmt):
    quantize = FORMATS[fmt][0]
    x = sample(64 * 40, torch.bfloat16).view(40, 64).t()  # not contiguous: read through a copy
    want = quantize(x.contiguous())
    out = _views_of_one_buffer(fmt, x.numel(), 64)
    quantize(x, out=out)
    assert_same_bits(out[0], want[0])
    assert_same_bits(out[1], want[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_weight_built_into_given_buffers_holds_them(fmt):
    w = sample(96 * 10, torch.bfloat16).view(96, 10)
    codes, absmax = _views_of_one_buffer(fmt, w.numel(), 64)
    q = QuantizedWeight.quantize(w, fmt, 64, out=(codes, absmax))
    assert q.codes is codes and q.absmax is absmax
    ref = QuantizedWeight.quantize(w, fmt, 64)
    assert_same_bits(q.codes, ref.codes)
    assert_same_bits(q.dequantize(), ref.dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
def test_writes_into_given_buffers_move_their_version_counters(fmt):
    # The native op writes through addresses: without the counters moving, autograd would
    # use a saved buffer overwritten after it was saved and raise nothing.
    quantize, dequantize = FORMATS[fmt][:2]
    codes, absmax = quantize(sample(256, torch.float32))
    w = torch.ones(absmax.numel(), requires_grad=True)
    y = (w * absmax).sum()  # saves absmax for w's gradient
    quantize(sample(256, torch.float32, seed=1) * 10, out=(codes, absmax))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    out = torch.empty(16, 16)
    for write in (
        lambda: dequantize(codes, absmax, (16, 16), torch.float32, out=out),
        lambda: QuantizedWeight.quantize(sample(256, torch.float32).view(16, 16), fmt).dequantize_into(out),
        lambda: qops.dequantize_many(fmt, [codes], [absmax], [out]),
    ):
        version = out._version
        write()
        assert out._version > version


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck_quantize_out(fmt):
    x = sample(333, torch.bfloat16)
    codes, absmax = getattr(ops, f"quantize_{fmt}")(x, 64)
    torch.library.opcheck(
        getattr(torch.ops.trainstream, f"quantize_{fmt}_out").default,
        (x, 64, torch.empty_like(codes), torch.empty_like(absmax)),
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_traced_quantize_into_takes_the_registered_op(fmt):
    quantize = FORMATS[fmt][0]
    x = sample(640, torch.float32)
    want = quantize(x)

    def into(x, codes, absmax):
        quantize(x, 64, out=(codes, absmax))
        return codes, absmax

    codes, absmax = torch.empty_like(want[0]), torch.empty_like(want[1])
    torch.compile(into, backend="eager", fullgraph=True)(x, codes, absmax)
    assert_same_bits(codes, want[0])
    assert_same_bits(absmax, want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_quantize_into_given_buffers_gives_the_codes_of_the_allocating_form(fmt):
    quantize = FORMATS[fmt][0]
    x = sample(4096 * 5 + 3, torch.bfloat16).cuda()
    want_codes, want_absmax = quantize(x)
    codes, absmax = torch.full_like(want_codes, 7), torch.full_like(want_absmax, 7.0)
    quantize(x, out=(codes, absmax))
    torch.cuda.synchronize()
    assert_same_bits(codes.cpu(), want_codes.cpu())
    assert_same_bits(absmax.cpu(), want_absmax.cpu())
