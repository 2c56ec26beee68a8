# Typed stub of the native module (native/bindings). Only trainstream._native imports it;
# everything takes data pointers and CUDA streams as integers.
from typing import Any

class ArgumentError(ValueError): ...

class ThreadPool:
    def __init__(self, threads: int) -> None: ...
    @property
    def threads(self) -> int: ...

class Job:
    def wait(self) -> None: ...
    def done(self) -> bool: ...

build_info: dict[str, Any]
GPU_ADAMW_CHUNK: int
SQ_NORM_CHUNK: int

def available_cores() -> int: ...
def simd_level() -> str: ...
def best_simd_level() -> str: ...
def set_simd_level(name: str) -> None: ...
def adamw_queue(
    pool: ThreadPool,
    params: list[int],
    grads: list[int],
    exp_avgs: list[int],
    exp_avg_sqs: list[int],
    copies: list[int],
    numels: list[int],
    steps: list[int],
    seeds: list[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float,
    decoupled: bool,
    grad_dtype: int,
    moment_dtype: int,
    copy_dtype: int,
    priority: int = 0,
) -> Job: ...
def adamw_scalars(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float, step: int, seed: int
) -> tuple[list[float], int]: ...
def accumulate_queue(pool: ThreadPool, dsts: list[int], srcs: list[int], numels: list[int], src_dtype: int) -> Job: ...
def quant_queue(
    pool: ThreadPool,
    dequantize: bool,
    format: int,
    numel: int,
    block_size: int,
    dtype: int,
    values: int,
    codes: int,
    absmax: int,
) -> Job: ...

# Present only in builds with CUDA (build_info["cuda"]).
def cuda_info() -> dict[str, Any]: ...
def adamw_gpu_launch(
    tensors: int,
    scalars: int,
    grad_scale: int,
    num_tensors: int,
    num_chunks: int,
    decoupled: bool,
    grad_dtype: int,
    moment_dtype: int,
    param_dtype: int,
    device: int,
    stream: int,
    max_blocks: int = 0,
    skip_flag: int = 0,
    tensor_skip: int = 0,
) -> None: ...
def grad_sq_norms_launch(
    tensors: int, num_tensors: int, num_chunks: int, dtype: int, partials: int, out: int, device: int, stream: int
) -> None: ...
def mark_nonfinite_launch(
    tensors: int,
    num_tensors: int,
    num_chunks: int,
    dtype: int,
    found: int,
    flag: int,
    max_blocks: int,
    device: int,
    stream: int,
) -> None: ...
def cross_entropy_rows_launch(
    logits: int,
    row_stride: int,
    rows: int,
    vocab: int,
    dtype: int,
    column: int,
    valid: int,
    scale: int,
    loss: int,
    write_dlogits: bool,
    device: int,
    stream: int,
) -> None: ...
def quant_cuda(
    dequantize: bool,
    format: int,
    numel: int,
    block_size: int,
    dtype: int,
    values: int,
    codes: int,
    absmax: int,
    device: int,
    stream: int,
) -> None: ...
def dequantize_batch_cuda(
    format: int,
    dtype: int,
    codes: list[int],
    absmax: list[int],
    values: list[int],
    numels: list[int],
    block_sizes: list[int],
    device: int,
    stream: int,
) -> None: ...
