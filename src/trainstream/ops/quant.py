"""NF4 and int8 blockwise quantization of frozen weights, on CPU and CUDA tensors.

NF4 is bitsandbytes' format, bit for bit: 16 NormalFloat levels, one float32 absmax per
block, two codes per byte with the first element in the high nibble. int8 is symmetric:
``q = rint(x * 127 / absmax)`` per block, dequantized as ``q * (absmax / 127)``.

On CUDA, NF4 codes equal bitsandbytes' CUDA kernel's, which normalizes with the GPU's
approximate reciprocal of absmax; the CPU uses the exactly rounded reciprocal (as
bitsandbytes' CPU backend does), so a code can differ between the two devices only for a
value within one ulp of a decision threshold, or in a float32 block whose absmax exceeds
2^126, where the GPU's reciprocal flushes to zero and every finite value gets code 7 (as
in bitsandbytes). Dequantizing the same codes gives the same values on both (NaN payloads
aside).

Non-finite input: a NaN quantizes to code 0 and the absmax is the largest |x| of the
block's other values (NF4: the NaN dequantizes to -absmax; int8: to 0). An all-NaN block
has no other value: NF4 reduces from -FLT_MAX with fmaxf, as bitsandbytes' CUDA kernel
does, so its absmax is -3.4028235e38 and its values dequantize to +3.4028235e38 (code 0
is -1.0); int8 reduces from 0, so its absmax is 0 and it dequantizes to zeros.
(bitsandbytes' pure-torch CPU path differs there: torch's max propagates NaN, giving a NaN
absmax for any block holding a NaN; the CUDA kernel, which QLoRA runs, is the reference.)
An infinity makes its block's absmax infinite, and that whole block then dequantizes to
NaN or infinities. An all-zero block (or, for NF4, one of denormals only, which count as
zero as in bitsandbytes) has absmax 0 and dequantizes to zeros. Frozen weights are
expected to be finite.

Each op is a ``torch.library`` custom op with a fake implementation, so ``torch.compile``
can trace it; eager calls on plain tensors run the same implementation without the
dispatcher's layers (see ``_direct``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from .._native import lib
from . import _args, _dtypes
from ._streams import current_stream_handle
from .adamw import get_pool

NF4, INT8 = 0, 1  # native QuantFormat
_cuda_ready = False  # require_cuda() has passed in this process
VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FORMAT_NAMES = {NF4: "nf4", INT8: "int8"}


def check_block_size(block_size, op: str = "QuantizedWeight") -> int:
    """An even integer from 2 to options.MAX_QUANT_BLOCK_SIZE (quant_block_size's bounds)."""
    return _args.block_size(op, block_size)


def check_out(op: str, out, shape: torch.Size, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """`out` for dequantized values: a contiguous tensor of `shape` on `device`, of `dtype`
    (None: any value dtype). The native op writes numel(shape) values of out's dtype at its
    address, so a larger or strided `out` would be written past its values, a smaller one
    past its end."""
    _args.tensor(op, "out", out)
    dtype_ok = out.dtype == dtype if dtype is not None else out.dtype in VALUE_DTYPES
    if out.shape != shape or not dtype_ok or out.device != device or not out.is_contiguous():
        wanted = str(dtype) if dtype is not None else f"({', '.join(map(str, VALUE_DTYPES))})"
        raise ValueError(
            f"{op}: out must be a contiguous {wanted} tensor of shape {tuple(shape)} on {device}, got "
            f"{'a' if out.is_contiguous() else 'a non-contiguous'} {out.dtype} tensor of shape "
            f"{tuple(out.shape)} on {out.device}"
        )


def code_numel(fmt: int, n: int) -> int:
    return -(-n // 2) if fmt == NF4 else n


def check_codes(op: str, fmt: int, codes, absmax, n: int, block_size: int) -> None:
    """Codes and absmax laid out as quantize makes them for `n` values: the kernels trust
    them (they read n codes and a scale per block at their addresses)."""
    code_dtype = _code_dtype(fmt)
    if codes.dtype != code_dtype or codes.numel() != code_numel(fmt, n) or not codes.is_contiguous():
        raise ValueError(
            f"{op}: codes must be a contiguous {code_dtype} tensor of {code_numel(fmt, n)} elements for "
            f"{n} {_FORMAT_NAMES[fmt]} values, got {codes.dtype} with {codes.numel()}"
        )
    blocks = -(-n // block_size)
    if absmax.dtype != torch.float32 or absmax.numel() != blocks or not absmax.is_contiguous():
        raise ValueError(
            f"{op}: absmax must be a contiguous float32 tensor of {blocks} elements "
            f"(one per block of {block_size}), got {absmax.dtype} with {absmax.numel()}"
        )
    if codes.device.type not in ("cpu", "cuda") or absmax.device != codes.device:
        raise ValueError(
            f"{op}: codes and absmax must be on one CPU or CUDA device, got {codes.device} and {absmax.device}"
        )


def _require_cuda() -> None:
    global _cuda_ready
    if not _cuda_ready:  # checked once: a LoRA step dequantizes every frozen weight twice
        from .._native import require_cuda

        require_cuda("GPU quantization")
        _cuda_ready = True


def _run(
    dequantize: bool, fmt: int, values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, block_size: int
) -> None:
    native = lib()
    args = (
        dequantize,
        fmt,
        values.numel(),
        block_size,
        _dtypes.code(values.dtype),
        values.data_ptr(),
        codes.data_ptr(),
        absmax.data_ptr(),
    )
    if values.device.type == "cuda":
        _require_cuda()
        native.quant_cuda(*args, values.device.index, current_stream_handle(values.device.index))
    else:
        native.quant_queue(get_pool(), *args).wait()


def _run_many(fmt: int, codes: Sequence, absmax: Sequence, outs: Sequence, block_size: int) -> None:
    """Dequantize each (codes[i], absmax[i]) into outs[i], all on one device. CUDA: one
    launch per value dtype among `outs` (the kernel takes one), on the current stream; the
    CPU: the host kernel of each tensor, queued together on the pool."""
    if not outs:
        return
    native = lib()
    device = outs[0].device
    if device.type != "cuda":
        pool = get_pool()
        queue = native.quant_queue
        jobs = [
            queue(
                pool,
                True,
                fmt,
                out.numel(),
                block_size,
                _dtypes.code(out.dtype),
                out.data_ptr(),
                c.data_ptr(),
                a.data_ptr(),
            )
            for c, a, out in zip(codes, absmax, outs)
        ]
        for job in jobs:
            job.wait()
        return
    _require_cuda()
    stream = current_stream_handle(device.index)
    dtype = outs[0].dtype
    if all(out.dtype is dtype for out in outs):  # the common case, one launch: no regrouping
        groups = {dtype: (codes, absmax, outs)}
    else:
        groups = {}
        for c, a, out in zip(codes, absmax, outs):
            group = groups.setdefault(out.dtype, ([], [], []))
            group[0].append(c)
            group[1].append(a)
            group[2].append(out)
    for dtype, (cs, ams, os_) in groups.items():
        native.dequantize_batch_cuda(
            fmt,
            _dtypes.code(dtype),
            [c.data_ptr() for c in cs],
            [a.data_ptr() for a in ams],
            [out.data_ptr() for out in os_],
            [out.numel() for out in os_],
            [block_size] * len(os_),
            device.index,
            stream,
        )


def _code_dtype(fmt: int) -> torch.dtype:
    return torch.uint8 if fmt == NF4 else torch.int8


def _quantize_impl(fmt: int, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    codes = torch.empty(code_numel(fmt, x.numel()), dtype=_code_dtype(fmt), device=x.device)
    absmax = torch.empty(-(-x.numel() // block_size), dtype=torch.float32, device=x.device)
    _run(False, fmt, x, codes, absmax, block_size)
    return codes, absmax


def _dequantize_impl(fmt: int, codes, absmax, shape, dtype, block_size: int) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    _run(True, fmt, out, codes, absmax, block_size)
    return out


def _plain(tensors) -> bool:
    """Every one of `tensors` is a torch.Tensor itself (no subclass, no fake): one set of
    their types, built in C, rather than a test per tensor in Python (an engine's fetch
    passes each of a unit's codes, scales and outputs)."""
    types = set(map(type, tensors))
    return not types or types == _TENSOR_ONLY


_TENSOR_ONLY = {torch.Tensor}


def _direct(*tensors) -> bool:
    """Run the implementation without torch.library's dispatch? Its layers cost tens of
    microseconds a call, as much as dequantizing a 7B model's weight takes on a GPU, and a
    LoRA step dequantizes every frozen weight twice. Only for plain tensors in eager code:
    traced code (torch.compile, export), fake or subclassed tensors and active dispatch
    modes take the registered op."""
    if torch.compiler.is_compiling() or not _plain(tensors):
        return False
    dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return dispatch_modes is not None and dispatch_modes() == 0


def _make_ops(fmt: int):
    name, code_dtype = _FORMAT_NAMES[fmt], _code_dtype(fmt)

    @torch.library.custom_op(f"trainstream::quantize_{name}", mutates_args=())
    def quantize_op(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _quantize_impl(fmt, x, block_size)

    @quantize_op.register_fake
    def _(x, block_size):
        n = x.numel()
        return (
            x.new_empty(code_numel(fmt, n), dtype=code_dtype),
            x.new_empty((n + block_size - 1) // block_size, dtype=torch.float32),
        )

    @torch.library.custom_op(f"trainstream::quantize_{name}_out", mutates_args=("codes", "absmax"))
    def quantize_out_op(x: torch.Tensor, block_size: int, codes: torch.Tensor, absmax: torch.Tensor) -> None:
        _refuse_overlap(f"quantize_{name}", x, codes, absmax)
        _run(False, fmt, x.contiguous(), codes, absmax, block_size)

    @quantize_out_op.register_fake
    def _(x, block_size, codes, absmax):
        return None

    @torch.library.custom_op(f"trainstream::dequantize_{name}", mutates_args=())
    def dequantize_op(
        codes: torch.Tensor, absmax: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, block_size: int
    ) -> torch.Tensor:
        return _dequantize_impl(fmt, codes, absmax, shape, dtype, block_size)

    @dequantize_op.register_fake
    def _(codes, absmax, shape, dtype, block_size):
        return codes.new_empty(shape, dtype=dtype)

    @torch.library.custom_op(f"trainstream::dequantize_{name}_out", mutates_args=("out",))
    def dequantize_out_op(codes: torch.Tensor, absmax: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
        _run(True, fmt, out, codes, absmax, block_size)

    @dequantize_out_op.register_fake
    def _(codes, absmax, block_size, out):
        return None

    return quantize_op, dequantize_op, dequantize_out_op, quantize_out_op


_nf4_ops = _make_ops(NF4)
_int8_ops = _make_ops(INT8)


def _check_values(op: str, x) -> None:
    _args.tensor(op, "x", x)
    if x.dtype not in VALUE_DTYPES:
        raise ValueError(f"{op}: x dtype must be one of {[str(d) for d in VALUE_DTYPES]}, got {x.dtype}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: x must be a CPU or CUDA tensor, got {x.device}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) of the bytes from a tensor's first element to the end of its last (the
    whole extent of a strided one, the gaps between its elements included: torch's strides
    are never negative)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _refuse_overlap(op: str, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """Quantize writes the codes and scales while it reads x: no two of them may share bytes.
    A strided x is read through a contiguous copy, but the writes would still change the
    caller's x: its whole extent counts. Reads addresses, so only real tensors are checked
    (the registered op checks when it runs)."""
    spans = {"out[0] (codes)": _byte_span(codes), "out[1] (absmax)": _byte_span(absmax), "x": _byte_span(x)}
    for (name, (s0, s1)), (other, (o0, o1)) in itertools.combinations(spans.items(), 2):
        if s0 < o1 and o0 < s1:
            raise ValueError(f"{op}: {name} must not overlap the memory of {other}")


def check_quantize_out(op: str, fmt: int, out, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`out` for quantize's results: a (codes, absmax) pair laid out as quantize makes them
    for `x` (codes: the format's code dtype, absmax: float32, one per block; each contiguous
    with exactly that many elements, on x's device). The native op writes that many codes
    and scales at their addresses, so a smaller or strided buffer would be written past its
    end or between its elements. Overlap is _refuse_overlap's."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"{op}: out must be a (codes, absmax) tuple of two tensors, got {type(out).__name__}")
    codes = _args.tensor(op, "out[0] (codes)", out[0])
    absmax = _args.tensor(op, "out[1] (absmax)", out[1])
    n = x.numel()
    _args.out_buffer(op, "out[0] (codes)", codes, _code_dtype(fmt), code_numel(fmt, n), x.device)
    _args.out_buffer(op, "out[1] (absmax)", absmax, torch.float32, -(-n // block_size), x.device)
    return codes, absmax


def _quantize(fmt: int, x: torch.Tensor, block_size: int, out=None):
    op = f"quantize_{_FORMAT_NAMES[fmt]}"
    _check_values(op, x)
    block_size = check_block_size(block_size, op)
    ops = _nf4_ops if fmt == NF4 else _int8_ops
    if out is None:
        if _direct(x):
            return _quantize_impl(fmt, x, block_size)
        return ops[0](x, block_size)
    codes, absmax = check_quantize_out(op, fmt, out, x, block_size)
    if _direct(x, codes, absmax):
        _refuse_overlap(op, x, codes, absmax)
        _run(False, fmt, x.contiguous(), codes, absmax, block_size)
        # the native op writes through addresses: autograd learns of it from the version
        # counters, as it does from the registered op (which declares its writes)
        torch.autograd.graph.increment_version((codes, absmax))
    else:
        ops[3](x, block_size, codes, absmax)
    return codes, absmax


def _dequantize(fmt: int, codes, absmax, shape, dtype, block_size, out):
    name = _FORMAT_NAMES[fmt]
    op = f"dequantize_{name}"
    _args.tensor(op, "codes" if fmt == INT8 else "packed", codes)
    _args.tensor(op, "absmax", absmax)
    block_size = check_block_size(block_size, op)
    shape = _args.shape(op, "shape", shape)
    dtype = _args.dtype(op, "dtype", dtype, VALUE_DTYPES)
    check_codes(op, fmt, codes, absmax, math.prod(shape), block_size)
    ops = _nf4_ops if fmt == NF4 else _int8_ops
    if out is None:
        if _direct(codes, absmax):
            return _dequantize_impl(fmt, codes, absmax, shape, dtype, block_size)
        return ops[1](codes, absmax, list(shape), dtype, block_size)
    check_out(op, out, torch.Size(shape), codes.device, dtype)
    if _direct(codes, absmax, out):
        _run(True, fmt, out, codes, absmax, block_size)
        torch.autograd.graph.increment_version(out)  # as the registered op's declared write does
    else:
        ops[2](codes, absmax, block_size, out)
    return out


def dequantize_trusted(
    format: str, codes: torch.Tensor, absmax: torch.Tensor, block_size: int, out: torch.Tensor
) -> None:
    """Dequantize into `out` without checking the arguments, for a caller that made them
    consistent (QuantizedWeight, whose codes come from quantize, and an `out` of its shape
    on its device): the checks cost about 20 microseconds a call, and a LoRA step over a
    quantized base dequantizes every frozen weight twice. Traced or subclassed tensors
    still take the checked op."""
    fmt = NF4 if format == "nf4" else INT8
    if _direct(codes, absmax, out):
        _run(True, fmt, out, codes, absmax, block_size)
        torch.autograd.graph.increment_version(out)  # as the registered op's declared write does
    else:
        _dequantize(fmt, codes, absmax, out.shape, out.dtype, block_size, out)


def _format_code(op: str, format) -> int:
    for code, name in _FORMAT_NAMES.items():
        if format == name:
            return code
    raise ValueError(f"{op}: format must be one of {list(_FORMAT_NAMES.values())}, got {format!r}")


def dequantize_many(
    format: str,
    codes: Sequence[torch.Tensor],
    absmax: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    block_size: int = 64,
) -> None:
    """Dequantize each ``(codes[i], absmax[i])`` of `format` ("nf4" or "int8") into
    ``outs[i]``: the same bits as ``dequantize_nf4`` / ``dequantize_int8`` with ``out=``, one
    tensor at a time. Every tensor on one CPU or CUDA device; each out contiguous, float32,
    bfloat16 or float16 (they may differ), of the numel its codes hold. On CUDA one kernel
    launch per out dtype (64 tensors a launch) on the current stream."""
    op = "dequantize_many"
    fmt = _format_code(op, format)
    codes = _args.tensors(op, "codes", codes)
    absmax = _args.tensors(op, "absmax", absmax)
    outs = _args.tensors(op, "outs", outs)
    if not len(codes) == len(absmax) == len(outs):
        raise ValueError(
            f"{op}: codes, absmax and outs must have one entry per tensor, got {len(codes)}, {len(absmax)} "
            f"and {len(outs)}"
        )
    block_size = check_block_size(block_size, op)
    device = outs[0].device if outs else None
    for i, (c, a, out) in enumerate(zip(codes, absmax, outs)):
        check_out(f"{op} (tensor {i})", out, out.shape, c.device)
        if out.device != device:
            raise ValueError(f"{op}: every tensor must be on one device, outs[{i}] is on {out.device}, not {device}")
        check_codes(f"{op} (tensor {i})", fmt, c, a, out.numel(), block_size)
    dequantize_many_trusted(format, codes, absmax, outs, block_size)


def dequantize_many_trusted(
    format: str, codes: Sequence[torch.Tensor], absmax: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], block_size
) -> None:
    """:func:`dequantize_many` without checking the arguments, for a caller that made them
    consistent (the engine's fetch of a unit's QuantizedWeights into views of one buffer):
    one native call for the unit instead of one checked call per weight. Traced or
    subclassed tensors take the checked per-tensor op."""
    fmt = NF4 if format == "nf4" else INT8
    if _direct(*codes, *absmax, *outs):
        _run_many(fmt, codes, absmax, outs, block_size)
        torch.autograd.graph.increment_version(outs)  # as the registered op's declared writes do
        return
    for c, a, out in zip(codes, absmax, outs):
        _dequantize(fmt, c, a, out.shape, out.dtype, block_size, out)


class PreparedDequantize:
    """:func:`dequantize_many_trusted` of a fixed set of codes into one buffer laid out once:
    codes and scales that stay where they are on a GPU (a resident unit's), each weight's
    values at a fixed byte offset of the buffer, in a fixed dtype. The native call's
    arguments are made here; run(buffer) adds the buffer's address, so a LoRA step, which
    dequantizes every frozen weight twice, spends no per-tensor Python on it. The caller
    keeps the layout consistent, as for dequantize_many_trusted."""

    __slots__ = ("codes", "absmax", "_calls", "_device")

    def __init__(self, format: str, codes, absmax, numels, dtypes, offsets, block_size: int):
        """`numels[i]`, `dtypes[i]`, `offsets[i]`: the values of codes[i] (their count,
        dtype and first byte in the buffer). Every codes tensor on one CUDA device."""
        fmt = NF4 if format == "nf4" else INT8
        self.codes, self.absmax = list(codes), list(absmax)  # kept alive: the calls hold their addresses
        self._device = self.codes[0].device.index
        by_dtype: dict = {}
        for c, a, n, dtype, offset in zip(self.codes, self.absmax, numels, dtypes, offsets):
            call = by_dtype.setdefault(dtype, ([], [], [], []))
            call[0].append(c.data_ptr())
            call[1].append(a.data_ptr())
            call[2].append(offset)
            call[3].append(n)
        # (format, dtype code, codes' and scales' addresses, byte offsets, numels, block sizes)
        self._calls = [
            (fmt, _dtypes.code(dtype), cs, ams, offs, ns, [block_size] * len(ns))
            for dtype, (cs, ams, offs, ns) in by_dtype.items()
        ]

    def run(self, buffer: torch.Tensor) -> bool:
        """Dequantize into `buffer` (a plain CUDA tensor of the layout's bytes, on the codes'
        device) on the current stream. False, with nothing done, where the call must take the
        registered ops instead (traced code, a dispatch mode, a subclass: see _direct)."""
        if not _direct(buffer):
            return False
        _require_cuda()
        native, base = lib(), buffer.data_ptr()
        stream = current_stream_handle(self._device)
        for fmt, dtype, cs, ams, offs, ns, blocks in self._calls:
            native.dequantize_batch_cuda(
                fmt, dtype, cs, ams, [base + o for o in offs], ns, blocks, self._device, stream
            )
        torch.autograd.graph.increment_version(buffer)  # as the registered op's declared writes do
        return True


def quantize_nf4(x: torch.Tensor, block_size: int = 64, *, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32 / bfloat16 / float16, any shape) -> (packed uint8[ceil(n/2)], absmax float32[ceil(n/block_size)]).
    `out`: a (packed, absmax) pair of that layout on x's device to write them into (returned)."""
    return _quantize(NF4, x, block_size, out)


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    dtype: torch.dtype,
    block_size: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values of :func:`quantize_nf4`'s output, as `dtype` in `shape` (into `out` if given)."""
    return _dequantize(NF4, packed, absmax, shape, dtype, block_size, out)


def quantize_int8(x: torch.Tensor, block_size: int = 64, *, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32 / bfloat16 / float16, any shape) -> (codes int8[n], absmax float32[ceil(n/block_size)]).
    `out`: a (codes, absmax) pair of that layout on x's device to write them into (returned)."""
    return _quantize(INT8, x, block_size, out)


def dequantize_int8(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    dtype: torch.dtype,
    block_size: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The values of :func:`quantize_int8`'s output, as `dtype` in `shape` (into `out` if given)."""
    return _dequantize(INT8, codes, absmax, shape, dtype, block_size, out)
