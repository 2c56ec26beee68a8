"""Cross-entropy through the output layer without the full logits.

``chunked_cross_entropy(hidden, weight, targets)`` equals
``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` (the upcast transformers
does before its loss) but never holds the (tokens, vocab) logits: at 8192 tokens and a
152064-word vocabulary those are 2.5 GB in bf16 and 5 GB per fp32 copy, several copies of
which live at once in a plain forward and backward.

[Note: gradients in forward]
The tokens are walked in chunks of chunk_size. A chunk's logits are one matmul over the whole
vocabulary in the input dtype (the matmul runs at the input's speed), so each token's softmax
is complete within its chunk, and the chunk's loss and logit gradients are formed at once,
in fp32 (fp64 for fp64 inputs): on CUDA, for bf16, fp16 and fp32, by one kernel over the
chunk (ops.loss_rows: two reads and one write of the logits, no temporary), elsewhere by its
pure-torch twin a block of its rows at a time (see [Note: row blocks]); both form
``e = exp(z - max)`` and its sum ``s``, the loss ``log s - (z_target - max)`` (log_softmax's
order), then ``d_logits = scale * (e / s - onehot)`` rounded once to the input dtype, written
over the chunk's logits (what the upcast's backward does in the unchunked loss). ``scale`` is
each token's d(loss)/d(its loss): 1 / (the mean's count, or num_items), 1 for the sum, 0 for
an ignored token; fp16, whose range cannot hold 1 / N times a probability, writes
``2**15 * (e / s - onehot)`` and applies 1 / N after the matmuls instead (see
[Note: fp16 range]). When autograd will need gradients, the chunk then costs two more matmuls:
- d_hidden of its tokens is one matmul over the vocabulary, written in place: the unchunked
  loss's computation of those rows;
- d_weight accumulates over the chunks in the weight's dtype (``addmm_``: the matmul adds in
  fp32 and rounds once per chunk, so in bf16 its rounding error grows with the number of
  chunks, where the unchunked loss rounds once). An fp32 accumulator would round once in all,
  but at 152064 x 3584 it is 2 GiB, and with the bf16 gradient made from it 3 GiB, past the
  memory bound this module exists for (an eighth of the unchunked loss's 14 GiB, gradients
  included). A frozen weight (LoRA) gets no d_weight at all;
- d_bias accumulates over the chunks in fp32 (fp64 for fp64) and is held so until backward.
So the loss with its gradients costs three matmuls, as the unchunked one does; without grad
(evaluation) each chunk is the logits' matmul and the log-sum-exp only. Backward multiplies
the gradients made in forward by the loss's gradient g (read once to the host: skipped when
the factor is 1, as ``loss.backward()`` gives it for bf16, fp32 and fp64, else one
multiplication in fp32 and one rounding) and hands them over: they become ``.grad`` without a
copy, so the peak holds one d_weight. d_bias is rounded once, after g. d_hidden and d_weight
were rounded in forward, so a g other than a power of two (a loss divided by 3 accumulation
steps) rounds them a second time, where the unchunked loss rounds its d_logits after g and
its gradients once: about half a unit in the last place more (holding them in fp32 until g
is known would double d_weight, past the memory bound). A power of two (1, a GradScaler's
scale) multiplies exactly. A
second backward through the same graph (``retain_graph=True``) finds them handed over and
walks the chunks again from the saved inputs, which gives the same values; a double backward
(``create_graph=True``) is refused.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .ops.loss_rows import LOGIT_DTYPES, loss_and_dlogits_

__all__ = ["chunked_cross_entropy", "causal_lm_loss"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_REDUCTIONS = ("mean", "sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items=None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, chunk by chunk.

    hidden: (..., d) floating (bf16, fp16, fp32 or fp64); weight: (vocab, d) and bias: (vocab,)
    of the same dtype and device; targets: hidden.shape[:-1], integers in [0, vocab) or
    ``ignore_index`` (those tokens add nothing). ``reduction``: ``"mean"`` over the tokens not
    ignored (nan when all are, as torch answers) or ``"sum"``. ``num_items`` (an int >= 1 or a
    one-element tensor) is transformers' ``num_items_in_batch``: the loss is the sum divided by
    it, in place of the mean's own count. The loss is fp32 (fp64 for fp64 inputs). Under
    autocast the floating inputs are cast to the autocast dtype first, as ``F.linear`` would.
    ``chunk_size`` (an int >= 1) is the number of tokens whose logits exist at once
    (``chunk_size * vocab`` of them). With autograd on and an input that requires grad, the
    gradients are computed in this call and held until backward (one d_weight, one d_hidden);
    see the module's note.
    """
    _check_kinds(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    _check_tensors(hidden, weight, targets, bias, ignore_index)
    d = hidden.shape[-1]
    flat_hidden = hidden.reshape(-1, d)
    flat_targets = targets.reshape(-1).long()
    if num_items is not None:
        divisor = num_items.detach().reshape(()).to(hidden.device) if isinstance(num_items, torch.Tensor) else num_items
    elif reduction == "mean":
        # torch's mean: sum / count of tokens not ignored; 0 / 0 = nan when all are.
        divisor = (flat_targets != ignore_index).sum().to(_compute_dtype(hidden.dtype))
    else:
        divisor = None
    trained = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    if torch.is_grad_enabled() and any(trained):
        return _CrossEntropyWithGradients.apply(
            flat_hidden, weight, bias, flat_targets, divisor, chunk_size, ignore_index
        )
    token_loss, _, _ = _walk_chunks(flat_hidden, weight, bias, flat_targets, divisor, chunk_size, ignore_index)
    return _reduce(token_loss, flat_targets != ignore_index, divisor)


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items=None,
) -> torch.Tensor:
    """:func:`chunked_cross_entropy` of a causal language model: position t of ``hidden``
    (..., T, d) predicts ``targets[..., t + 1]`` (..., T) and the last position predicts nothing,
    as transformers' ``ForCausalLMLoss`` shifts its labels (padding them with ``ignore_index``)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
    if targets.dim() < 1:
        raise ValueError("targets must have a sequence dimension (shape (..., T)) for causal_lm_loss, got a 0-d tensor")
    _check_int("ignore_index", ignore_index)
    _check_target_dtype(targets)
    shifted = torch.full_like(targets, ignore_index, dtype=torch.long)
    shifted[..., :-1] = targets[..., 1:]
    return chunked_cross_entropy(
        hidden,
        weight,
        shifted,
        bias,
        chunk_size=chunk_size,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items=num_items,
    )


class _CrossEntropyWithGradients(torch.autograd.Function):
    """The reduced loss, with its gradients made in forward and handed over in backward.

    hidden (N, d), weight (V, d), bias (V,) or None, targets (N,) int64, already checked;
    divisor: None (the sum), the mean's count or num_items (see :func:`_reduce`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk_size, ignore_index):
        need = ctx.needs_input_grad[:3]
        token_loss, grads, unscale = _walk_chunks(
            hidden, weight, bias, targets, divisor, chunk_size, ignore_index, need
        )
        ctx.grads = grads, unscale  # handed over, and dropped, by the first backward
        # Only for a second backward through the same graph; references, no copies.
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.divisor = divisor
        ctx.chunk_size = chunk_size
        ctx.ignore_index = ignore_index
        return _reduce(token_loss, targets != ignore_index, divisor)

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "chunked_cross_entropy has no double backward: its gradients are computed in its forward "
                "and are not differentiable (backward was called with create_graph=True)"
            )
        held, ctx.grads = ctx.grads, None
        if held is None:  # a second backward (retain_graph=True): the first took the gradients
            hidden, weight, bias, targets = ctx.saved_tensors
            need = ctx.needs_input_grad[:3]
            _, *held = _walk_chunks(hidden, weight, bias, targets, ctx.divisor, ctx.chunk_size, ctx.ignore_index, need)
        (d_hidden, d_weight, d_bias), (hidden_unscale, weight_unscale) = held
        # One host read: the multiplication must run in fp32 on bf16 and fp16 gradients (a
        # device scalar would be rounded to their dtype first), and a factor of 1 needs none.
        g = float(grad_loss)
        for t, factor in ((d_hidden, g * hidden_unscale), (d_weight, g * weight_unscale)):
            if t is not None and factor != 1.0:
                t.mul_(factor)
        if d_hidden is not None and not math.isfinite(g):
            # torch's gradient of an ignored token is 0 whatever the loss's gradient is.
            d_hidden[ctx.saved_tensors[3] == ctx.ignore_index] = 0
        if d_bias is not None:  # held in fp32 (fp64): rounded once, after g
            d_bias = (d_bias if g == 1.0 else d_bias * g).to(ctx.saved_tensors[2].dtype)
        grads = (d_hidden, d_weight, d_bias)
        return (*grads, None, None, None, None)


def _reduce(token_loss: torch.Tensor, valid: torch.Tensor, divisor) -> torch.Tensor:
    """The sum over the tokens not ignored, divided by divisor unless it is None."""
    total = torch.where(valid, token_loss, 0).sum()
    return total if divisor is None else total / divisor


def _walk_chunks(hidden, weight, bias, targets, divisor, chunk_size, ignore_index, need=(False, False, False)):
    """Each token's loss (N,) in the compute dtype, the gradients (d_hidden, d_weight, d_bias)
    of the reduced loss for those of hidden, weight, bias that ``need`` names (None for the
    others), and the factors (of d_hidden, of d_weight) that take the held d_hidden and
    d_weight to the gradients: see [Note: gradients in forward] and [Note: fp16 range].
    d_bias is held in the compute dtype, at the gradient's own scale."""
    need_hidden, need_weight, need_bias = need
    compute = _compute_dtype(hidden.dtype)
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    valid = targets != ignore_index
    any_grad = need_hidden or need_weight or need_bias
    # Each token's d(reduced loss)/d(its loss), as autograd of the reduction forms it; ignored
    # tokens get 0 (also when the divisor is 0: the mean over no token).
    inv = torch.ones((), dtype=compute, device=device)
    if divisor is not None:
        inv = inv / torch.as_tensor(divisor, device=device).to(compute)
    if hidden.dtype == torch.float16 and any_grad and n:
        scales = _fp16_scales(hidden, weight, valid, inv, need_hidden, need_weight)
    else:
        scales = _GradientScales(inv, 1.0, 1.0, 1.0, 1.0, 1.0)
    row_scale = torch.where(valid, scales.dlogits, torch.zeros((), dtype=compute, device=device))
    column = targets.clamp(0, vocab - 1).unsqueeze(1)  # ignored tokens' column is unused
    fused = _fused_rows(device, hidden.dtype)
    token_loss = torch.empty(n, dtype=compute, device=device)
    # Each chunk writes its rows whole, contiguous whatever hidden's strides.
    d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if need_hidden else None
    # The first chunk writes d_weight whole; with no token there is no chunk.
    d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=device) if need_weight and n == 0 else None
    d_bias = torch.zeros(vocab, dtype=compute, device=device) if need_bias else None
    with _no_autocast(device), _fp32_partial_sums(device, scales.hidden_alpha != 1.0 or scales.weight_alpha != 1.0):
        for c0 in range(0, n, chunk_size):
            c1 = min(c0 + chunk_size, n)
            h = hidden[c0:c1]
            z = F.linear(h, weight, bias)  # (chunk, vocab) in the input dtype
            if fused:  # the chunk whole: the kernel has no fp32 temporary
                loss_and_dlogits_(z, column[c0:c1, 0], valid[c0:c1], row_scale[c0:c1], any_grad, out=token_loss[c0:c1])
            else:
                for r0, r1 in _row_blocks(c0, c1):
                    token_loss[r0:r1] = _loss_and_dlogits(
                        z[r0 - c0 : r1 - c0], column[r0:r1], valid[r0:r1], row_scale[r0:r1], any_grad
                    )
            # z holds the chunk's d_logits now, when any gradient is needed. alpha multiplies
            # the matmul's fp32 sums before they are rounded to the output's dtype.
            if need_hidden:
                if scales.hidden_alpha == 1.0:
                    torch.mm(z, weight, out=d_hidden[c0:c1])
                else:  # beta=0: the uninitialized rows are not read
                    d_hidden[c0:c1].addmm_(z, weight, beta=0, alpha=scales.hidden_alpha)
            if need_weight:
                if d_weight is None and scales.weight_alpha == 1.0:
                    d_weight = torch.mm(z.t(), h)
                elif d_weight is None:
                    d_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device)
                    d_weight.addmm_(z.t(), h, beta=0, alpha=scales.weight_alpha)
                else:
                    d_weight.addmm_(z.t(), h, alpha=scales.weight_alpha)
            if need_bias:
                d_bias += z.sum(0, dtype=compute)
            del z  # before the next chunk's logits are made
    if need_bias and scales.bias_factor != 1.0:
        d_bias.mul_(scales.bias_factor)
    return token_loss, (d_hidden, d_weight, d_bias), (scales.hidden_unscale, scales.weight_unscale)


class _GradientScales(NamedTuple):
    """How a walk scales what it writes. dlogits: each valid token's d_logits are
    ``dlogits * (softmax - onehot)`` (a tensor or a float); hidden_alpha, weight_alpha: the
    d_hidden and d_weight matmuls' alpha; hidden_unscale, weight_unscale: the factor from the
    held d_hidden, d_weight to the gradients; bias_factor: from the column sums of d_logits
    to d_bias."""

    dlogits: torch.Tensor | float
    hidden_alpha: float
    weight_alpha: float
    hidden_unscale: float
    weight_unscale: float
    bias_factor: float


# [Note: fp16 range]
# fp16 has bf16's precision near 1 but stops at 65504 and goes subnormal below 2**-14, and the
# d_logits of a mean are softmax / N: 1e-9 at 8192 tokens over a 32000-word vocabulary, which
# rounds to 0. The unchunked loss under a GradScaler rounds them after the loss scale g
# (65536 at the start) has multiplied them in fp32; here the gradients are made in forward,
# before g is known. So fp16 d_logits are written as 2**15 * (softmax - onehot): at most
# 2**15, and a probability keeps full precision down to 2**-29, more than any g the unchunked
# loss survives gives it (g * (softmax - onehot) must stay under 65504 there). The 1 / N (or
# 1 / num_items) and the held gradients' own scale are applied through the matmuls' alpha, in
# fp32, before their one rounding. The held d_hidden and d_weight are 2**k times the
# gradients, with 2**k the largest power of two that keeps a bound on them under 2**15:
# |d_hidden| <= 2 * max|W| / N (each row of softmax - onehot sums to at most 2 in absolute
# value) and |d_weight| <= N_valid * max|h| / N, partial sums included. Backward multiplies
# them by g * 2**-k: a power of two times 2**-k is exact (a GradScaler's scale, or 1), so the
# gradients are rounded once, as the unchunked loss's are. These bounds take one reduction
# over hidden and one over the weight (no temporary) and one host read per call, and the
# factor makes backward one pass over d_weight; the memory is unchanged (scalars only). The
# sums before alpha can pass 65504: _fp32_partial_sums keeps cuBLAS's partial sums in fp32.
_FP16_DLOGITS = 2.0**15
_FP16_BOUND = 2.0**15


def _fp16_scales(hidden, weight, valid, inv, need_hidden, need_weight) -> _GradientScales:
    """The scales of [Note: fp16 range] for a walk over fp16 inputs with n >= 1 tokens."""
    zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
    stats = torch.stack(
        [
            inv.float(),
            valid.sum().float(),
            torch.linalg.vector_norm(hidden, float("inf")).float() if need_weight else zero,
            torch.linalg.vector_norm(weight, float("inf")).float() if need_hidden else zero,
        ]
    ).tolist()
    s, n_valid, h_max, w_max = stats
    if n_valid == 0:
        s = 0.0  # no token adds anything; 1 / 0 would make the alphas nan
    k_hidden = _power_below(_FP16_BOUND, 2 * w_max * s)
    k_weight = _power_below(_FP16_BOUND, n_valid * h_max * s)
    return _GradientScales(
        dlogits=_FP16_DLOGITS,
        hidden_alpha=math.ldexp(s, k_hidden) / _FP16_DLOGITS,
        weight_alpha=math.ldexp(s, k_weight) / _FP16_DLOGITS,
        hidden_unscale=math.ldexp(1.0, -k_hidden),
        weight_unscale=math.ldexp(1.0, -k_weight),
        bias_factor=s / _FP16_DLOGITS,
    )


def _power_below(limit: float, bound: float) -> int:
    """The largest k with 2**k * bound <= limit, within [-60, 60] (where g * 2**-k stays a
    normal fp32 number for any loss scale); 0 when bound is 0 or not finite (a nan or inf
    input makes the gradients nan or inf whatever the scale)."""
    if not (bound > 0 and math.isfinite(bound)):
        return 0
    mantissa, exponent = math.frexp(limit / bound)  # limit / bound = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return max(-60, min(60, exponent - 1))


def _loss_and_dlogits(z, column, valid, scale, write_dlogits: bool) -> torch.Tensor:
    """The loss of each of z's rows (logits in the input dtype); with write_dlogits, z is
    overwritten by ``scale * (softmax(z) - onehot)`` rounded once to its dtype.

    Passes over the compute-dtype block: the subtraction that makes it (it promotes the input
    dtype's logits exactly, so no upcast copy is made), exp in place, the sum, and the one that
    writes d_logits; the row max and the target's logit are read from z."""
    row_max = z.amax(dim=1).to(scale.dtype)  # exact in any dtype
    picked = z.gather(1, column).squeeze(1).to(scale.dtype)
    e = torch.sub(z, row_max.unsqueeze(1)).exp_()
    exp_sum = e.sum(dim=1)
    # log_softmax's order, log(sum exp(z - m)) - (z_t - m): m + log(s) rounded first would
    # carry the rounding at a large max into every token's loss.
    loss = exp_sum.log() - (picked - row_max)
    if write_dlogits:
        # scale * (e / s - onehot) = (e - s * onehot) * (scale / s): the exponent is taken from
        # the row max, as log_softmax's backward takes it, so the largest probabilities keep
        # full precision.
        e.scatter_add_(1, column, torch.where(valid, -exp_sum, 0).unsqueeze(1))
        torch.mul(e, (scale / exp_sum).unsqueeze(1), out=z)
    return loss


def _fused_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a walk's rows go through the CUDA kernel (ops.loss_rows, the same formula and
    order as _loss_and_dlogits, its twin) rather than through _loss_and_dlogits."""
    return device.type == "cuda" and dtype in LOGIT_DTYPES


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the log-sum-exp (transformers upcasts its logits so), fp64 kept as it is."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# [Note: row blocks] On the torch path (_loss_and_dlogits: the CPU, and fp64 anywhere) a
# chunk's compute-dtype work runs on this many blocks of its rows, so the fp32 temporary is a
# quarter of the chunk: with bf16 logits, half the bytes of the logits themselves, instead of
# twice them. The CUDA kernel (_fused_rows) makes no temporary and takes the chunk whole.
_ROW_BLOCKS = 4


def _row_blocks(c0: int, c1: int) -> list[tuple[int, int]]:
    step = max(1, -(-(c1 - c0) // _ROW_BLOCKS))
    return [(r0, min(r0 + step, c1)) for r0 in range(c0, c1, step)]


class _no_autocast:
    """Autocast off for the device's type: the matmuls run in the dtype the caller checked,
    and backward, on the caller's thread on the CPU, is not recast either."""

    def __init__(self, device: torch.device):
        available = torch.amp.is_autocast_available(device.type)
        self._ctx = torch.autocast(device.type, enabled=False) if available else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


# The settings _fp32_partial_sums turns off: (name, its split-K half where a torch has one).
_FP16_REDUCTIONS = (
    ("allow_fp16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction_split_k"),
    ("allow_fp16_accumulation", None),  # newer torch only
)
_fp16_lock = threading.Lock()
_fp16_walks = 0  # walks inside _fp32_partial_sums now, on any thread
_fp16_saved: dict = {}  # the settings as the first of them found them


class _fp32_partial_sums:
    """While active on CUDA, fp16 matmuls keep their partial sums in fp32: with the scales of
    [Note: fp16 range] a sum before alpha may exceed 65504 (2**15 * a d_logit times h), and
    cuBLAS may otherwise reduce split-K partial sums in fp16 or accumulate in fp16 (torch's
    allow_fp16_reduced_precision_reduction, on by default, and allow_fp16_accumulation). The
    settings are torch's process-wide ones: they stay off while any walk runs, on any thread,
    and the last walk to end gives back what the first found. A setting this torch lacks
    (older releases have no split-K half, no fp16 accumulation) is left alone."""

    def __init__(self, device: torch.device, active: bool):
        self._active = active and device.type == "cuda"
        self._entered = False

    def __enter__(self):
        global _fp16_walks
        if not self._active:
            return
        m = torch.backends.cuda.matmul
        with _fp16_lock:
            if _fp16_walks == 0:
                _fp16_saved.clear()
                for name, split_k in _FP16_REDUCTIONS:
                    value = getattr(m, name, None)
                    if value is None:
                        continue
                    half = getattr(m, split_k, None) if split_k else None
                    _fp16_saved[name] = value if half is None else (value, half)
                for name in _fp16_saved:
                    setattr(m, name, False)
            _fp16_walks += 1
            self._entered = True

    def __exit__(self, *exc):
        global _fp16_walks
        if not self._entered:
            return
        self._entered = False
        m = torch.backends.cuda.matmul
        with _fp16_lock:
            _fp16_walks -= 1
            if _fp16_walks == 0:
                for name, value in _fp16_saved.items():
                    setattr(m, name, value)
                _fp16_saved.clear()


def _autocast_inputs(hidden, weight, bias):
    """Under autocast, hidden, weight and bias in the autocast dtype, as F.linear would take
    them (fp64 is left alone, as autocast leaves it); otherwise as given."""
    device_type = hidden.device.type
    if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        if t is None or not t.is_floating_point() or t.dtype == torch.float64:
            return t
        return t.to(dtype)

    return cast(hidden), cast(weight), cast(bias)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")


def _check_target_dtype(targets: torch.Tensor) -> None:
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids (int64 or another integer dtype), got {targets.dtype}")


def _check_kinds(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items) -> None:
    """The arguments' types and plain values, before anything is cast."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be None or a torch.Tensor, got {type(bias).__name__}")
    _check_int("chunk_size", chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1 (tokens per chunk), got {chunk_size}")
    _check_int("ignore_index", ignore_index)
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(_REDUCTIONS)}, got {reduction!r}")
    if num_items is None:
        return
    if reduction != "mean":
        raise ValueError(
            "num_items divides the summed loss in place of the mean's count (transformers' "
            f"num_items_in_batch); give it with reduction='mean' (the default), not {reduction!r}"
        )
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.is_complex():
            raise ValueError(
                f"num_items must be an int >= 1 or a one-element real tensor, got a {num_items.dtype} tensor "
                f"of shape {tuple(num_items.shape)}"
            )
    elif isinstance(num_items, bool) or not isinstance(num_items, int):
        raise TypeError(f"num_items must be None, an int >= 1 or a one-element tensor, got {num_items!r}")
    elif num_items < 1:
        raise ValueError(f"num_items must be an int >= 1 or a one-element tensor, got {num_items}")


def _check_tensors(hidden, weight, targets, bias, ignore_index) -> None:
    """Dtypes, devices, shapes and target values, after autocast's cast."""
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be one of {[str(d) for d in _FLOAT_DTYPES]}, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape (..., d), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(
            f"weight must have shape (vocab >= 1, d) with d = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    vocab = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != vocab):
        raise ValueError(f"bias must have shape (vocab,) = ({vocab},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {hidden.dtype}, got {t.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("targets", targets)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {t.device}")
    _check_target_dtype(targets)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    # One reduction over the targets (a device sync on CUDA): an id out of range would
    # otherwise index past the logits (a device-side assert on CUDA).
    t = targets.reshape(-1)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"targets must be in [0, {vocab}) (vocab = weight.shape[0]) or ignore_index = {ignore_index}, "
            f"got {int(t[bad][0])}"
        )
