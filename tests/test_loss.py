"""chunked_cross_entropy and causal_lm_loss against F.cross_entropy of the full logits (and
transformers' ForCausalLMLoss), their memory bound, and their argument checks."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import trainstream
from trainstream import causal_lm_loss, chunked_cross_entropy

VOCAB, DIM = 53, 16


def _inputs(shape=(3, 37), dtype=torch.float64, bias=False, device="cpu", vocab=VOCAB, dim=DIM, ignored=5):
    """hidden (*shape, dim), weight (vocab, dim), bias or None, targets (*shape) with the first
    `ignored` tokens of the first row set to -100; all floating inputs require grad."""
    hidden = torch.randn(*shape, dim, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(vocab, dim, dtype=dtype, device=device) / dim**0.25).requires_grad_()
    b = torch.randn(vocab, dtype=dtype, device=device, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, shape, device=device)
    targets.view(-1)[:ignored] = -100
    return hidden, weight, b, targets


def _reference(hidden, weight, targets, bias=None, *, ignore_index=-100, reduction="mean"):
    """The unchunked loss as transformers computes it: the full logits, upcast to fp32 (fp64
    stays fp64), then F.cross_entropy."""
    logits = F.linear(hidden, weight, bias)
    if logits.dtype != torch.float64:
        logits = logits.float()
    return F.cross_entropy(
        logits.reshape(-1, weight.shape[0]), targets.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )


def _loss_and_grads(loss, tensors, grad_output=None):
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    return [loss.detach()] + list(torch.autograd.grad(loss, wanted, grad_outputs=grad_output))


def _assert_close(actual, expected, tol):
    """Every tensor within tol of its reference, relative to the reference's largest magnitude."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape, a.dtype, e.dtype)
        err = (a.double() - e.double()).abs().max().item() if a.numel() else 0.0
        scale = e.double().abs().max().item() if e.numel() else 0.0
        assert err <= tol * max(scale, 1e-30), f"max error {err:.3g} > {tol} x {scale:.3g}"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-6)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
def test_matches_full_logits(dtype, tol, reduction, bias, chunk_size):
    hidden, weight, b, targets = _inputs(dtype=dtype, bias=bias)
    ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=chunk_size, reduction=reduction)
    ref = _reference(hidden, weight, targets, b, reduction=reduction)
    _assert_close(_loss_and_grads(ours, [hidden, weight, b]), _loss_and_grads(ref, [hidden, weight, b]), tol)


def _assert_as_close_to_truth(ours, ref, tensors, targets, slack, grad_output=None):
    """ours (loss and gradients) no farther from the fp64 truth of the same inputs than the
    full-logits reference ref, plus slack times the truth's largest magnitude."""
    exact = [t.detach().double().requires_grad_() for t in tensors if t is not None]
    bias = exact[2] if len(exact) == 3 else None
    g = None if grad_output is None else grad_output.detach().double()
    truth = _loss_and_grads(_reference(exact[0], exact[1], targets, bias), exact, g)
    for o, r, t in zip(ours, ref, truth):
        scale = t.abs().max().item()
        ours_err = (o.double() - t).abs().max().item()
        ref_err = (r.double() - t).abs().max().item()
        assert ours_err <= ref_err + slack * scale, (ours_err, ref_err, scale)


def test_large_logits_keep_their_precision():
    """Logits in the tens (a confident model): fp64 within 1e-9 of the full logits' loss; fp32,
    where the logits themselves round by more than 1e-6 (any other matmul shape rounds them
    differently), no farther from the fp64 truth than the fp32 full-logits loss, within 1e-6."""
    for dtype in (torch.float64, torch.float32):
        hidden, weight, b, targets = _inputs(dtype=dtype, shape=(200,))
        with torch.no_grad():
            weight.mul_(6)
        ours = _loss_and_grads(chunked_cross_entropy(hidden, weight, targets, chunk_size=16), [hidden, weight])
        ref = _loss_and_grads(_reference(hidden, weight, targets), [hidden, weight])
        assert ref[0] > 5
        if dtype == torch.float64:
            _assert_close(ours, ref, 1e-9)
        else:
            _assert_as_close_to_truth(ours, ref, [hidden, weight], targets, 1e-6)


def test_gradcheck():
    """torch's numerical gradient check, fp64, several slices, bias and ignored tokens."""
    hidden, weight, b, targets = _inputs(shape=(9,), bias=True, vocab=11, dim=4, ignored=2)
    fn = lambda h, w, bias: chunked_cross_entropy(h, w, targets, bias, chunk_size=4)
    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


def test_grad_output_scales_the_gradients():
    hidden, weight, b, targets = _inputs(bias=True)
    g = torch.tensor(2.5, dtype=torch.float64)
    ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=5)
    ref = _reference(hidden, weight, targets, b)
    _assert_close(_loss_and_grads(ours, [hidden, weight, b], g), _loss_and_grads(ref, [hidden, weight, b], g), 1e-9)


_MATMULS = {"aten.mm.default", "aten.mm.out", "aten.addmm.default", "aten.addmm_.default", "aten.addmm.out"}


class _Calls(TorchDispatchMode):
    """Records each op's name and the storages of the tensors it returns (held, so that no
    later tensor is given their memory; the tensors themselves are not held)."""

    def __init__(self):
        super().__init__()
        self.names, self.storages = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(str(func))
        self.storages += [t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel()]
        return out

    def made(self, t: torch.Tensor) -> bool:
        return any(s.data_ptr() == t.untyped_storage().data_ptr() for s in self.storages)

    def matmuls(self):
        return sum(name in _MATMULS for name in self.names)


@pytest.mark.parametrize("frozen_weight", [False, True])
def test_backward_recomputes_nothing(frozen_weight):
    """Forward makes the gradients: per chunk the logits, d_hidden and (unless the weight is
    frozen, as under LoRA) d_weight, 3 or 2 matmuls; backward runs none. Without grad, one
    matmul per chunk."""
    hidden, weight, b, targets = _inputs(shape=(40,), bias=True)
    weight.requires_grad_(not frozen_weight)
    chunks = 5  # 40 tokens in chunks of 8
    with _Calls() as forward:
        loss = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=8)
    with _Calls() as backward:
        loss.backward()
    assert forward.matmuls() == chunks * (2 if frozen_weight else 3)
    assert backward.matmuls() == 0, backward.names
    with torch.no_grad(), _Calls() as evaluation:
        chunked_cross_entropy(hidden, weight, targets, b, chunk_size=8)
    assert evaluation.matmuls() == chunks


def test_gradients_become_grad_without_a_copy():
    """The d_weight and d_hidden forward made are the .grad backward leaves (no copy: the peak
    holds one weight-sized gradient), in bf16 as in fp64."""
    for dtype in (torch.float64, torch.bfloat16):
        hidden, weight, b, targets = _inputs(shape=(40,), dtype=dtype)
        with _Calls() as forward:
            loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=8)
        loss.backward()
        assert forward.made(weight.grad) and forward.made(hidden.grad)


def test_second_backward_through_the_graph():
    """retain_graph=True: a second backward gives the same gradients again (they add up in
    .grad as torch's do), and so does a third."""
    hidden, weight, b, targets = _inputs(bias=True)
    tensors = [hidden, weight, b]
    ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=7)
    for _ in range(3):
        ours.backward(retain_graph=True)
    got = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    ref = _reference(hidden, weight, targets, b)
    for _ in range(3):
        ref.backward(retain_graph=True)
    _assert_close(got, [t.grad for t in tensors], 1e-9)


def test_double_backward_is_refused():
    hidden, weight, b, targets = _inputs()
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=7)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(loss, [hidden], create_graph=True)


def test_non_finite_grad_output_leaves_ignored_tokens_at_zero():
    hidden, weight, b, targets = _inputs()
    g = torch.tensor(float("nan"), dtype=torch.float64)
    ours = _loss_and_grads(chunked_cross_entropy(hidden, weight, targets, chunk_size=7), [hidden], g)[1]
    ref = _loss_and_grads(_reference(hidden, weight, targets), [hidden], g)[1]
    ignored = targets == -100
    assert torch.equal(ours.isnan(), ref.isnan()) and not ours[ignored].any() and ours[~ignored].isnan().all()


def _relative_errors(tensors, truth):
    """Each tensor's distance from its truth relative to the truth's norm (an Adam step sees
    each element's relative error: a gradient flushed to 0 is 100% wrong however small)."""
    return [((a.double() - t).norm() / t.norm()).item() for a, t in zip(tensors, truth)]


@pytest.mark.parametrize(
    "reduction,num_items,ignore_index,grad_output",
    [
        ("mean", None, -100, 2.0**16),  # GradScaler's first scale
        ("mean", 3000, -100, 2.0**16),  # num_items_in_batch of a 3-step window
        ("mean", None, 7, 2.0**16),  # half the tokens ignored, another ignore_index
        ("sum", None, -100, 2.0**5),  # the sum's d_logits are g * (softmax - onehot): g < 65504
    ],
)
def test_fp16_under_a_loss_scale_is_as_accurate_as_torch(reduction, num_items, ignore_index, grad_output):
    """fp16 with a large loss gradient (a GradScaler's scale): the gradients no farther from the
    fp64 truth than torch's unchunked fp16 loss, within a factor of 1.5 (d_weight is summed over
    the chunks in fp16, here 4), also on the rows of words no token targets (their gradient is
    the sum of small probabilities, which round to subnormals or 0 when rounded at the unscaled
    1 / N; the loss gradient then cannot bring back what was lost)."""
    _check_fp16_loss_scale("cpu", 1024, 4000, 32, 256, reduction, num_items, ignore_index, grad_output)


def _check_fp16_loss_scale(device, tokens, vocab, dim, chunk_size, reduction, num_items, ignore_index, g):
    """Ours and torch's fp16 loss (transformers' upcast, sum / num_items as its
    fixed_cross_entropy) given the loss gradient g, each gradient's error from the fp64 truth."""
    default_index = ignore_index == -100
    hidden, weight, b, targets = _inputs(
        shape=(tokens,),
        dtype=torch.float16,
        bias=True,
        device=device,
        vocab=vocab,
        dim=dim,
        ignored=5 if default_index else 0,
    )
    if not default_index:
        targets[targets == ignore_index] = 0
        targets[::2] = ignore_index
    kwargs = dict(ignore_index=ignore_index, reduction=reduction, num_items=num_items)
    g = torch.tensor(g, device=device)
    tensors = [hidden, weight, b]

    def torchs(h, w, bias):
        logits = F.linear(h, w, bias)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum" if num_items else reduction)
        return loss / num_items if num_items else loss

    loss = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=chunk_size, **kwargs)
    ours = _loss_and_grads(loss, tensors, g)
    ref = _loss_and_grads(torchs(hidden, weight, b), tensors, g)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    truth = _loss_and_grads(torchs(*exact), exact, g.double())
    assert abs(ours[0].item() - ref[0].item()) <= 1e-4 * abs(ref[0].item())  # both from fp16 logits
    ours_err, ref_err = _relative_errors(ours[1:], truth[1:]), _relative_errors(ref[1:], truth[1:])
    untargeted = torch.ones(vocab, dtype=torch.bool, device=device)
    untargeted[targets[targets != ignore_index]] = False
    [ours_rows], [ref_rows] = (_relative_errors([r[2][untargeted]], [truth[2][untargeted]]) for r in (ours, ref))
    for a, r in zip(ours_err + [ours_rows], ref_err + [ref_rows]):
        assert r < 2e-3 and a <= 1.5 * r, (ours_err, ours_rows, ref_err, ref_rows)


@pytest.mark.gpu
def test_gpu_fp16_under_a_loss_scale_is_as_accurate_as_torch():
    """The same on CUDA (cuBLAS), 4 chunks: a hidden value above 2 times a d_logit near
    -2**15 passes 65504 before the matmul's alpha, so an fp16 partial sum would make d_weight
    inf (see _fp32_partial_sums)."""
    _check_fp16_loss_scale("cuda", 4096, 32000, 64, 1024, "mean", None, -100, 2.0**16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grad_output_other_than_one_as_torch(device):
    """bf16, a loss gradient of 1/3 (a loss divided by the accumulation steps): the gradients
    no farther from the fp64 truth than torch's unchunked bf16 loss given the same gradient,
    within one bf16 rounding of the largest value (d_hidden and d_weight are rounded in forward
    and again after the multiplication; torch rounds its d_logits after it, then the matmuls)."""
    hidden, weight, b, targets = _inputs(shape=(40,), dtype=torch.bfloat16, bias=True, device=device)
    g = torch.tensor(1 / 3, device=device)
    ours = _loss_and_grads(chunked_cross_entropy(hidden, weight, targets, b, chunk_size=8), [hidden, weight, b], g)
    ref = _loss_and_grads(_reference(hidden, weight, targets, b), [hidden, weight, b], g)
    _assert_as_close_to_truth(ours, ref, [hidden, weight, b], targets, 2**-8, grad_output=g)


@pytest.mark.parametrize("shape", [(37,), (2, 3, 5), ()])
def test_any_leading_shape(shape):
    hidden, weight, b, targets = _inputs(shape=shape, ignored=0)
    ours = chunked_cross_entropy(hidden, weight, targets, chunk_size=4)
    ref = _reference(hidden, weight, targets)
    got = _loss_and_grads(ours, [hidden, weight])
    assert got[1].shape == hidden.shape
    _assert_close(got, _loss_and_grads(ref, [hidden, weight]), 1e-9)


def test_non_contiguous_hidden():
    hidden, weight, b, targets = _inputs(shape=(3, 38))
    sliced, t = hidden[:, :-1], targets[:, 1:]
    assert not sliced.is_contiguous()
    ours = chunked_cross_entropy(sliced, weight, t, chunk_size=8)
    _assert_close(
        _loss_and_grads(ours, [hidden, weight]), _loss_and_grads(_reference(sliced, weight, t), [hidden, weight]), 1e-9
    )


@pytest.mark.parametrize("ignore_index", [-100, 0, 7, -1])
def test_ignore_index(ignore_index):
    hidden, weight, b, targets = _inputs(ignored=0)
    targets.view(-1)[::3] = ignore_index
    ours = chunked_cross_entropy(hidden, weight, targets, chunk_size=9, ignore_index=ignore_index)
    ref = _reference(hidden, weight, targets, ignore_index=ignore_index)
    _assert_close(_loss_and_grads(ours, [hidden, weight]), _loss_and_grads(ref, [hidden, weight]), 1e-9)


@pytest.mark.parametrize("tokens", [0, 6])
def test_all_ignored_is_torchs_answer(tokens):
    """The mean over no token is nan and its gradients are 0, as torch answers; the sum is 0."""
    hidden, weight, b, targets = _inputs(shape=(tokens,), bias=True, ignored=tokens)
    for reduction in ("mean", "sum"):
        ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=2, reduction=reduction)
        ref = _reference(hidden, weight, targets, b, reduction=reduction)
        got, want = _loss_and_grads(ours, [hidden, weight, b]), _loss_and_grads(ref, [hidden, weight, b])
        assert torch.equal(got[0].isnan(), want[0].isnan()) and got[0].isnan() == (reduction == "mean")
        for a, e in zip(got[1:], want[1:]):
            assert torch.equal(a, e) and not a.any()


@pytest.mark.parametrize("num_items", [17, torch.tensor(17), torch.tensor([17.0], dtype=torch.float64)])
def test_num_items_divides_the_sum(num_items):
    """transformers' fixed_cross_entropy: sum reduction divided by num_items_in_batch."""
    hidden, weight, b, targets = _inputs()
    ours = chunked_cross_entropy(hidden, weight, targets, chunk_size=10, num_items=num_items)
    ref = _reference(hidden, weight, targets, reduction="sum") / 17
    assert ours.shape == ()
    _assert_close(_loss_and_grads(ours, [hidden, weight]), _loss_and_grads(ref, [hidden, weight]), 1e-9)


@pytest.mark.parametrize("num_items", [None, torch.tensor(40)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-6)])
def test_causal_lm_loss_matches_transformers(num_items, dtype, tol):
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, b, labels = _inputs(shape=(2, 29), dtype=dtype, bias=True)
    labels[1, 20:] = -100
    ours = causal_lm_loss(hidden, weight, labels, b, chunk_size=8, num_items=num_items)
    ref = ForCausalLMLoss(F.linear(hidden, weight, b), labels, VOCAB, num_items_in_batch=num_items)
    if dtype == torch.float64:  # transformers upcasts with .float(); fp64 input stays fp64 here
        ref = F.cross_entropy(
            F.linear(hidden, weight, b)[:, :-1].reshape(-1, VOCAB),
            labels[:, 1:].reshape(-1),
            reduction="mean" if num_items is None else "sum",
        ) / (1 if num_items is None else num_items)
    _assert_close(_loss_and_grads(ours, [hidden, weight, b]), _loss_and_grads(ref, [hidden, weight, b]), tol)


@pytest.mark.parametrize("which", ["hidden", "weight", "bias", "none"])
def test_only_what_requires_grad(which):
    hidden, weight, b, targets = _inputs(bias=True)
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", b)):
        t.requires_grad_(name == which)
    ours = chunked_cross_entropy(hidden, weight, targets, b, chunk_size=6)
    if which == "none":
        assert not ours.requires_grad
        _assert_close([ours], [_reference(hidden, weight, targets, b)], 1e-9)
        return
    ref = _reference(hidden, weight, targets, b)
    _assert_close(_loss_and_grads(ours, [hidden, weight, b]), _loss_and_grads(ref, [hidden, weight, b]), 1e-9)


def test_int32_targets():
    hidden, weight, b, targets = _inputs()
    ours = chunked_cross_entropy(hidden, weight, targets.int(), chunk_size=8)
    _assert_close([ours], [_reference(hidden, weight, targets)], 1e-9)


@pytest.mark.parametrize("dtype,rounding", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11)])
def test_half_precision_matches_the_upcast_reference(dtype, rounding):
    """bf16 and fp16 inputs: the loss in fp32 from logits in the input dtype, the gradients in
    it; no farther from the fp64 truth than the unchunked reference, to within one rounding."""
    hidden, weight, b, targets = _inputs(shape=(4, 64), dtype=dtype, bias=True, vocab=300, dim=32)
    ours = _loss_and_grads(chunked_cross_entropy(hidden, weight, targets, b, chunk_size=16), [hidden, weight, b])
    ref = _loss_and_grads(_reference(hidden, weight, targets, b), [hidden, weight, b])
    assert ours[0].dtype == torch.float32 and ours[1].dtype == dtype
    _assert_as_close_to_truth(ours, ref, [hidden, weight, b], targets, rounding)


def test_autocast_casts_as_linear_does():
    """Under CPU autocast the fp32 inputs run as bf16 (as F.linear under autocast would) and
    the fp32 leaves get their gradients through the cast."""
    hidden, weight, b, targets = _inputs(dtype=torch.float32, shape=(50,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_cross_entropy(hidden, weight, targets, chunk_size=8)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    got, want = _loss_and_grads(ours, [hidden, weight]), _loss_and_grads(ref, [hidden, weight])
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    _assert_close(got[:1], want[:1], 1e-5)
    _assert_close(got[1:], want[1:], 2**-6)
    # not what fp32 gives: the bf16 cast happened
    fp32 = chunked_cross_entropy(hidden, weight, targets, chunk_size=8)
    assert (fp32 - ours).abs() > 1e-6


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns, overall and per dtype."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.by_dtype = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                self.by_dtype[t.dtype] = max(self.by_dtype.get(t.dtype, 0), t.numel())
        return out


@pytest.mark.parametrize("chunk_size", [8, 20])
def test_never_holds_the_full_logits(chunk_size):
    """No tensor made in forward or backward holds more than chunk_size tokens' logits (the
    full logits are 64 x 50); the unchunked loss does make one."""
    hidden, weight, b, targets = _inputs(shape=(64,), vocab=50, dim=3)
    with _LargestTensor() as seen:
        chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk_size).backward()
    assert seen.largest <= chunk_size * 50
    with _LargestTensor() as unchunked:
        _reference(hidden, weight, targets).backward()
    assert unchunked.largest == 64 * 50


def test_bf16_weight_gradient_accumulates_in_bf16():
    """d_weight is summed over the chunks in the weight's dtype: no fp32 tensor the size of
    the weight exists (at 152064 x 3584 one would be 2 GiB, past the memory bound)."""
    hidden, weight, b, targets = _inputs(shape=(64,), dtype=torch.bfloat16, vocab=50, dim=64)
    with _LargestTensor() as seen:
        chunked_cross_entropy(hidden, weight, targets, chunk_size=8).backward()
    assert seen.by_dtype[torch.float32] <= 8 * 50 < weight.numel()
    assert weight.grad.dtype == torch.bfloat16


class _WeightSized(TorchDispatchMode):
    """The distinct storages of the tensors of `numel` elements that ops return (held, so that
    no later tensor is given their memory; an in-place op returns its input's)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.storages = numel, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                self.storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return out


def test_fp16_range_bounds_make_no_weight_sized_temporary():
    """fp16 reads max|W| and max|h| for its scales ([Note: fp16 range]) by a reduction: the one
    weight-sized tensor made in forward and backward is d_weight (an abs() would be a second,
    1 GiB at 152064 x 3584)."""
    hidden, weight, b, targets = _inputs(shape=(64,), dtype=torch.float16, vocab=50, dim=64)
    with _WeightSized(weight.numel()) as seen:
        chunked_cross_entropy(hidden, weight, targets, chunk_size=8).backward()
    seen.storages.pop(weight.untyped_storage().data_ptr())  # F.linear's view of the weight
    assert len(seen.storages) == 1 and weight.grad is not None


def test_fp16_matmul_settings_are_restored():
    """_fp32_partial_sums turns torch's fp16 reduced-precision reductions and fp16 accumulation
    off on CUDA for the walk and gives back the caller's settings, also when the walk raises."""
    from trainstream.loss import _fp32_partial_sums

    m = torch.backends.cuda.matmul
    saved = (m.allow_fp16_reduced_precision_reduction, m.allow_fp16_accumulation)
    try:
        m.allow_fp16_reduced_precision_reduction, m.allow_fp16_accumulation = True, True
        with pytest.raises(KeyError), _fp32_partial_sums(torch.device("cuda"), True):
            assert not m.allow_fp16_reduced_precision_reduction and not m.allow_fp16_accumulation
            raise KeyError
        assert m.allow_fp16_reduced_precision_reduction and m.allow_fp16_accumulation
        with _fp32_partial_sums(torch.device("cpu"), True):  # the settings are CUDA's
            assert m.allow_fp16_reduced_precision_reduction
    finally:
        m.allow_fp16_reduced_precision_reduction, m.allow_fp16_accumulation = saved


class _OlderMatmulSettings:
    """torch.backends.cuda.matmul as torch 2.8 has it: no split-K half, no fp16 accumulation;
    an unknown name raises AttributeError, as the real object does."""

    def __init__(self):
        self.allow_fp16_reduced_precision_reduction = True

    def __setattr__(self, name, value):
        if name != "allow_fp16_reduced_precision_reduction" or not isinstance(value, bool):
            raise AttributeError(f"Unknown attribute or value {name}={value!r}")
        object.__setattr__(self, name, value)


def test_fp16_matmul_settings_on_a_torch_without_the_newer_ones(monkeypatch):
    from trainstream.loss import _fp32_partial_sums

    older = _OlderMatmulSettings()
    monkeypatch.setattr(torch.backends.cuda, "matmul", older)
    with _fp32_partial_sums(torch.device("cuda"), True):
        assert older.allow_fp16_reduced_precision_reduction is False
    assert older.allow_fp16_reduced_precision_reduction is True


def test_fp16_matmul_settings_stay_off_until_the_last_overlapping_walk_ends():
    """Two walks that overlap (two threads): the first to end must not turn the settings back
    on under the second, and the last gives back what the first found."""
    from trainstream.loss import _fp32_partial_sums

    m = torch.backends.cuda.matmul
    saved = (m.allow_fp16_reduced_precision_reduction, m.allow_fp16_accumulation)
    try:
        m.allow_fp16_reduced_precision_reduction, m.allow_fp16_accumulation = True, True
        first, second = _fp32_partial_sums(torch.device("cuda"), True), _fp32_partial_sums(torch.device("cuda"), True)
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert not m.allow_fp16_reduced_precision_reduction and not m.allow_fp16_accumulation
        second.__exit__(None, None, None)
        assert m.allow_fp16_reduced_precision_reduction and m.allow_fp16_accumulation
    finally:
        m.allow_fp16_reduced_precision_reduction, m.allow_fp16_accumulation = saved


def test_exported():
    assert trainstream.chunked_cross_entropy is chunked_cross_entropy
    assert trainstream.causal_lm_loss is causal_lm_loss
    assert {"chunked_cross_entropy", "causal_lm_loss"} <= set(trainstream.__all__)


def _bad_cases():
    h = torch.randn(4, DIM, dtype=torch.float64)
    w = torch.randn(VOCAB, DIM, dtype=torch.float64)
    t = torch.randint(0, VOCAB, (4,))
    ok = dict(hidden=h, weight=w, targets=t)
    return [
        ("hidden", dict(ok, hidden=h.tolist()), TypeError),
        ("hidden", dict(ok, hidden=h.long()), TypeError),
        ("hidden", dict(ok, hidden=torch.tensor(1.0, dtype=torch.float64)), ValueError),
        ("weight", dict(ok, weight=None), TypeError),
        ("weight", dict(ok, weight=w[:, :-1]), ValueError),
        ("weight", dict(ok, weight=w[0]), ValueError),
        ("weight", dict(ok, weight=w[:0]), ValueError),
        ("weight", dict(ok, weight=w.float()), TypeError),
        ("weight", dict(ok, weight=w.to("meta")), ValueError),
        ("targets", dict(ok, targets=t.double()), TypeError),
        ("targets", dict(ok, targets=t.bool()), TypeError),
        ("targets", dict(ok, targets=t[:3]), ValueError),
        ("targets", dict(ok, targets=t.reshape(2, 2)), ValueError),
        ("targets", dict(ok, targets=torch.tensor([0, 1, VOCAB, 2])), ValueError),
        ("targets", dict(ok, targets=torch.tensor([0, -1, 1, 2])), ValueError),
        ("targets", dict(ok, targets=[0, 1, 2, 3]), TypeError),
        ("bias", dict(ok, bias=torch.zeros(VOCAB + 1, dtype=torch.float64)), ValueError),
        ("bias", dict(ok, bias=torch.zeros(VOCAB)), TypeError),
        ("bias", dict(ok, bias=[0.0] * VOCAB), TypeError),
        ("chunk_size", dict(ok, chunk_size=0), ValueError),
        ("chunk_size", dict(ok, chunk_size=2.0), TypeError),
        ("chunk_size", dict(ok, chunk_size=True), TypeError),
        ("ignore_index", dict(ok, ignore_index=None), TypeError),
        ("ignore_index", dict(ok, ignore_index=-100.0), TypeError),
        ("reduction", dict(ok, reduction="none"), ValueError),
        ("reduction", dict(ok, reduction=None), ValueError),
        ("num_items", dict(ok, num_items=0), ValueError),
        ("num_items", dict(ok, num_items=2.0), TypeError),
        ("num_items", dict(ok, num_items=True), TypeError),
        ("num_items", dict(ok, num_items=torch.tensor([1, 2])), ValueError),
        ("num_items", dict(ok, num_items=torch.tensor(True)), ValueError),
        ("num_items", dict(ok, num_items=4, reduction="sum"), ValueError),
    ]


@pytest.mark.parametrize("fn", [chunked_cross_entropy, causal_lm_loss])
@pytest.mark.parametrize("name,kwargs,error", _bad_cases())
def test_bad_arguments_name_themselves(fn, name, kwargs, error):
    # (causal_lm_loss's shift drops only the first target; the bad ids sit after it)
    kwargs = dict(kwargs)
    with pytest.raises(error, match=name):
        fn(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets"), **kwargs)


def test_causal_lm_loss_needs_a_sequence():
    with pytest.raises(ValueError, match="targets"):
        causal_lm_loss(torch.randn(DIM), torch.randn(VOCAB, DIM), torch.tensor(3))


# GPU: the same exactness on CUDA, and the memory bound against the unchunked loss.


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fp32_matches_full_logits(bias):
    hidden, weight, b, targets = _inputs(
        shape=(3000,), dtype=torch.float32, bias=bias, device="cuda", vocab=5000, dim=256
    )
    ours = _loss_and_grads(chunked_cross_entropy(hidden, weight, targets, b, chunk_size=512), [hidden, weight, b])
    ref = _loss_and_grads(_reference(hidden, weight, targets, b), [hidden, weight, b])
    _assert_close(ours[:1], ref[:1], 1e-6)
    # cuBLAS rounds the logits of a chunk's rows and of the whole matrix differently, by about
    # 1e-6 of the gradients here: measured against the fp64 truth instead.
    _assert_as_close_to_truth(ours, ref, [hidden, weight, b], targets, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_bf16_as_close_as_the_reference(bias):
    """bf16 on CUDA: no farther from the fp64 truth than the unchunked bf16 reference computed
    from the same inputs, to within a bf16 rounding of the largest value."""
    hidden, weight, b, targets = _inputs(
        shape=(4096,), dtype=torch.bfloat16, bias=bias, device="cuda", vocab=8000, dim=512
    )
    ours = _loss_and_grads(chunked_cross_entropy(hidden, weight, targets, b, chunk_size=512), [hidden, weight, b])
    ref = _loss_and_grads(_reference(hidden, weight, targets, b), [hidden, weight, b])
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.bfloat16
    assert abs(ours[0].item() - ref[0].item()) <= 1e-3 * abs(ref[0].item())
    _assert_as_close_to_truth(ours, ref, [hidden, weight, b], targets, 2**-8)


@pytest.mark.gpu
@pytest.mark.parametrize("frozen_weight", [False, True])
def test_gpu_peak_is_an_eighth_of_the_unchunked(frozen_weight):
    """bf16, 8192 tokens, vocab 32000: the loss and its backward peak (above the inputs) at
    under an eighth of the unchunked loss's (issue 21's bound), gradients included in both,
    with the weight trained or frozen."""
    hidden, weight, b, targets = _inputs(shape=(8192,), dtype=torch.bfloat16, device="cuda", vocab=32000, dim=1024)
    weight.requires_grad_(not frozen_weight)

    def peak(fn):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    chunked = lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=1024)
    peak(chunked)  # cuBLAS's workspace for this stream is allocated by a first matmul, not measured
    ours, unchunked = peak(chunked), peak(lambda: _reference(hidden, weight, targets))
    assert ours * 8 < unchunked, (ours, unchunked)
