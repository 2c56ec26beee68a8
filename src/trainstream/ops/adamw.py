"""Host AdamW over the native thread pool.

``adamw_step`` queues one fused pass per tensor (read gradient, update the fp32 master
weight and both moments, optionally write a bf16/fp16 copy of the new weight) and returns
a handle at once; the work runs on a persistent C++ thread pool without the GIL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

from .. import options
from .._native import lib
from . import _args, _dtypes
from ._streams import current_stream_handle

GRAD_DTYPES = (torch.float32, torch.bfloat16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
COPY_DTYPES = (torch.bfloat16, torch.float16)

_pools: dict[int, object] = {}
_pools_lock = threading.Lock()


def _forget_pools_in_child() -> None:
    # A forked child has the pool objects but none of their threads (and maybe a held
    # lock): start afresh. The old objects are leaked on purpose; destroying them would
    # join threads that do not exist in this process.
    global _pools, _pools_lock
    _leaked.append(_pools)
    _pools, _pools_lock = {}, threading.Lock()


_leaked: list = []
os.register_at_fork(after_in_child=_forget_pools_in_child)


def get_pool(threads: int | None = None):
    """The shared native thread pool with `threads` workers (None: ``options.default_threads()``,
    the one meaning of the default). Pools are kept for the life of the process, one per
    size, so optimizers that ask for the same size share workers instead of oversubscribing
    the cores. `threads` is bounded as the threads option is: 1 to the cores this process may
    use (more workers than cores only contend, and a count in the thousands fails to start)."""
    threads = _args.threads("get_pool", threads)
    native = lib()
    if threads is None:
        threads = options.default_threads()
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = native.ThreadPool(threads)
        return pool


class AdamWHandle:
    """Queued host work (an AdamW update, an accumulation). Holds the tensors alive until
    the work is done; dropping the handle waits for it, so memory is never freed under a
    running job."""

    def __init__(self, job, tensors: list):
        self._job = job
        self._tensors = tensors

    def __del__(self):
        if getattr(self, "_tensors", None) is not None and not self._job.done():
            try:
                self._job.wait()
            except Exception:
                pass  # the error belongs to whoever waits; here only the memory matters

    def done(self) -> bool:
        return self._job.done()

    def wait(self) -> None:
        """Block (without the GIL) until the update has been written."""
        self._job.wait()
        self._tensors = None


def _check_same(kind: str, tensors: Sequence[torch.Tensor], allowed: tuple, n: int) -> torch.dtype:
    if len(tensors) != n:
        raise ValueError(f"adamw_step: {kind} has {len(tensors)} tensors, params has {n}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"adamw_step: every {kind} tensor must have one dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else allowed[0]
    if dtype not in allowed:
        raise ValueError(f"adamw_step: {kind} dtype must be one of {[str(d) for d in allowed]}, got {dtype}")
    return dtype


def _check_grad_and_moment_dtypes(
    grads, exp_avgs, exp_avg_sqs, n: int, op: str = "adamw_step"
) -> tuple[torch.dtype, torch.dtype]:
    grad_dtype = _check_same("grads", grads, GRAD_DTYPES, n)
    moment_dtype = _check_same("exp_avgs", exp_avgs, MOMENT_DTYPES, n)
    if _check_same("exp_avg_sqs", exp_avg_sqs, MOMENT_DTYPES, n) != moment_dtype:
        raise ValueError(f"{op}: exp_avgs and exp_avg_sqs must have the same dtype")
    return grad_dtype, moment_dtype


def _check_tensor(kind: str, i: int, t: torch.Tensor, numel: int, op: str = "adamw_step") -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{op}: {kind}[{i}] must be in host memory (cpu), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {kind}[{i}] must be contiguous")
    if t.numel() != numel:
        raise ValueError(f"{op}: {kind}[{i}] has {t.numel()} elements, params[{i}] has {numel}")


def group_hyper(group: dict) -> dict:
    """The keyword arguments of adamw_step / adamw_step_gpu / adamw_step_mapped that a torch
    AdamW param group sets."""
    beta1, beta2 = group["betas"]
    return dict(
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled=group["decoupled_weight_decay"],
    )


def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    seeds: Sequence[int] | None = None,
    param_copies: Sequence[torch.Tensor] | None = None,
    threads: int | None = None,
    priority: int = 0,
) -> AdamWHandle:
    """Queue an AdamW (``decoupled=True``) or Adam-with-L2 update of host tensors.

    params: float32, updated in place. grads: float32 or bfloat16, multiplied by
    `grad_scale` first. exp_avgs / exp_avg_sqs: float32, or bfloat16 written with
    stochastic rounding whose random bits depend only on (seed, step, element index), so
    results are the same for any thread count. steps: the step each tensor is taking
    (1 for its first update). param_copies: optional bfloat16 or float16 tensors that
    receive the updated weights, rounded to nearest even, in the same pass.
    priority: among queued jobs free to run, the pool runs the lowest number first (then
    the oldest); jobs on the same buffers always run in the order they were queued.
    Returns an :class:`AdamWHandle`; call ``wait()`` before reading any of the tensors.
    """
    op = "adamw_step"
    for name, value in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        _args.tensors(op, name, value)
    if param_copies is not None:
        _args.tensors(op, "param_copies", param_copies)
    scalars = _scalars(op, lr, beta1, beta2, eps, weight_decay, grad_scale)
    decoupled = _args.flag(op, "decoupled", decoupled)
    priority = _args.integer(op, "priority", priority)
    threads = _args.threads(op, threads)
    n = len(params)
    _check_same("params", params, (torch.float32,), n)
    grad_dtype, moment_dtype = _check_grad_and_moment_dtypes(grads, exp_avgs, exp_avg_sqs, n)
    copy_dtype = None
    if param_copies is not None:
        copy_dtype = _check_same("param_copies", param_copies, COPY_DTYPES, n)
    steps = _args.integers(op, "steps", steps, n, low=1)
    seeds = [0] * n if seeds is None else _args.integers(op, "seeds", seeds, n)
    for i, p in enumerate(params):
        numel = p.numel()
        _check_tensor("params", i, p, numel)
        _check_tensor("grads", i, grads[i], numel)
        _check_tensor("exp_avgs", i, exp_avgs[i], numel)
        _check_tensor("exp_avg_sqs", i, exp_avg_sqs[i], numel)
        if param_copies is not None:
            _check_tensor("param_copies", i, param_copies[i], numel)

    held = [*params, *grads, *exp_avgs, *exp_avg_sqs, *(param_copies or ())]
    job = lib().adamw_queue(
        get_pool(threads),
        [p.data_ptr() for p in params],
        [g.data_ptr() for g in grads],
        [m.data_ptr() for m in exp_avgs],
        [v.data_ptr() for v in exp_avg_sqs],
        [c.data_ptr() for c in param_copies] if param_copies is not None else [0] * n,
        [p.numel() for p in params],
        steps,
        [s & 0xFFFF_FFFF_FFFF_FFFF for s in seeds],
        *scalars,
        decoupled,
        _dtypes.code(grad_dtype),
        _dtypes.code(moment_dtype),
        _dtypes.code(copy_dtype),
        priority,
    )
    return AdamWHandle(job, held)


def _scalars(op: str, lr, beta1, beta2, eps, weight_decay, grad_scale) -> tuple[float, ...]:
    """The hyper-parameters as floats, in the native order. Their ranges are the optimizer's
    to check (options.py); here each must be a real number, so a string or a tensor fails
    with its name rather than inside float()."""
    names = ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")
    values = (lr, beta1, beta2, eps, weight_decay, grad_scale)
    return tuple(_args.real(op, name, v) for name, v in zip(names, values))


def _check_pinned(kind: str, i: int, t: torch.Tensor, numel: int) -> None:
    # An empty tensor is never pinned (nothing to pin) and the kernel never touches it.
    if t.device.type != "cpu" or not (t.is_pinned() or t.numel() == 0):
        raise ValueError(f"adamw_step_gpu: {kind}[{i}] must be in pinned host memory (tensor.pin_memory())")
    _check_tensor(kind, i, t, numel, "adamw_step_gpu")


def _check_cuda(kind: str, i: int, t: torch.Tensor, numel: int, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"adamw_step_gpu: {kind}[{i}] must be on {device}, got {t.device}")
    _check_extent(kind, i, t, numel)


def _check_extent(kind: str, i: int, t: torch.Tensor, numel: int) -> None:
    if not t.is_contiguous():
        raise ValueError(f"adamw_step_gpu: {kind}[{i}] must be contiguous")
    if t.numel() != numel:
        raise ValueError(f"adamw_step_gpu: {kind}[{i}] has {t.numel()} elements, params[{i}] has {numel}")


def _check_reachable(kind: str, i: int, t: torch.Tensor, numel: int, device: torch.device) -> None:
    """On `device`, or in pinned host memory, which the kernel reads over PCIe."""
    where = t.device  # a new torch.device at every read: read once
    if where == device:
        _check_extent(kind, i, t, numel)
    elif where.type == "cpu":
        _check_pinned(kind, i, t, numel)
    else:
        _check_cuda(kind, i, t, numel, device)


def adamw_step_gpu(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[int],
    *,
    masters: Sequence[torch.Tensor] | None = None,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = True,
    grad_scale: float = 1.0,
    grad_scale_tensor: torch.Tensor | None = None,
    seeds: Sequence[int] | None = None,
    skip_flag: torch.Tensor | None = None,
) -> None:
    """Queue the zero-copy CUDA AdamW on the current stream of the params' device.

    params, grads: on one CUDA device. exp_avgs / exp_avg_sqs (float32 or bfloat16) and
    masters (float32) live in pinned host memory and are read and written by the kernel
    over PCIe. Without masters the float32 params are the master weights; with masters the
    params (float32, bfloat16 or float16) receive the updated weights. `grad_scale_tensor`
    (a float32 scalar on the device) multiplies every gradient without a host sync, for
    clipping. `skip_flag` (one int32 on the device, as :func:`ops.mark_nonfinite_` sets it):
    when it holds a non-zero value by the time the kernel runs, the kernel writes nothing
    (params, masters and moments keep their bits), decided on the device without a host sync.
    Results equal :func:`adamw_step`'s bit for bit. The host tensors must not be touched until
    the stream has finished the update.
    """
    from .._native import require_cuda

    require_cuda("the GPU AdamW")
    if not _args.tensors("adamw_step_gpu", "params", params):
        return
    device = params[0].device
    if device.type != "cuda":
        raise ValueError(f"adamw_step_gpu: params must be CUDA tensors, got {device}")
    MappedAdamW(device, params, exp_avgs, exp_avg_sqs, masters=masters, zero_copy=True)(
        grads,
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        grad_scale=grad_scale,
        grad_scale_tensor=grad_scale_tensor,
        seeds=seeds,
        skip_flag=skip_flag,
    )


def adamw_step_mapped(
    device: torch.device, params, grads, exp_avgs, exp_avg_sqs, steps, *, masters=None, **launch
) -> None:
    """:func:`adamw_step_gpu` for the engine: params, grads, moments and masters may each be
    on `device` or in pinned host memory (a paged block's host weights, gradients landed in
    host memory for clipping or accumulation, moments copied to the device for the update
    (engine/moments.py), the device state's masters); the kernel reaches mapped host memory
    over PCIe. `launch` takes the keywords of :meth:`MappedAdamW.__call__`: the
    hyper-parameters, `max_blocks` > 0 capping the kernel's grid (see
    GpuAdamWLaunch.max_blocks), `skip_flag` as in :func:`adamw_step_gpu`, and `tensor_skip`
    (one int32 per tensor on `device`): a tensor whose entry is non-zero when the kernel runs
    keeps its bits (params, masters, moments), the others update as without it."""
    from .._native import require_cuda

    require_cuda("the GPU AdamW")
    if params:
        MappedAdamW(device, params, exp_avgs, exp_avg_sqs, masters=masters)(grads, steps, **launch)


def _check_pinned_moment(kind: str, i: int, t: torch.Tensor, numel: int, device: torch.device) -> None:
    _check_pinned(kind, i, t, numel)


_ROW = 8  # int64 fields of a GpuAdamWTensor (adamw_gpu.h), in its order
_GRAD, _KEY = 1, 7  # the fields a launch fills in; the others are fixed at construction


class MappedAdamW:
    """The CUDA AdamW over one set of tensors, launched again with each step's gradients.

    params (the weights written), exp_avgs / exp_avg_sqs and masters are checked and their
    addresses taken here, once; each call checks only the gradients and its own arguments,
    then queues one kernel on the current stream of `device`. The tensors given here must
    keep their storage while this object is used (it holds them alive): the engine's device
    state makes its tensors once and builds a new one after replacing any (device_state.py).
    Places: on `device` or in pinned host memory (:func:`adamw_step_mapped`), or with
    `zero_copy` params and grads on `device`, moments and masters pinned
    (:func:`adamw_step_gpu`). Without masters the float32 params are the master weights; with
    masters the params (float32, bfloat16 or float16) receive the new weights, rounded to
    nearest even. Results equal :func:`adamw_step`'s bit for bit."""

    def __init__(self, device, params, exp_avgs, exp_avg_sqs, *, masters=None, zero_copy: bool = False):
        from .._native import require_cuda

        require_cuda("the GPU AdamW")
        op = "adamw_step_gpu"
        for name, value in (("params", params), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
            _args.tensors(op, name, value)
        if masters is not None:
            _args.tensors(op, "masters", masters)
        self.device, self.n = device, len(params)
        self._check_place = _check_cuda if zero_copy else _check_reachable
        check_moment = _check_pinned_moment if zero_copy else _check_reachable
        n = self.n
        self.param_dtype = _check_same(
            "params", params, (torch.float32,) if masters is None else (torch.float32, torch.bfloat16, torch.float16), n
        )
        self.moment_dtype = _check_same("exp_avgs", exp_avgs, MOMENT_DTYPES, n)
        if _check_same("exp_avg_sqs", exp_avg_sqs, MOMENT_DTYPES, n) != self.moment_dtype:
            raise ValueError(f"{op}: exp_avgs and exp_avg_sqs must have the same dtype")
        if masters is not None:
            _check_same("masters", masters, (torch.float32,), n)
        chunk = lib().GPU_ADAMW_CHUNK
        fixed, self.numels, first_chunk = [], [], 0
        for i, p in enumerate(params):
            numel = p.numel()
            self._check_place("params", i, p, numel, device)
            check_moment("exp_avgs", i, exp_avgs[i], numel, device)
            check_moment("exp_avg_sqs", i, exp_avg_sqs[i], numel, device)
            if masters is not None:
                check_moment("masters", i, masters[i], numel, device)
            master = masters[i].data_ptr() if masters is not None else 0
            fixed += [master, 0, exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(), p.data_ptr(), numel, first_chunk, 0]
            self.numels.append(numel)
            first_chunk += -(-numel // chunk)
        self.num_chunks = first_chunk
        self._fixed = fixed
        self._held = (list(params), list(exp_avgs), list(exp_avg_sqs), None if masters is None else list(masters))

    def __call__(
        self,
        grads,
        steps,
        *,
        lr,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        decoupled=True,
        grad_scale=1.0,
        grad_scale_tensor=None,
        seeds=None,
        max_blocks: int = 0,
        skip_flag=None,
        tensor_skip=None,
    ) -> None:
        """Queue the update from `grads` (one per tensor, float32 or bfloat16, one dtype) at
        `steps` (each >= 1). `skip_flag`: one int32 on the device; non-zero when the kernel
        runs, nothing is written. `tensor_skip`: one int32 per tensor on the device; a tensor
        whose entry is non-zero when the kernel runs is not written, the others are. Both are
        decided on the device, without a host sync."""
        op, device, n = "adamw_step_gpu", self.device, self.n
        _args.tensors(op, "grads", grads)
        if grad_scale_tensor is not None:
            _args.tensor(op, "grad_scale_tensor", grad_scale_tensor)
        if skip_flag is not None:
            _args.tensor(op, "skip_flag", skip_flag)
            if skip_flag.device != device or skip_flag.numel() != 1 or skip_flag.dtype != torch.int32:
                raise ValueError(f"{op}: skip_flag must be one int32 value on {device}")
        if tensor_skip is not None:
            _args.tensor(op, "tensor_skip", tensor_skip)
            if (
                tensor_skip.device != device
                or tensor_skip.dtype != torch.int32
                or tensor_skip.numel() != n
                or not tensor_skip.is_contiguous()
            ):
                raise ValueError(f"{op}: tensor_skip must be a contiguous int32 tensor of {n} values on {device}")
        hyper = _scalars(op, lr, beta1, beta2, eps, weight_decay, grad_scale)
        decoupled = _args.flag(op, "decoupled", decoupled)
        grad_dtype = _check_same("grads", grads, GRAD_DTYPES, n)
        steps = _args.integers(op, "steps", steps, n, low=1)
        seeds = [0] * n if seeds is None else _args.integers(op, "seeds", seeds, n)
        if grad_scale_tensor is not None and (
            grad_scale_tensor.device != device
            or grad_scale_tensor.numel() != 1
            or grad_scale_tensor.dtype != torch.float32
        ):
            raise ValueError(f"{op}: grad_scale_tensor must be one float32 value on {device}")
        native = lib()
        rows, check, numels = list(self._fixed), self._check_place, self.numels
        for i, g in enumerate(grads):
            check("grads", i, g, numels[i], device)
            rows[i * _ROW + _GRAD] = g.data_ptr()
        # The scalars depend on (hyper-parameters, step), the stochastic rounding's key on
        # (seed, step): computed once per distinct step, and per tensor only for bf16
        # moments (the kernel reads the key for nothing else).
        scalars = []
        if self.moment_dtype == torch.bfloat16:
            for i, step in enumerate(steps):
                floats, key = native.adamw_scalars(*hyper, step, seeds[i] & 0xFFFF_FFFF_FFFF_FFFF)
                rows[i * _ROW + _KEY] = key
                scalars += floats
                scalars.append(0.0)
        else:
            per_step: dict = {}
            for step in steps:
                row = per_step.get(step)
                if row is None:
                    row = per_step[step] = native.adamw_scalars(*hyper, step, 0)[0] + [0.0]
                scalars += row
        # The launch's tables travel H2D on the same stream as the kernel (pinned, non-blocking:
        # no host sync); the caching allocators keep both alive until the stream is past them.
        tensors_dev = torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        scalars_dev = torch.tensor(scalars, dtype=torch.float32).pin_memory().to(device, non_blocking=True)
        native.adamw_gpu_launch(
            tensors_dev.data_ptr(),
            scalars_dev.data_ptr(),
            grad_scale_tensor.data_ptr() if grad_scale_tensor is not None else 0,
            n,
            self.num_chunks,
            bool(decoupled),
            _dtypes.code(grad_dtype),
            _dtypes.code(self.moment_dtype),
            _dtypes.code(self.param_dtype),
            device.index,
            current_stream_handle(device.index),
            int(max_blocks),
            skip_flag.data_ptr() if skip_flag is not None else 0,
            tensor_skip.data_ptr() if tensor_skip is not None else 0,
        )
