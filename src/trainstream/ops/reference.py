"""Pure-torch twins of the native ops: the test oracle and a readable specification.

Each twin performs the same fp32 operations, in the same order, as the native kernel
(which is compiled with -ffp-contract=off), so results match bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_M32 = 0xFFFF_FFFF


def _mul32(x, c: int):
    """x * c modulo 2^32 without overflowing int64 (x < 2^32): split c into 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """The counter-based hash of native/include/trainstream/adamw_kernel.h, on Python ints
    or int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rng_key(seed: int, step: int) -> int:
    seed &= 0xFFFF_FFFF_FFFF_FFFF
    step &= 0xFFFF_FFFF_FFFF_FFFF
    k = mix32(seed & _M32)
    k = mix32(k ^ (seed >> 32))
    k = mix32(k ^ (step & _M32))
    return mix32(k ^ (step >> 32))


def element_random_bits(seed: int, step: int, numel: int) -> torch.Tensor:
    """32 random bits per element (int64 tensor); the low half rounds exp_avg, the high
    half exp_avg_sq."""
    key = rng_key(seed, step)
    idx = torch.arange(numel, dtype=torch.int64)
    hi = idx >> 32
    keys = torch.where(hi == 0, torch.full_like(idx, key), mix32(key ^ (hi & _M32)))
    return mix32(keys ^ (idx & _M32))


def _bits_to_bf16(bits: torch.Tensor) -> torch.Tensor:
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return signed.to(torch.int16).view(torch.bfloat16)


def bf16_stochastic_round(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the dropped fraction."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    rounded = (u + random16) >> 16
    nan = ((u >> 16) & 0x8000) | 0x7FC0
    return _bits_to_bf16(torch.where((u & 0x7FFF_FFFF) > 0x7F80_0000, nan, rounded))


def _sqrt_exact(x: torch.Tensor) -> torch.Tensor:
    # torch's CPU sqrt is within 0.5001 ulp, not always the IEEE result the native kernel
    # gets; a float64 square root rounded once to float32 is exactly the IEEE result.
    return torch.sqrt(x.double()).float()


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


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
) -> None:
    """Twin of :func:`trainstream.ops.adamw_step` (synchronous, in place)."""
    seeds = seeds if seeds is not None else [0] * len(params)
    for i, p in enumerate(params):
        step = int(steps[i])
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        decay = _f32(1.0 - lr * weight_decay)
        wd = _f32(weight_decay)
        omb1, b2, omb2 = _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2)
        bc2_sqrt = _f32(math.sqrt(bias_correction2))
        eps_t = _f32(eps)
        neg_step_size = _f32(-(lr / bias_correction1))

        g = grads[i].float() * _f32(grad_scale)
        w = p.detach()
        if decoupled:
            w_new = w * decay
        else:
            w_new = w.clone()
            g = g + wd * w
        m = exp_avgs[i].float()
        v = exp_avg_sqs[i].float()
        m = m + omb1 * (g - m)
        v = v * b2 + omb2 * (g * g)
        denom = _sqrt_exact(v) / bc2_sqrt + eps_t
        w_new = w_new + neg_step_size * (m / denom)
        w.copy_(w_new)
        if exp_avgs[i].dtype == torch.bfloat16:
            bits = element_random_bits(seeds[i], step, p.numel()).view(p.shape)
            exp_avgs[i].copy_(bf16_stochastic_round(m, bits & 0xFFFF))
            exp_avg_sqs[i].copy_(bf16_stochastic_round(v, bits >> 16))
        else:
            exp_avgs[i].copy_(m)
            exp_avg_sqs[i].copy_(v)
        if param_copies is not None:
            param_copies[i].copy_(w_new)  # torch's conversion: round to nearest even


def accumulate_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Twin of :func:`trainstream.ops.accumulate_`."""
    for d, s in zip(dsts, srcs):
        d.add_(s)


def grad_sq_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Twin of :func:`trainstream.ops.grad_sq_norms` (float32 accumulation; the order of
    the sum differs from the CUDA kernel's, so results agree to rounding, not bits)."""
    return torch.stack([t.float().pow(2).sum() for t in tensors]) if tensors else torch.zeros(0)


def mark_nonfinite_(tensors: Sequence[torch.Tensor], found: torch.Tensor, flag: torch.Tensor) -> None:
    """Twin of :func:`trainstream.ops.grad.mark_nonfinite_`: the same marks, bit for bit
    (a value is finite or it is not)."""
    for i, t in enumerate(tensors):
        if not bool(torch.isfinite(t).all()):
            found[i] = 1
            flag.fill_(1)


# -- quantization ------------------------------------------------------------------------
#
# NF4 is bitsandbytes' format: 16 NormalFloat levels, an fp32 absmax per block of
# `block_size` values, two codes per byte with the first element in the high nibble. The
# code of a normalized value s = x * (1 / absmax) is the number of decision thresholds
# below it (strict `>`, so a value exactly on a threshold takes the lower code; NaN takes
# code 0), the thresholds being the fp32 constants bitsandbytes' CUDA kernel compiles.
# Like that kernel, denormal fp32/bf16 inputs count as zero (its arithmetic flushes them).

NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)

# fp32 bit patterns: four of them differ by one ulp from the exact midpoints of the levels.
NF4_THRESHOLD_BITS = [
    0xBF591CD9,
    0xBF1C5270,
    0xBEEB8480,
    0xBEADEA76,
    0xBE703CEC,
    0xBE0D38BC,
    0xBD3A7871,
    0x3D22FAFF,
    0x3DF64863,
    0x3E5067E0,
    0x3E9582D4,
    0x3EC753F9,
    0x3F006D03,
    0x3F248DAF,
    0x3F5C89D9,
]
NF4_THRESHOLDS = torch.tensor(
    [b - (1 << 32) if b >= 1 << 31 else b for b in NF4_THRESHOLD_BITS], dtype=torch.int32
).view(torch.float32)

_FLT_MIN = 1.1754943508222875e-38
_FLT_MAX = 3.4028234663852886e38


def _blocks(x: torch.Tensor, block_size: int, *, flush_denormals: bool) -> tuple[torch.Tensor, int]:
    """x as fp32 blocks [num_blocks, block_size], zero-padded; and the true length."""
    flat = x.reshape(-1).float()
    if flush_denormals:
        flat = torch.where(flat.abs() < _FLT_MIN, flat * 0.0, flat)
    n = flat.numel()
    num_blocks = -(-n // block_size)
    padded = torch.zeros(num_blocks * block_size, dtype=torch.float32)
    padded[:n] = flat
    return padded.view(num_blocks, block_size), n


def _absmax(blocks: torch.Tensor, n: int, block_size: int, start: float) -> torch.Tensor:
    """Max |x| of each block over its real elements, ignoring NaN (as fmaxf does), from `start`."""
    mag = blocks.abs()
    valid = torch.arange(blocks.numel()).view_as(blocks) < n
    mag = torch.where(valid & ~mag.isnan(), mag, torch.tensor(start))
    return mag.amax(dim=1)


def quantize_nf4(x: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`trainstream.ops.quantize_nf4` on the CPU (exactly rounded 1/absmax)."""
    blocks, n = _blocks(x, block_size, flush_denormals=x.dtype != torch.float16)
    absmax = _absmax(blocks, n, block_size, -_FLT_MAX)
    scaled = blocks * (torch.ones(()) / absmax).unsqueeze(1)
    codes = (scaled.unsqueeze(-1) > NF4_THRESHOLDS).sum(-1).to(torch.uint8).reshape(-1)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed[: -(-n // 2)].contiguous(), absmax


def _ftz(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < _FLT_MIN, x * 0.0, x)


def dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, shape, dtype: torch.dtype, block_size: int = 64
) -> torch.Tensor:
    """Twin of :func:`trainstream.ops.dequantize_nf4`: LUT[code] * absmax in fp32 (flushed
    to zero below FLT_MIN, as bitsandbytes' kernel does), then rounded to `dtype`."""
    n = math.prod(shape)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    scale = absmax.float().repeat_interleave(block_size)[:n]
    return _ftz(NF4_LEVELS[codes] * scale).to(dtype).view(shape)


def quantize_int8(x: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`trainstream.ops.quantize_int8`: q = rint(x * (127 / absmax)), round
    half to even, clamped to [-127, 127]; NaN (and 0 * inf in an all-zero block) gives 0."""
    blocks, n = _blocks(x, block_size, flush_denormals=False)
    absmax = _absmax(blocks, n, block_size, 0.0)
    scaled = blocks * (torch.tensor(127.0) / absmax).unsqueeze(1)
    q = torch.where(scaled.isnan(), torch.zeros(()), torch.round(scaled).clamp(-127, 127))
    return q.to(torch.int8).reshape(-1)[:n].contiguous(), absmax


def dequantize_int8(
    codes: torch.Tensor, absmax: torch.Tensor, shape, dtype: torch.dtype, block_size: int = 64
) -> torch.Tensor:
    """Twin of :func:`trainstream.ops.dequantize_int8`: q * (absmax / 127) in fp32."""
    n = math.prod(shape)
    scale = (absmax.float() / torch.tensor(127.0)).repeat_interleave(block_size)[:n]
    return (codes.reshape(-1)[:n].float() * scale).to(dtype).view(shape)


def dequantize_many(
    format: str,
    codes: Sequence[torch.Tensor],
    absmax: Sequence[torch.Tensor],
    shapes: Sequence,
    dtypes: Sequence[torch.dtype],
    block_size: int = 64,
) -> list:
    """Twin of :func:`trainstream.ops.quant.dequantize_many`: each tensor dequantized on
    its own, as its format's twin does (returned rather than written into outs)."""
    one = dequantize_nf4 if format == "nf4" else dequantize_int8
    return [one(c, a, shape, dtype, block_size) for c, a, shape, dtype in zip(codes, absmax, shapes, dtypes)]
