"""Gradient helpers: host accumulation of micro-batch gradients, per-tensor squared norms
on the GPU for global-norm clipping, and the non-finite check before an update."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._native import lib
from . import _args, _dtypes, reference
from ._streams import current_stream_handle
from .adamw import AdamWHandle, get_pool


def accumulate_(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, threads: int | None = None
) -> AdamWHandle:
    """Queue ``dst += src`` on the host thread pool for each pair (dst float32, src float32
    or bfloat16, both contiguous host tensors of equal size) and return a handle at once.
    The same result as ``dst.add_(src)``; ordered after earlier queued work on these buffers."""
    _args.tensors("accumulate_", "dsts", dsts)
    _args.tensors("accumulate_", "srcs", srcs)
    threads = _args.threads("accumulate_", threads)
    if len(dsts) != len(srcs):
        raise ValueError(f"accumulate_: {len(dsts)} destinations but {len(srcs)} sources")
    src_dtypes = {s.dtype for s in srcs}
    if len(src_dtypes) > 1 or not src_dtypes <= {torch.float32, torch.bfloat16}:
        raise ValueError(
            f"accumulate_: sources must all be float32 or all bfloat16, got {sorted(map(str, src_dtypes))}"
        )
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if d.dtype != torch.float32:
            raise ValueError(f"accumulate_: dsts[{i}] must be float32, got {d.dtype}")
        for kind, t in (("dsts", d), ("srcs", s)):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"accumulate_: {kind}[{i}] must be a contiguous host tensor")
        if d.numel() != s.numel():
            raise ValueError(f"accumulate_: dsts[{i}] has {d.numel()} elements, srcs[{i}] has {s.numel()}")
    job = lib().accumulate_queue(
        get_pool(threads),
        [d.data_ptr() for d in dsts],
        [s.data_ptr() for s in srcs],
        [d.numel() for d in dsts],
        _dtypes.code(src_dtypes.pop() if srcs else torch.float32),
    )
    return AdamWHandle(job, [*dsts, *srcs])


def grad_sq_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor sums of squares (float32, one per tensor) of float32 / bfloat16 / float16
    tensors on one device, accumulated in float32. On CUDA a deterministic two-pass kernel
    on the current stream, without a host sync; on the CPU the pure-torch twin.
    ``sqrt(result.sum())`` is the global L2 norm that ``clip_grad_norm_`` uses."""
    if not _args.tensors("grad_sq_norms", "tensors", tensors):
        return torch.zeros(0)
    device = tensors[0].device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"grad_sq_norms: tensors must be CPU or CUDA tensors, got {device}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
        raise ValueError(
            f"grad_sq_norms: tensors must share one of float32, bfloat16, float16; got {sorted(map(str, dtypes))}"
        )
    for i, t in enumerate(tensors):
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"grad_sq_norms: tensors[{i}] must be contiguous and on {device}")
    if device.type != "cuda":
        return reference.grad_sq_norms(tensors)
    from .._native import require_cuda

    require_cuda("grad_sq_norms on the GPU")
    native = lib()
    chunk = native.SQ_NORM_CHUNK
    rows, first = [], 0
    for t in tensors:
        rows.append([t.data_ptr(), t.numel(), first])
        first += -(-t.numel() // chunk)
    table = torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    partials = torch.empty(max(first, 1), dtype=torch.float32, device=device)
    out = torch.empty(len(tensors), dtype=torch.float32, device=device)
    native.grad_sq_norms_launch(
        table.data_ptr(),
        len(tensors),
        first,
        _dtypes.code(dtypes.pop()),
        partials.data_ptr(),
        out.data_ptr(),
        device.index,
        current_stream_handle(device.index),
    )
    return out


NONFINITE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what mark_nonfinite_ reads


def mark_nonfinite_(
    tensors: Sequence[torch.Tensor], found: torch.Tensor, flag: torch.Tensor, *, max_blocks: int = 0
) -> None:
    """For each of `tensors` (one dtype of float32 / bfloat16 / float16, contiguous, on one
    device) that holds a value that is not finite (NaN, +inf, -inf), set ``found[i] = 1``
    and ``flag`` to 1. Neither is ever cleared, so `flag` stays set over several calls (the
    engine's window flag, which the GPU AdamW's `skip_flag` reads). Values are checked, not
    squares: a finite value never counts, however large. The tensors are only read.

    found: int32, one value per tensor, contiguous; flag: one int32. On CUDA both are written
    by a kernel on the current stream without a host sync (`found` may be on the device or
    in pinned host memory, `flag` on the device), readable once the stream is past it;
    `max_blocks` > 0 caps its grid. On the CPU the pure-torch twin (all on the host)."""
    op = "mark_nonfinite_"
    _args.tensors(op, "tensors", tensors)
    _args.tensor(op, "found", found)
    _args.tensor(op, "flag", flag)
    max_blocks = _args.integer(op, "max_blocks", max_blocks)
    if max_blocks < 0:
        raise ValueError(f"{op}: max_blocks must be >= 0, got {max_blocks}")
    device = tensors[0].device if tensors else flag.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors must be CPU or CUDA tensors, got {device}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1 or not dtypes <= set(NONFINITE_DTYPES):
        raise ValueError(f"{op}: tensors must share one of float32, bfloat16, float16; got {sorted(map(str, dtypes))}")
    for i, t in enumerate(tensors):
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"{op}: tensors[{i}] must be contiguous and on {device}")
    if found.dtype != torch.int32 or not found.is_contiguous() or found.numel() != len(tensors):
        raise ValueError(f"{op}: found must be a contiguous int32 tensor of {len(tensors)} values (one per tensor)")
    if flag.dtype != torch.int32 or flag.numel() != 1 or flag.device != device:
        raise ValueError(f"{op}: flag must be one int32 value on {device}")
    if device.type != "cuda":
        if found.device.type != "cpu":
            raise ValueError(f"{op}: found must be in host memory for CPU tensors, got {found.device}")
        reference.mark_nonfinite_(tensors, found, flag)
        return
    if found.device != device and not (found.device.type == "cpu" and found.is_pinned()):
        raise ValueError(f"{op}: found must be on {device} or in pinned host memory (tensor.pin_memory())")
    from .._native import require_cuda

    require_cuda("mark_nonfinite_ on the GPU")
    if not tensors:
        return
    native = lib()
    chunk = native.SQ_NORM_CHUNK  # the squared-norm kernel's table and chunking
    rows, first = [], 0
    for t in tensors:
        rows.append([t.data_ptr(), t.numel(), first])
        first += -(-t.numel() // chunk)
    table = torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
    native.mark_nonfinite_launch(
        table.data_ptr(),
        len(tensors),
        first,
        _dtypes.code(dtypes.pop()),
        found.data_ptr(),
        flag.data_ptr(),
        max_blocks,
        device.index,
        current_stream_handle(device.index),
    )
