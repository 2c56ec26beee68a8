"""offload="auto": a model that fits on the device trains there with torch's fused AdamW.

After the adapter's first measured steps, stock training is costed: every weight, the
trainable ones' gradients, torch AdamW's two moments (in the parameter's dtype, as torch
keeps them), the activations measured per block, and what the device's peak showed the
head and the loss add after the stack. If that fits in the usable memory, the engine
unwraps itself (weights back on the device, hooks removed) and the optimizer the user
holds hands every call to a ``torch.optim.AdamW(fused=True)`` that shares its param
groups (LR schedulers keep working) and starts from the migrated state: the host fp32
moments and step counts. Explicit paging options keep the offload mode: the user asked
for it.
"""

from __future__ import annotations

import torch

GiB = 1 << 30


def _explicit_paging(opts) -> str | None:
    if opts.param_offload not in ("auto", False, 0.0, []):
        return f"param_offload={opts.param_offload!r} asks for paged weights"
    if opts.activation_offload not in ("auto", False, 0.0):
        return f"activation_offload={opts.activation_offload!r} asks for paged activations"
    return None


def _quantized(engine) -> str | None:
    n = sum(1 for u in engine.units for s in u.slots if s.quant is not None)
    return f"{n} frozen weights are quantized (stock training would need them dequantized)" if n else None


def stock_bytes(engine) -> dict:
    """Device bytes of stock training with torch AdamW, by class."""
    params = {s.param: s for u in engine.units for s in u.slots}
    trainable = [s for s in params.values() if s.trainable]
    return {
        "weights": sum(s.nbytes for s in params.values()),
        "gradients": sum(s.nbytes for s in trainable),
        "AdamW moments": 2 * sum(s.nbytes for s in trainable),
        "activations (measured)": sum(engine.activation_bytes.values()),  # as with the weights resident
        "loss and head (measured)": engine.adapter.planned_after_stack(),
    }


def maybe_switch(engine, observed_peak) -> bool:
    """Switch to stock training if it fits; log why not otherwise. True when switched."""
    adapter = engine.adapter
    reason = _explicit_paging(engine.opts) or _quantized(engine)
    if reason is None and not engine.activation_bytes:
        reason = "no training forward pass was measured"
    if reason is None:
        need = stock_bytes(engine)
        total = sum(need.values())
        detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in need.items())
        if total > adapter.usable:
            reason = (
                f"stock training would need {total / GiB:.2f} GiB ({detail}), {adapter.usable / GiB:.2f} GiB is usable"
            )
    if reason is not None:
        adapter.record("offload", f"offload='auto': staying in offload mode: {reason}")
        return False
    adapter.record(
        "switch",
        f"offload='auto': switching to torch.optim.AdamW(fused=True) on {engine.backend.device}: "
        f"stock training needs {total / GiB:.2f} GiB ({detail}) of {adapter.usable / GiB:.2f} GiB usable",
        need=need,
        usable=adapter.usable,
        observed=observed_peak,
    )
    switch_to_stock(engine)
    return True


def switch_to_stock(engine) -> None:
    from .state import unwrap

    opt = engine.optimizer
    unwrap(engine)  # waits for every update, weights back on the device, hooks removed
    for unit in engine.block_units:
        unit.act_paged = False
    groups = opt.param_groups
    stock = torch.optim.AdamW([{"params": g["params"]} for g in groups], lr=groups[0]["lr"], fused=True)
    for group in groups:  # the user's group dicts, completed with what torch AdamW reads
        for key, value in stock.defaults.items():
            group.setdefault(key, value)
        group["fused"], group["foreach"] = True, None
    stock.param_groups = groups
    for p, st in opt.state.items():
        if "exp_avg" not in st:
            continue
        stock.state[p] = {
            "step": torch.tensor(float(st["step"]), dtype=torch.float32, device=p.device),
            "exp_avg": st["exp_avg"].to(device=p.device, dtype=p.dtype),
            "exp_avg_sq": st["exp_avg_sq"].to(device=p.device, dtype=p.dtype),
        }
    opt.state = stock.state
    opt._mapped = {}  # the pinned moments the kernel read: free them with the old state
    engine.moments = None  # (and the regions they were views of)
    opt._stock = stock
    opt._stock_engine = engine
    engine.mode = "stock"
