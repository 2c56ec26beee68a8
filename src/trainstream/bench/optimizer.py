"""Suite `optimizer`: the host AdamW against torch's fused CPU AdamW and DeepSpeedCPUAdam.

Every implementation updates the same number of fp32 parameters with the same thread
count, in one run. Bytes per parameter count each stream once: fp32 master read+write 8,
gradient read 4 (bf16: 2), each moment read+write 8 (bf16: 4), optional bf16 copy 2.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch

from .. import ops
from .common import markdown_table, median_seconds

ACCURACY_PARAMS = 1 << 20
ACCURACY_STEPS = 20
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def _ours(grad_dtype, moment_dtype, copy_dtype, threads):
    def make(n):
        p = torch.randn(n)
        g = (torch.randn(n) * 1e-2).to(grad_dtype)
        m = torch.zeros(n, dtype=moment_dtype)
        v = torch.zeros(n, dtype=moment_dtype)
        c = None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype)]
        step = [0]

        def run():
            step[0] += 1
            ops.adamw_step(
                [p],
                [g],
                [m],
                [v],
                [step[0]],
                lr=HYPER["lr"],
                beta1=HYPER["betas"][0],
                beta2=HYPER["betas"][1],
                eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"],
                seeds=[1],
                param_copies=c,
                threads=threads,
            ).wait()

        return run, p, (lambda new_g: g.copy_(new_g))

    return make


def _torch_optimizer(factory):
    def make(n):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-2
        opt = factory([p])
        return opt.step, p.data, (lambda new_g: p.grad.copy_(new_g))

    return make


def _deepspeed_factory():
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401 (import checked by caller)

    return lambda params: DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)


def _max_diff_vs_torch(make) -> float:
    """Max |param difference| from torch.optim.AdamW(foreach=False) after 20 steps."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(ACCURACY_PARAMS, generator=gen) * 1e-2 for _ in range(ACCURACY_STEPS)]
    torch.manual_seed(1)
    step, param, set_grad = make(ACCURACY_PARAMS)
    ref = torch.nn.Parameter(param.detach().clone().float())
    ref_opt = torch.optim.AdamW([ref], foreach=False, **HYPER)
    for g in grads:
        set_grad(g)
        step()
        ref.grad = g.clone()
        ref_opt.step()
    return (param.float() - ref.detach()).abs().max().item()


def implementations(threads: int):
    rows = [
        (
            "torch.optim.AdamW(fused=True), CPU",
            "peer",
            28,
            _torch_optimizer(lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER)),
        ),
    ]
    try:
        rows.append(("DeepSpeedCPUAdam (adamw_mode)", "peer", 28, _torch_optimizer(_deepspeed_factory())))
    except Exception as exc:  # not installed, or its extension failed to build
        rows.append(("DeepSpeedCPUAdam (adamw_mode)", f"not run: {type(exc).__name__}: {exc}"[:160], 28, None))
    rows += [
        ("trainstream fp32 moments, fp32 grads", "ours", 28, _ours(torch.float32, torch.float32, None, threads)),
        ("trainstream bf16 moments, fp32 grads", "ours", 20, _ours(torch.float32, torch.bfloat16, None, threads)),
        ("trainstream bf16 moments, bf16 grads", "ours", 18, _ours(torch.bfloat16, torch.bfloat16, None, threads)),
        (
            "trainstream bf16 moments, bf16 grads, + bf16 weight copy",
            "ours",
            20,
            _ours(torch.bfloat16, torch.bfloat16, torch.bfloat16, threads),
        ),
    ]
    return rows


def host_copy_GBps(n: int) -> float:
    """Host memory bandwidth as torch's multi-threaded copy sees it (read + write)."""
    a = torch.randn(n)
    b = torch.empty_like(a)
    t = median_seconds(lambda: b.copy_(a), iters=5)
    return 2 * n * 4 / t / 1e9


def _fit_params(params: int) -> int:
    """Every implementation's state is alive at once (about 90 bytes per parameter in
    all): halve the size until that fits in half of the available RAM."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return params
    while params > (1 << 20) and params * 90 > available // 2:
        params //= 2
    return params


def run(*, params: int, threads: int, iters: int) -> dict:
    """Steps the implementations in turn, round after round, and takes each one's median:
    on a shared host a slow spell then hits every implementation alike instead of
    whichever happened to be measured during it."""
    torch.set_num_threads(threads)
    params = _fit_params(params)
    copy_bw = host_copy_GBps(params)
    rows, steps = [], {}
    impls = implementations(threads)
    for name, kind, bytes_per_param, make in impls:
        rows.append({"name": name, "kind": kind, "bytes_per_param": bytes_per_param, "params": params})
        if make is not None:
            steps[name] = make(params)[0]
            steps[name]()  # warm-up: first touch of the state, JIT builds
    times = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
    steps.clear()
    gc.collect()
    for row, (name, _, _, make) in zip(rows, impls):
        if make is None:
            continue
        t = statistics.median(times[name])
        row.update(s_per_step=t, Gparams_per_s=params / t / 1e9, GBps=params * row["bytes_per_param"] / t / 1e9)
        row["max_abs_diff_vs_torch_20_steps"] = _max_diff_vs_torch(make)
        print(f"  {name}: {row['Gparams_per_s']:.3f} G params/s", flush=True)
    _add_ratios(rows)
    columns = [
        ("name", "implementation"),
        ("bytes_per_param", "B/param"),
        ("s_per_step", "s/step"),
        ("Gparams_per_s", "G params/s"),
        ("GBps", "GB/s"),
        ("vs_torch_fused", "x torch fused"),
        ("vs_deepspeed", "x DeepSpeed"),
        ("max_abs_diff_vs_torch_20_steps", "max diff vs torch (20 steps)"),
    ]
    note = (
        f"{params / 1e6:.0f}M fp32 parameters, {threads} threads; the implementations stepped in turn, "
        f"median of {iters} rounds; host copy bandwidth in the same run {copy_bw:.1f} GB/s (read + write)."
    )
    skipped = [r for r in rows if r["kind"] not in ("ours", "peer")]
    for r in skipped:
        note += f" {r['name']}: {r['kind']}."
    return {
        "params": params,
        "threads": threads,
        "iters": iters,
        "host_copy_GBps": copy_bw,
        "rows": rows,
        "markdown": markdown_table(columns, rows) + "\n\n" + note,
    }


def _add_ratios(rows: list[dict]) -> None:
    by_name = {r["name"]: r for r in rows}
    torch_fused = by_name["torch.optim.AdamW(fused=True), CPU"].get("Gparams_per_s")
    deepspeed = by_name["DeepSpeedCPUAdam (adamw_mode)"].get("Gparams_per_s")
    for r in rows:
        rate = r.get("Gparams_per_s")
        if rate and torch_fused:
            r["vs_torch_fused"] = rate / torch_fused
        if rate and deepspeed:
            r["vs_deepspeed"] = rate / deepspeed
