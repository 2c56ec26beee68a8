"""Suite `optimizer_gpu`: the zero-copy CUDA AdamW against the PCIe limit of the same run.

The kernel keeps the moments (and, optionally, the fp32 master weights) in pinned host
memory and reads and writes them over PCIe in one pass, so its ceiling is the pinned copy
bandwidth in both directions at once, measured here first. Bytes per parameter are those
that cross PCIe in each direction.
"""

from __future__ import annotations

import torch

from .. import ops
from .common import markdown_table, median_seconds

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def pcie_GBps(n_bytes: int) -> dict:
    """Pinned copy bandwidth: host->GPU, GPU->host, and both at once on two streams."""
    n = n_bytes // 4
    h = torch.empty(n, pin_memory=True).uniform_()
    h2 = torch.empty(n, pin_memory=True)
    d = torch.empty(n, device="cuda").uniform_()
    d2 = torch.empty(n, device="cuda")
    h2d = median_seconds(lambda: d2.copy_(h, non_blocking=True), iters=10, sync_cuda=True)
    d2h = median_seconds(lambda: h2.copy_(d, non_blocking=True), iters=10, sync_cuda=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s1):
            d2.copy_(h, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    bidir = median_seconds(both, iters=10, sync_cuda=True)
    return {"h2d": n * 4 / h2d / 1e9, "d2h": n * 4 / d2h / 1e9, "bidir_each_way": n * 4 / bidir / 1e9}


def _case(n, *, host_master, moment_dtype, param_dtype):
    master = torch.randn(n, pin_memory=True) if host_master else None
    param = master.to("cuda", param_dtype) if host_master else torch.randn(n, device="cuda")
    grad = torch.randn(n, device="cuda") * 1e-2
    m = torch.zeros(n, dtype=moment_dtype, pin_memory=True)
    v = torch.zeros(n, dtype=moment_dtype, pin_memory=True)
    step = [0]

    def run():
        step[0] += 1
        ops.adamw_step_gpu(
            [param], [grad], [m], [v], [step[0]], masters=[master] if host_master else None, seeds=[1], **HYPER
        )

    return run


def run(*, params: int, iters: int) -> dict:
    bw = pcie_GBps(min(params * 4, 1 << 30))
    each_way = bw["bidir_each_way"]
    rows = []
    cases = [
        ("fp32 GPU weights are the master; fp32 moments in host RAM", False, torch.float32, torch.float32, 8),
        ("fp32 GPU weights are the master; bf16 moments in host RAM", False, torch.bfloat16, torch.float32, 4),
        ("fp32 master + fp32 moments in host RAM; bf16 GPU weights", True, torch.float32, torch.bfloat16, 12),
        ("fp32 master + bf16 moments in host RAM; bf16 GPU weights", True, torch.bfloat16, torch.bfloat16, 8),
    ]
    for name, host_master, moment_dtype, param_dtype, bytes_each_way in cases:
        step = _case(params, host_master=host_master, moment_dtype=moment_dtype, param_dtype=param_dtype)
        t = median_seconds(step, iters=iters, sync_cuda=True)
        bound = each_way * 1e9 / bytes_each_way
        rows.append(
            {
                "name": name,
                "bytes_each_way": bytes_each_way,
                "s_per_step": t,
                "Gparams_per_s": params / t / 1e9,
                "pcie_bound_Gparams_per_s": bound / 1e9,
                "fraction_of_pcie_bound": params / t / bound,
            }
        )
        print(f"  {name}: {params / t / 1e9:.2f} G params/s ({params / t / bound:.0%} of PCIe bound)", flush=True)
        del step
        torch.cuda.empty_cache()
    p = torch.nn.Parameter(torch.randn(params, device="cuda"))
    p.grad = torch.randn(params, device="cuda") * 1e-2
    fused = torch.optim.AdamW([p], fused=True, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])
    t = median_seconds(fused.step, iters=iters, sync_cuda=True)
    rows.append(
        {
            "name": "torch.optim.AdamW(fused=True), all state in VRAM (no PCIe)",
            "bytes_each_way": 0,
            "s_per_step": t,
            "Gparams_per_s": params / t / 1e9,
        }
    )
    del p, fused
    torch.cuda.empty_cache()
    columns = [
        ("name", "configuration"),
        ("bytes_each_way", "B/param each way"),
        ("s_per_step", "s/step"),
        ("Gparams_per_s", "G params/s"),
        ("pcie_bound_Gparams_per_s", "PCIe bound"),
        ("fraction_of_pcie_bound", "of bound"),
    ]
    note = (
        f"{params / 1e6:.0f}M parameters, median of {iters} steps. Pinned copies in the same run: "
        f"host->GPU {bw['h2d']:.1f} GB/s, GPU->host {bw['d2h']:.1f} GB/s, both at once "
        f"{each_way:.1f} GB/s each way (the bound uses this)."
    )
    return {
        "params": params,
        "iters": iters,
        "pcie": bw,
        "rows": rows,
        "markdown": markdown_table(columns, rows) + "\n\n" + note,
    }
