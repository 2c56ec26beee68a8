"""The ops' argument checks: a wrong kind of value is a TypeError, a value outside what the
op accepts a ValueError, each naming the op and the argument, before anything reaches the
native module. The bounds of threads and block_size are the public options'."""

import re

import numpy as np
import pytest
import torch

from trainstream import QuantizedWeight, ops, options

FLT_MAX = torch.finfo(torch.float32).max
QUANTIZE = [ops.quantize_nf4, ops.quantize_int8]


def _adamw_args(**changes):
    args = dict(
        params=[torch.zeros(4)],
        grads=[torch.zeros(4)],
        exp_avgs=[torch.zeros(4)],
        exp_avg_sqs=[torch.zeros(4)],
        steps=[1],
        lr=1e-3,
    )
    args.update(changes)
    return args


def _adamw(**changes):
    args = _adamw_args(**changes)
    return ops.adamw_step(
        args.pop("params"), args.pop("grads"), args.pop("exp_avgs"), args.pop("exp_avg_sqs"), args.pop("steps"), **args
    )


# -- not a tensor -----------------------------------------------------------------------------


@pytest.mark.parametrize("quantize", QUANTIZE)
@pytest.mark.parametrize("x", [None, [1.0, 2.0], np.zeros(4, dtype=np.float32), 3.0])
def test_quantize_refuses_what_is_not_a_tensor(quantize, x):
    with pytest.raises(TypeError, match=rf"^{quantize.__name__}: x must be a torch.Tensor, got "):
        quantize(x)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: ops.dequantize_nf4(None, torch.zeros(1), (8,), torch.float32),
            r"^dequantize_nf4: packed must be a torch.Tensor, got NoneType",
        ),
        (
            lambda: ops.dequantize_int8(torch.zeros(8, dtype=torch.int8), [0.0], (8,), torch.float32),
            r"^dequantize_int8: absmax must be a torch.Tensor, got list",
        ),
        (
            lambda: ops.dequantize_nf4(
                torch.zeros(4, dtype=torch.uint8), torch.zeros(1), (8,), torch.float32, out=np.zeros(8)
            ),
            r"^dequantize_nf4: out must be a torch.Tensor, got ndarray",
        ),
        (lambda: _adamw(params=None), r"^adamw_step: params must be a list or tuple of torch.Tensor, got NoneType"),
        (lambda: _adamw(grads=torch.zeros(4)), r"^adamw_step: grads must be a list or tuple of torch.Tensor"),
        (lambda: _adamw(exp_avgs=[np.zeros(4)]), r"^adamw_step: exp_avgs\[0\] must be a torch.Tensor, got ndarray"),
        (lambda: _adamw(param_copies=[None]), r"^adamw_step: param_copies\[0\] must be a torch.Tensor"),
        (lambda: _adamw(steps=None), r"^adamw_step: steps must be a list or tuple of integers, got NoneType"),
        (lambda: _adamw(steps=[1.5]), r"^adamw_step: steps\[0\] must be an integer, got float"),
        (lambda: _adamw(seeds=["x"]), r"^adamw_step: seeds\[0\] must be an integer, got str"),
        (lambda: _adamw(lr="0.1"), r"^adamw_step: lr must be a real number, got str"),
        (lambda: _adamw(lr=None), r"^adamw_step: lr must be a real number, got NoneType"),
        (lambda: _adamw(beta1=True), r"^adamw_step: beta1 must be a real number, got bool"),
        (lambda: _adamw(eps=torch.tensor(1e-8)), r"^adamw_step: eps must be a real number, got Tensor"),
        (lambda: _adamw(decoupled=1), r"^adamw_step: decoupled must be True or False, got 1"),
        (lambda: _adamw(priority="high"), r"^adamw_step: priority must be an integer, got str"),
        (lambda: ops.accumulate_(None, [torch.zeros(2)]), r"^accumulate_: dsts must be a list or tuple"),
        (lambda: ops.accumulate_([torch.zeros(2)], [[0.0, 0.0]]), r"^accumulate_: srcs\[0\] must be a torch.Tensor"),
        (lambda: ops.grad_sq_norms([None]), r"^grad_sq_norms: tensors\[0\] must be a torch.Tensor"),
        (lambda: ops.grad_sq_norms(3), r"^grad_sq_norms: tensors must be a list or tuple of torch.Tensor"),
    ],
)
def test_a_value_that_is_not_a_tensor_or_a_number_is_a_type_error_naming_it(call, match):
    with pytest.raises(TypeError, match=match):
        call()


# -- dequantize's shape and dtype -------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, error, match",
    [
        (None, TypeError, r"^dequantize_nf4: shape must be a torch.Size, list or tuple of integers >= 0, got None"),
        (8, TypeError, r"^dequantize_nf4: shape must be a torch.Size, list or tuple"),
        ("8", TypeError, r"^dequantize_nf4: shape must be a torch.Size, list or tuple"),
        ((2.0, 4), TypeError, r"^dequantize_nf4: shape must hold integers >= 0, got \(2.0, 4\)"),
        ((-2, -4), ValueError, r"^dequantize_nf4: shape must hold integers >= 0, got \(-2, -4\)"),
        ([4, -1], ValueError, r"^dequantize_nf4: shape must hold integers >= 0, got \(4, -1\)"),
    ],
)
def test_dequantize_names_a_bad_shape(shape, error, match):
    packed, absmax = ops.quantize_nf4(torch.randn(8))
    with pytest.raises(error, match=match):
        ops.dequantize_nf4(packed, absmax, shape, torch.float32)


@pytest.mark.parametrize("dtype", ["float32", torch.int32, None, np.float32])
def test_dequantize_names_a_bad_dtype(dtype):
    codes, absmax = ops.quantize_int8(torch.randn(8))
    with pytest.raises(ValueError, match=r"^dequantize_int8: dtype must be one of \['torch.float32'"):
        ops.dequantize_int8(codes, absmax, (8,), dtype)


def test_dequantize_takes_a_shape_as_size_list_or_tuple():
    x = torch.randn(2, 4)
    packed, absmax = ops.quantize_nf4(x)
    want = ops.dequantize_nf4(packed, absmax, x.shape, torch.float32)
    for shape in ([2, 4], (2, 4), (np.int64(2), 4)):
        assert torch.equal(ops.dequantize_nf4(packed, absmax, shape, torch.float32), want)


# -- block_size and threads: the options' bounds ----------------------------------------------


@pytest.mark.parametrize("block_size", [2**40, options.MAX_QUANT_BLOCK_SIZE + 2, 0, 3, -64, 64.0, True, "64", None])
@pytest.mark.parametrize("quantize", QUANTIZE)
def test_quantize_bounds_block_size_as_the_option(quantize, block_size):
    with pytest.raises(
        ValueError,
        match=rf"^{quantize.__name__}: block_size must be an even integer >= 2 and <= {options.MAX_QUANT_BLOCK_SIZE}",
    ):
        quantize(torch.randn(8), block_size)


def test_quantize_takes_the_largest_block_size():
    x = torch.randn(options.MAX_QUANT_BLOCK_SIZE + 10)
    codes, absmax = ops.quantize_nf4(x, options.MAX_QUANT_BLOCK_SIZE)
    assert absmax.numel() == 2


@pytest.mark.parametrize("block_size", [2**40, 4098])
def test_dequantize_and_quantized_weight_bound_block_size(block_size):
    codes, absmax = ops.quantize_int8(torch.randn(8))
    with pytest.raises(ValueError, match=r"^dequantize_int8: block_size must be an even integer >= 2 and <= 4096"):
        ops.dequantize_int8(codes, absmax, (8,), torch.float32, block_size)
    with pytest.raises(ValueError, match=r"^QuantizedWeight: block_size must be an even integer >= 2 and <= 4096"):
        QuantizedWeight(codes, absmax, (8,), torch.float32, "int8", block_size)
    with pytest.raises(ValueError, match=r"^quantize_int8: block_size must be"):
        QuantizedWeight.quantize(torch.randn(8), "int8", block_size)


def _more_than_the_cores():
    return options.available_cores() + 1


@pytest.mark.parametrize(
    "call",
    [
        lambda t: ops.get_pool(t),
        lambda t: _adamw(threads=t),
        lambda t: ops.accumulate_([torch.zeros(2)], [torch.zeros(2)], threads=t),
    ],
    ids=["get_pool", "adamw_step", "accumulate_"],
)
@pytest.mark.parametrize("threads", [_more_than_the_cores(), 100000, 0, -1, 1.5, True, "2"])
def test_ops_bound_threads_as_the_option(call, threads):
    with pytest.raises(ValueError, match=r"threads must be None or an integer >= 1 and <= \d+"):
        call(threads)


def test_ops_take_every_core():
    cores = options.available_cores()
    p = torch.zeros(4)
    _adamw(params=[p], grads=[torch.ones(4)], threads=cores).wait()
    assert (p < 0).all()  # the update ran


# -- QuantizedWeight.dequantize_into ----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize(
    "make_out, what",
    [
        (lambda: torch.full((16097 + 12 * 10,), 7.0), "larger"),
        (lambda: torch.full((12, 9), 7.0), "smaller"),
        (lambda: torch.full((10, 12), 7.0), "transposed shape"),
        (lambda: torch.full((12, 10), 7, dtype=torch.int32), "int32"),
        (lambda: torch.full((12, 10), 7.0, dtype=torch.float64), "float64"),
        (lambda: torch.full((10, 12), 7.0).t(), "not contiguous"),
        (lambda: torch.empty((12, 10), device="meta"), "another device"),
    ],
)
def test_dequantize_into_checks_out_and_writes_nothing_when_it_refuses(fmt, make_out, what):
    q = QuantizedWeight.quantize(torch.randn(12, 10), fmt)
    out = make_out()
    before = out.clone() if out.device.type != "meta" else None
    with pytest.raises(ValueError, match=r"^QuantizedWeight.dequantize_into: out must be a contiguous .* tensor of "):
        q.dequantize_into(out)
    if before is not None:
        assert torch.equal(out, before)


def test_dequantize_into_refuses_what_is_not_a_tensor():
    q = QuantizedWeight.quantize(torch.randn(4, 4))
    with pytest.raises(TypeError, match=r"^QuantizedWeight.dequantize_into: out must be a torch.Tensor"):
        q.dequantize_into(np.zeros((4, 4), dtype=np.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_into_takes_any_value_dtype(dtype):
    q = QuantizedWeight.quantize(torch.randn(12, 10), "nf4")
    out = torch.empty(12, 10, dtype=dtype)
    q.dequantize_into(out)
    assert torch.equal(out, q.dequantize(dtype=dtype))


# -- an all-NaN block -------------------------------------------------------------------------


def test_an_all_nan_nf4_block_keeps_bitsandbytes_start_value():
    # bitsandbytes' CUDA kernel takes each block's absmax with fmaxf from -FLT_MAX, which
    # skips NaN: an all-NaN block keeps -FLT_MAX, its NaNs get code 0 (-1.0), and dequantize
    # gives -1.0 * -FLT_MAX. A NaN beside finite values leaves their absmax alone.
    x = torch.randn(128)
    x[:64] = float("nan")
    x[100] = float("nan")
    packed, absmax = ops.quantize_nf4(x, 64)
    assert absmax[0].item() == -FLT_MAX
    assert absmax[1].item() == x[64:].nan_to_num(0.0).abs().max().item()
    assert (packed[:32] == 0).all()
    values = ops.dequantize_nf4(packed, absmax, x.shape, torch.float32, 64)
    assert (values[:64] == FLT_MAX).all()
    assert values[100].item() == -absmax[1].item()


def test_an_all_nan_int8_block_has_absmax_zero_and_dequantizes_to_zeros():
    x = torch.full((64,), float("nan"))
    codes, absmax = ops.quantize_int8(x, 64)
    assert absmax.tolist() == [0.0]
    assert (codes == 0).all()
    assert (ops.dequantize_int8(codes, absmax, x.shape, torch.float32, 64) == 0).all()


# -- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_dequantize_into_refuses_out_on_another_device():
    q = QuantizedWeight.quantize(torch.randn(12, 10, device="cuda"), "nf4")
    with pytest.raises(ValueError, match=r"^QuantizedWeight.dequantize_into: out must be a contiguous .* on cuda:0"):
        q.dequantize_into(torch.empty(12, 10))
    out = torch.empty(12, 10, device="cuda")
    q.dequantize_into(out)
    assert torch.equal(out, q.dequantize())


@pytest.mark.gpu
def test_gpu_an_all_nan_nf4_block_matches_the_cpu_and_bitsandbytes():
    x = torch.randn(128)
    x[:64] = float("nan")
    packed, absmax = ops.quantize_nf4(x.cuda(), 64)
    assert absmax[0].item() == -FLT_MAX
    cpu_packed, cpu_absmax = ops.quantize_nf4(x, 64)
    assert torch.equal(packed[:32].cpu(), cpu_packed[:32])
    bnb = pytest.importorskip("bitsandbytes.functional")
    bnb_packed, state = bnb.quantize_4bit(x.cuda(), blocksize=64, quant_type="nf4")
    assert state.absmax[0].item() == -FLT_MAX
    assert torch.equal(bnb_packed.flatten()[:32].cpu(), cpu_packed[:32])


# -- QuantizedWeight's parts --------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            dict(codes=torch.zeros(1, dtype=torch.uint8)),
            ValueError,
            r"codes must be a contiguous torch.uint8 tensor of 60",
        ),
        (dict(codes=torch.zeros(120, dtype=torch.int8)), ValueError, r"codes must be a contiguous torch.uint8 tensor"),
        (dict(codes=None), TypeError, r"codes must be a torch.Tensor"),
        (dict(absmax=torch.zeros(1)), ValueError, r"absmax must be a contiguous float32 tensor of 2 elements"),
        (dict(absmax=torch.zeros(2, dtype=torch.float64)), ValueError, r"absmax must be a contiguous float32"),
        (dict(absmax=torch.zeros(2, device="meta")), ValueError, r"codes and absmax must be on one CPU or CUDA"),
        (dict(shape=(1000, 1000)), ValueError, r"codes must be a contiguous torch.uint8 tensor of 500000"),
        (dict(shape=None), TypeError, r"shape must be a torch.Size, list or tuple"),
        (dict(shape=(-12, -10)), ValueError, r"shape must hold integers >= 0"),
        (dict(dtype="float32"), ValueError, r"dtype must be one of"),
        (dict(dtype=torch.int32), ValueError, r"dtype must be one of"),
        (dict(format="NF4"), ValueError, r"format must be one of \('nf4', 'int8'\)"),
        (dict(format=["nf4"]), ValueError, r"format must be one of"),
        (dict(block_size=2**40), ValueError, r"block_size must be an even integer >= 2 and <= 4096"),
    ],
)
def test_quantized_weight_checks_its_parts(change, error, match):
    # dequantize_into trusts the codes a QuantizedWeight holds: a weight of 10^6 values over
    # one byte of codes would be read far past it.
    q = QuantizedWeight.quantize(torch.randn(12, 10), "nf4")
    parts = dict(codes=q.codes, absmax=q.absmax, shape=q.shape, dtype=q.dtype, format="nf4", block_size=64)
    parts.update(change)
    with pytest.raises(error, match=rf"^QuantizedWeight: {match}"):
        QuantizedWeight(**parts)


# -- quantize's out= buffers --------------------------------------------------------------------


def _quantize_out(quantize, n=100, block_size=64):
    """Buffers of the right layout for quantize(x of n values, block_size, out=...)."""
    codes, absmax = quantize(torch.randn(n), block_size)
    return torch.empty_like(codes), torch.empty_like(absmax)


@pytest.mark.parametrize("quantize", QUANTIZE)
@pytest.mark.parametrize(
    "which, make, what",
    [
        (0, lambda t: t[:-1], "one code too few"),
        (0, lambda t: torch.empty(t.numel() + 1, dtype=t.dtype), "one code too many"),
        (0, lambda t: torch.empty(t.numel(), dtype=torch.int16), "another code dtype"),
        (0, lambda t: torch.empty(t.numel() * 2, dtype=t.dtype)[::2], "strided codes"),
        (0, lambda t: torch.empty(t.numel(), dtype=t.dtype, device="meta"), "codes on another device"),
        (1, lambda t: t[:-1], "one scale too few"),
        (1, lambda t: torch.empty(t.numel(), dtype=torch.float64), "float64 scales"),
        (1, lambda t: torch.empty(t.numel() * 2)[::2], "strided scales"),
        (1, lambda t: torch.empty(t.numel(), device="meta"), "scales on another device"),
    ],
)
def test_quantize_out_names_the_buffer_with_the_wrong_layout_and_writes_nothing(quantize, which, make, what):
    out = list(_quantize_out(quantize))
    out[which] = make(out[which])
    other = out[1 - which].fill_(3)
    name = ("out[0] (codes)", "out[1] (absmax)")[which]
    with pytest.raises(ValueError, match=rf"^{quantize.__name__}: {re.escape(name)} must be a contiguous "):
        quantize(torch.randn(100), 64, out=tuple(out))
    assert torch.all(other == 3), what


@pytest.mark.parametrize("quantize", QUANTIZE)
def test_quantize_out_must_be_a_pair_of_tensors(quantize):
    codes, absmax = _quantize_out(quantize)
    x = torch.randn(100)
    for out in (codes, (codes,), (codes, absmax, absmax), "out"):
        with pytest.raises(TypeError, match=rf"^{quantize.__name__}: out must be a \(codes, absmax\) tuple"):
            quantize(x, out=out)
    with pytest.raises(TypeError, match=rf"^{quantize.__name__}: out\[1\] \(absmax\) must be a torch.Tensor"):
        quantize(x, out=(codes, [0.0, 0.0]))
    with pytest.raises(TypeError, match=rf"^{quantize.__name__}: out\[0\] \(codes\) must be a torch.Tensor"):
        quantize(x, out=(np.zeros(codes.numel()), absmax))


@pytest.mark.parametrize("quantize", QUANTIZE)
def test_quantize_out_refuses_buffers_over_each_other_or_over_the_input(quantize):
    codes, absmax = _quantize_out(quantize, n=128)
    raw = torch.zeros(4096, dtype=torch.uint8)
    over = raw[: codes.numel()].view(codes.dtype), raw[8 : 8 + 4 * absmax.numel()].view(torch.float32)
    with pytest.raises(ValueError, match=rf"^{quantize.__name__}: out\[0\] \(codes\) must not overlap the memory"):
        quantize(torch.randn(128), out=over)
    x = torch.randn(128)
    on_x = x.view(torch.uint8)[: codes.numel()].view(codes.dtype)
    with pytest.raises(ValueError, match=rf"^{quantize.__name__}: out\[0\] \(codes\) must not overlap the memory of x"):
        quantize(x, out=(on_x, absmax))
    assert torch.all(raw == 0)


@pytest.mark.parametrize("registered", [False, True], ids=["direct", "registered op"])
@pytest.mark.parametrize("quantize", QUANTIZE)
def test_quantize_out_refuses_buffers_inside_a_strided_inputs_extent(quantize, registered):
    # x is every other float of `store`: the codes on the floats between x's own would not
    # be read (x goes through a contiguous copy) but would still overwrite the caller's x
    store = torch.randn(4096)
    x = store[::2]
    before = store.clone()
    codes, absmax = _quantize_out(quantize, n=x.numel())
    inside = store.view(torch.uint8)[1024 : 1024 + codes.numel()].view(codes.dtype)
    op = getattr(torch.ops.trainstream, f"{quantize.__name__}_out")
    with pytest.raises(ValueError, match=rf"^{quantize.__name__}: out\[0\] \(codes\) must not overlap the memory of x"):
        if registered:
            op(x, 64, inside, absmax)
        else:
            quantize(x, 64, out=(inside, absmax))
    assert torch.equal(store, before)
    # a buffer right after x's last element is not x's: accepted
    store = torch.randn(4096 + 64)
    x = store[:4095:2]  # 2048 values, the last one the float at 4094
    want = quantize(x.clone())
    absmax = store[4095 : 4095 + want[1].numel()]
    quantize(x, 64, out=(codes, absmax))
    assert torch.equal(codes, want[0]) and torch.equal(absmax, want[1])


def test_quantized_weight_quantize_checks_out_as_the_op():
    w = torch.randn(16, 8)
    codes, absmax = _quantize_out(ops.quantize_int8, n=128)
    with pytest.raises(ValueError, match=r"^quantize_int8: out\[1\] \(absmax\) must be a contiguous torch.float32"):
        QuantizedWeight.quantize(w, "int8", 64, out=(codes, absmax[:1]))
