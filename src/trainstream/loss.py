"""Cross-entropy through the output layer without the full logits.

``chunked_cross_entropy(hidden, weight, targets)`` equals
``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` (the upcast transformers
does before its loss) but never holds the (tokens, vocab) logits: at 8192 tokens and a
152064-word vocabulary those are 2.5 GB in bf16 and 5 GB per fp32 copy, several copies of
which live at once in a plain forward and backward.

[Note: the two passes]
Both passes walk the vocabulary in the same slices: every token times as many words as keep a
slice's logits at ``chunk_size * vocab`` elements (chunk_size tokens' worth; one slice when
there are at most chunk_size tokens). A slice's logits are one matmul in the input dtype (the
matmul runs at the input's speed), upcast to fp32 (fp64 for fp64 inputs) as transformers
upcasts, a block of rows at a time (see [Note: row blocks]). Forward keeps each token's running
max, its sum of exp(z - max) (rescaled when the max grows) and its target's logit; it saves
hidden, weight, bias, targets and those per-token max and sum. Backward recomputes each slice's
logits, the same calls on the same slices, so they are forward's bit for bit and the saved max
and sum fit them exactly (logits recomputed in other shapes round differently, which in fp32
moves the gradients by more than 1e-6). It forms ``dlogits = scale * (softmax - onehot)``,
rounds it once to the input dtype (what the upcast's backward does in the unchunked loss), and
then
- d_weight of the slice's words is one matmul over all tokens, written in place: the unchunked
  loss's single rounding, and no accumulator the size of the weight (an fp32 one would be
  2.2 GB at 152064 x 3584, more than the rest of the loss holds);
- d_hidden accumulates over the slices in fp32 (fp64 for fp64): tokens x hidden, a small
  tensor; in bf16 or fp16 each slice's product is rounded once to the input dtype before it is
  added;
- d_bias of the slice's words is one sum over all tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

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
    ``chunk_size`` (an int >= 1) bounds the logits that exist at once to chunk_size tokens'
    worth (``chunk_size * vocab``), taken as every token times a slice of the vocabulary; see
    the module's note for how the two passes work.
    """
    _check_kinds(hidden, weight, targets, bias, chunk_size, ignore_index, reduction, num_items)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    _check_tensors(hidden, weight, targets, bias, ignore_index)
    d = hidden.shape[-1]
    flat_targets = targets.reshape(-1).long()
    total = _SummedCrossEntropy.apply(hidden.reshape(-1, d), weight, bias, flat_targets, chunk_size, ignore_index)
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.reshape(()).to(total.device)
        return total / num_items
    if reduction == "sum":
        return total
    # torch's mean: sum / count of tokens not ignored; 0 / 0 = nan when all are.
    return total / (flat_targets != ignore_index).sum().to(total.dtype)


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


class _SummedCrossEntropy(torch.autograd.Function):
    """Sum over the tokens not ignored of -log softmax(hidden @ weight.T + bias)[target].

    hidden (N, d), weight (V, d), bias (V,) or None, targets (N,) int64, already checked."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index):
        compute = _compute_dtype(hidden.dtype)
        n = hidden.shape[0]
        vocab = weight.shape[0]
        valid = targets != ignore_index
        row_max = torch.full((n,), -math.inf, dtype=compute, device=hidden.device)  # the true max so far
        ref = torch.zeros(n, dtype=compute, device=hidden.device)  # exp's reference: row_max, finite
        exp_sum = torch.zeros(n, dtype=compute, device=hidden.device)  # sum of exp(z - ref)
        picked = torch.zeros(n, dtype=compute, device=hidden.device)  # the target's logit
        slice_sum = torch.empty(n, dtype=compute, device=hidden.device)
        with _no_autocast(hidden.device):
            for v0, v1 in _slices(n, vocab, chunk_size):
                logits = _slice_logits(hidden, weight, bias, v0, v1)
                in_slice, column = _targets_in_slice(targets, valid, v0, v1)
                picked = torch.where(in_slice, logits.gather(1, column).squeeze(1), picked)
                torch.maximum(row_max, logits.amax(dim=1), out=row_max)  # exact in any dtype
                # torch.logsumexp's reference point: the max, or 0 where it is infinite.
                new_ref = row_max.masked_fill(row_max.abs() == math.inf, 0)
                for r0, r1 in _row_blocks(n):
                    slice_sum[r0:r1] = _exp_minus(logits[r0:r1], new_ref[r0:r1]).sum(dim=1)
                rescaled = torch.where(exp_sum == 0, 0, exp_sum * (ref - new_ref).exp())
                exp_sum = rescaled + slice_sum
                ref = new_ref
                del logits
        # log_softmax's order, log(sum exp(z - m)) - (z_t - m): m + log(s) rounded first would
        # carry the rounding at a large max into every token's loss.
        total = torch.where(valid, exp_sum.log() - (picked - ref), 0).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, ref, exp_sum)
        ctx.chunk_size = chunk_size
        ctx.ignore_index = ignore_index
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        hidden, weight, bias, targets, ref, exp_sum = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n, d = hidden.shape
        vocab = weight.shape[0]
        compute = ref.dtype
        d_hidden_sum = torch.zeros(n, d, dtype=compute, device=hidden.device) if need_hidden else None
        # Each slice writes its rows of d_weight and d_bias whole; with no token there is no slice.
        alloc = torch.empty if n else torch.zeros
        d_weight = alloc(weight.shape, dtype=weight.dtype, device=weight.device) if need_weight else None
        d_bias = alloc(vocab, dtype=bias.dtype, device=bias.device) if need_bias else None
        valid = targets != ctx.ignore_index
        # Each token's d(loss)/d(its loss); ignored tokens get 0, also when grad_total is not
        # finite (the mean over no token divides by 0), as torch's gradient is 0 there.
        scale = torch.where(valid, grad_total.to(compute), 0)
        # d_logits = scale * (softmax - onehot) = (e - s * onehot) * (scale / s) with
        # e = exp(z - m): the exponent is taken from the row max, as log_softmax's backward
        # takes it, so the largest probabilities keep full precision.
        prob_scale = (scale / exp_sum).unsqueeze(1)
        with _no_autocast(hidden.device):
            for v0, v1 in _slices(n, vocab, ctx.chunk_size):
                d_logits = _slice_logits(hidden, weight, bias, v0, v1)
                in_slice, column = _targets_in_slice(targets, valid, v0, v1)
                minus_sum = torch.where(in_slice, -exp_sum, 0).unsqueeze(1)
                for r0, r1 in _row_blocks(n):
                    e = _exp_minus(d_logits[r0:r1], ref[r0:r1])
                    e.scatter_add_(1, column[r0:r1], minus_sum[r0:r1])
                    # rounded once to the input dtype, over the logits they came from
                    torch.mul(e, prob_scale[r0:r1], out=d_logits[r0:r1])
                    del e
                if need_weight:
                    torch.mm(d_logits.t(), hidden, out=d_weight[v0:v1])
                if need_hidden:
                    if d_hidden_sum.dtype == d_logits.dtype:
                        d_hidden_sum.addmm_(d_logits, weight[v0:v1])
                    else:
                        d_hidden_sum += d_logits @ weight[v0:v1]
                if need_bias:
                    torch.sum(d_logits, 0, out=d_bias[v0:v1])
                del d_logits
        d_hidden = d_hidden_sum.to(hidden.dtype) if need_hidden else None
        return d_hidden, d_weight, d_bias, None, None, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the log-sum-exp (transformers upcasts its logits so), fp64 kept as it is."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _slices(tokens: int, vocab: int, chunk_size: int) -> list[tuple[int, int]]:
    """(v0, v1) word ranges: every token times v1 - v0 words holds at most chunk_size tokens'
    worth of logits (chunk_size * vocab); no slice when there is no token."""
    if tokens == 0:
        return []
    width = vocab if tokens <= chunk_size else max(1, (chunk_size * vocab) // tokens)
    return [(v0, min(v0 + width, vocab)) for v0 in range(0, vocab, width)]


def _slice_logits(hidden, weight, bias, v0: int, v1: int) -> torch.Tensor:
    """Every token's logits over words v0:v1, in the input dtype. Forward and backward call it
    with the same slices, so backward's logits are forward's, bit for bit."""
    return F.linear(hidden, weight[v0:v1], None if bias is None else bias[v0:v1])


# [Note: row blocks] A slice's upcast work runs on this many blocks of its rows, so the
# compute-dtype temporary is a quarter of the slice: with bf16 logits, half the bytes of the
# logits themselves, instead of twice them.
_ROW_BLOCKS = 4


def _row_blocks(tokens: int) -> list[tuple[int, int]]:
    step = max(1, -(-tokens // _ROW_BLOCKS))
    return [(r0, min(r0 + step, tokens)) for r0 in range(0, tokens, step)]


def _exp_minus(logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """exp(logits - ref[:, None]) in ref's (compute) dtype: the subtraction promotes the input
    dtype's logits exactly, in the same kernel, so no upcast copy of the logits is made."""
    return torch.sub(logits, ref.unsqueeze(1)).exp_()


def _targets_in_slice(targets, valid, v0: int, v1: int):
    """Which tokens' targets are words v0:v1, and their column in the slice (a clamped, unused
    one for the others, which the caller masks)."""
    in_slice = valid & (targets >= v0) & (targets < v1)
    return in_slice, (targets - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1)


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
