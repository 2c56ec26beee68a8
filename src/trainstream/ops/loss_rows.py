"""The fused cross-entropy rows of the chunked loss on the GPU: each row's loss and, in
place, its logit gradients, in one kernel launch (native/cuda/kernels_loss.cuh).

Its pure-torch twin is :func:`trainstream.loss._loss_and_dlogits` (the CPU and fp64 path),
with the same formula and order; the kernel reads the logits twice and writes them once in
their own dtype, where the twin passes over an fp32 copy of them several times.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from .._native import lib
from . import _args, _dtypes
from ._streams import current_stream_handle

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernel reads and writes

_OP = "loss_and_dlogits_"


def loss_and_dlogits_(
    z: torch.Tensor,
    column: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    write_dlogits: bool,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's cross-entropy loss of the CUDA logits z (rows, vocab): with m the row's max
    and s = sum_j exp(z_j - m) (fp32), ``log(s) - (z[column] - m)`` as fp32 (rows,), into
    `out` when given. With write_dlogits, z is overwritten by
    ``(exp(z_j - m) - (valid and j == column ? s : 0)) * (scale / s)``, computed in fp32 and
    rounded once to z's dtype: ``scale * (softmax(z) - onehot)``.

    z: float32, bfloat16 or float16 on a CUDA device, each row's elements contiguous
    (stride(1) == 1; the rows may sit anywhere apart, not overlapping). column: int64 (rows,),
    each in [0, vocab) (not checked here, which would cost a device sync: a row whose column
    is outside gets a NaN loss and NaN gradients, and nothing outside z is read). valid: bool
    (rows,); scale: float32 (rows,). All contiguous, on z's device. One launch on the
    current stream, without a host sync; a row holding a NaN, or whose max is +-inf, gets a
    NaN loss and NaN gradients, as the twin gives."""
    for name, t in (("z", z), ("column", column), ("valid", valid), ("scale", scale)):
        _args.tensor(_OP, name, t)
    if out is not None:
        _args.tensor(_OP, "out", out)
    write_dlogits = _args.flag(_OP, "write_dlogits", write_dlogits)
    _check_logits(z, write_dlogits)
    rows, vocab = z.shape
    for name, t, dtype in (
        ("column", column, torch.int64),
        ("valid", valid, torch.bool),
        ("scale", scale, torch.float32),
    ):
        if t.dtype != dtype or t.shape != (rows,) or not t.is_contiguous():
            raise ValueError(
                f"{_OP}: {name} must be a contiguous {dtype} tensor of shape ({rows},) (one per row of z), got "
                f"{'a' if t.is_contiguous() else 'a non-contiguous'} {t.dtype} tensor of shape {tuple(t.shape)}"
            )
    for name, t in (("column", column), ("valid", valid), ("scale", scale)):
        if t.device != z.device:
            raise ValueError(f"{_OP}: {name} must be on z's device {z.device}, got {t.device}")
    if out is not None:
        _args.out_buffer(_OP, "out", out, torch.float32, rows, z.device)
        for name, t in (("z", z), ("column", column), ("valid", valid), ("scale", scale)):
            if _overlap(out, t):
                # the kernel writes a row's loss while the row's block still reads its inputs
                raise ValueError(f"{_OP}: out must not overlap {name} (an input of the same call)")
    if z.device.type != "cuda":
        raise ValueError(
            f"{_OP}: z must be a CUDA tensor, got one on {z.device} (on the CPU, the pure-torch twin "
            "trainstream.loss._loss_and_dlogits computes the same)"
        )
    if out is None:
        out = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows == 0:
        return out
    from .._native import require_cuda

    require_cuda(f"{_OP} on the GPU")
    lib().cross_entropy_rows_launch(
        z.data_ptr(),
        z.stride(0),
        rows,
        vocab,
        _dtypes.code(z.dtype),
        column.data_ptr(),
        valid.data_ptr(),
        scale.data_ptr(),
        out.data_ptr(),
        write_dlogits,
        z.device.index,
        current_stream_handle(z.device.index),
    )
    if write_dlogits:
        increment_version(z)  # written through its address: autograd must see the in-place write
    return out


def _check_logits(z: torch.Tensor, write_dlogits: bool) -> None:
    if z.dtype not in LOGIT_DTYPES:
        raise ValueError(f"{_OP}: z must be one of {[str(d) for d in LOGIT_DTYPES]}, got {z.dtype}")
    if z.dim() != 2:
        raise ValueError(f"{_OP}: z must have shape (rows, vocab), got {tuple(z.shape)}")
    rows, vocab = z.shape
    if rows and vocab == 0:
        raise ValueError(
            f"{_OP}: z must have at least one column (a row's loss needs its target), got {tuple(z.shape)}"
        )
    if z.numel() and z.data_ptr() % z.element_size():
        # the kernel's per-element head before a row's first 16-byte boundary assumes it
        raise ValueError(
            f"{_OP}: z must be aligned to its element size ({z.element_size()} bytes), got an address "
            f"{z.data_ptr() % z.element_size()} bytes past it"
        )
    # A stride of a dimension of size 1 is never used to address an element.
    if vocab > 1 and z.stride(1) != 1:
        raise ValueError(f"{_OP}: z's rows must each be contiguous (z.stride(1) == 1), got strides {z.stride()}")
    if rows > 1 and z.stride(0) < vocab:
        raise ValueError(f"{_OP}: z's rows must not overlap (z.stride(0) >= vocab = {vocab}), got strides {z.stride()}")
    if write_dlogits and z.requires_grad:
        raise ValueError(f"{_OP}: z requires grad, and write_dlogits would overwrite it behind autograd")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) that `t`'s elements lie in (strides >= 0)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1
