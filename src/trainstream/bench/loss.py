"""Suite `loss` (GPU): the chunked cross-entropy against the unchunked loss, at issue 21's
shape (vocab 152064, 8192 tokens, bf16 hidden 3584: a Qwen2.5-7B output layer).

Each row runs the loss and its backward, hidden and weight requiring grad (the last two rows:
the weight frozen, as under LoRA, where only d_hidden is made):
- unchunked: ``F.cross_entropy((hidden @ weight.T).float(), targets)``, the upcast transformers
  does before its loss;
- TrainStream: ``chunked_cross_entropy(hidden, weight, targets, chunk_size=...)``;
- Liger-Kernel's fused linear cross-entropy, when ``import liger_kernel`` works.

peak GiB: ``torch.cuda.max_memory_allocated()`` during the loss and its backward, above what was
allocated before it (the inputs and the previous row's kept reference); the gradients it leaves
(d_weight, d_hidden) are part of it for every row. Time: median of several runs of loss and
backward, synchronized. Loss and gradient differences are against the unchunked row's, relative
to its largest magnitude.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from ..loss import chunked_cross_entropy
from ..sizes import GiB
from .common import markdown_table, median_seconds

FULL = dict(vocab=152064, tokens=8192, dim=3584)
QUICK = dict(vocab=32000, tokens=2048, dim=1024)
CHUNK_SIZES = (1024, 4096)
# The targets of issue 21: at most an eighth of the unchunked peak, at most 1.1x its time.
PEAK_TARGET, TIME_TARGET = 1 / 8, 1.1


def _inputs(vocab: int, tokens: int, dim: int):
    """bf16 hidden (tokens, dim) and weight (vocab, dim) scaled so that logits are about unit
    normal, as a trained head's are in scale; random targets."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, dim, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, dim, device="cuda", generator=g) / dim**0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    return hidden, weight, targets


def _liger():
    """Liger-Kernel's loss as fn(hidden, weight, targets), or the reason it is not there."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # not installed, or its Triton does not load here
        return None, f"not installed ({type(exc).__name__})"
    module = LigerFusedLinearCrossEntropyLoss()

    def fn(hidden, weight, targets):
        out = module(weight, hidden, targets)
        return out[0] if isinstance(out, tuple) else out

    return fn, None


def _measure(fn, hidden, weight, targets, iters: int) -> dict:
    """Peak above the allocations before it, and the median time, of fn's loss and backward;
    with the loss and the gradients of the measured run."""

    def run():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, targets)
        loss.backward()
        return loss

    hidden.grad = weight.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = (hidden.grad, weight.grad)
    seconds = median_seconds(run, iters=iters, warmup=1, sync_cuda=True)
    hidden.grad = weight.grad = None
    return {"peak_GiB": peak / GiB, "s": seconds, "loss": loss.item(), "_grads": grads}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def run(*, quick: bool = False) -> dict:
    shape = QUICK if quick else FULL
    iters = 3 if quick else 5
    hidden, weight, targets = _inputs(**shape)
    unchunked = lambda h, w, t: F.cross_entropy((h @ w.T).float(), t)
    ours = {c: (lambda h, w, t, c=c: chunked_cross_entropy(h, w, t, chunk_size=c)) for c in CHUNK_SIZES}
    liger, liger_missing = _liger()
    # (weight trained, label, fn); each group's first row is the reference of its diffs and ratios.
    cases = [(True, "unchunked F.cross_entropy, logits upcast to fp32", unchunked)]
    cases += [(True, f"TrainStream chunked_cross_entropy, chunk_size={c}", ours[c]) for c in CHUNK_SIZES]
    cases += [(True, "Liger-Kernel fused linear cross-entropy", liger)]
    # A frozen output layer (LoRA): only d_hidden; the unchunked backward then has one matmul.
    cases += [
        (False, "weight frozen: unchunked", unchunked),
        (False, "weight frozen: TrainStream, chunk_size=1024", ours[1024]),
    ]
    rows, ref = [], {}
    for trained, label, fn in cases:
        print(f"  {label} ...", flush=True)
        if fn is None:
            rows.append({"run": label, "note": liger_missing})
            continue
        weight.requires_grad_(trained)
        try:
            r = _measure(fn, hidden, weight, targets, iters)
        except torch.OutOfMemoryError as exc:
            rows.append({"run": label, "note": f"out of memory: {str(exc).splitlines()[0][:120]}"})
            continue
        grads = r.pop("_grads")
        if trained not in ref:
            ref[trained] = {"loss": r["loss"], "grads": grads, "peak_GiB": r["peak_GiB"], "s": r["s"]}
        else:
            base = ref[trained]
            r["loss_diff"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
            r["d_hidden_diff"] = _rel(grads[0], base["grads"][0])
            if trained:
                r["d_weight_diff"] = _rel(grads[1], base["grads"][1])
        del grads
        r["x_peak"] = r["peak_GiB"] / ref[trained]["peak_GiB"]
        r["x_time"] = r["s"] / ref[trained]["s"]
        rows.append({"run": label, **r})
        print(f"    {rows[-1]}", flush=True)
    weight.requires_grad_(True)
    # The targets are for the trained output layer; the frozen layer is held to the same
    # ones (its chunked loss has the unchunked loss's two matmuls, as the trained one has three).
    checks = []
    for row in rows:
        if "TrainStream" in row["run"] and "s" in row:
            checks.append(
                dict(check=f"{row['run']}: peak / unchunked", value=row["x_peak"], target=f"<= {PEAK_TARGET:.3g}")
            )
            checks.append(
                dict(check=f"{row['run']}: time / unchunked", value=row["x_time"], target=f"<= {TIME_TARGET}")
            )
    table = markdown_table(
        [
            ("run", "run"),
            ("peak_GiB", "peak GiB"),
            ("x_peak", "x unchunked peak"),
            ("s", "s (loss + backward)"),
            ("x_time", "x unchunked time"),
            ("loss", "loss"),
            ("loss_diff", "loss rel. diff"),
            ("d_hidden_diff", "d_hidden max diff"),
            ("d_weight_diff", "d_weight max diff"),
            ("note", "note"),
        ],
        rows,
    )
    check_table = markdown_table([("check", "check"), ("value", "measured"), ("target", "target")], checks)
    md = (
        f"vocab {shape['vocab']}, {shape['tokens']} tokens, hidden {shape['dim']}, bf16; hidden and weight "
        "require grad. Peak: above the inputs, the gradients included; diffs relative to the unchunked "
        "row's largest magnitude.\n\n" + table + "\n\n" + check_table
    )
    return {"shape": shape, "rows": rows, "checks": checks, "markdown": md}
