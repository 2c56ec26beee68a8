"""offload="auto": a model that fits on the device trains there with torch's fused AdamW.

After the adapter's first measured steps, stock training is costed: every weight, the
trainable ones' gradients, torch AdamW's two moments (in the parameter's dtype, as torch
keeps them), the activations measured per block, and what the device's peak showed the
head and the loss add after the stack. If that fits in the usable memory, the adapter
decides the switch and the engine carries it out at the end of step(): it unwraps itself
(weights back on the device, hooks removed) and the optimizer the user holds hands every
call to a ``torch.optim.AdamW(fused=True)`` that shares its param groups (LR schedulers
keep working) and starts from the migrated state. Explicit paging options keep the offload
mode: the user asked for it.
"""

from __future__ import annotations


def explicit_paging(opts) -> str | None:
    """Why the options rule out stock training (None: they do not)."""
    if opts.param_offload not in ("auto", False, 0.0, []):
        return f"param_offload={opts.param_offload!r} asks for paged weights"
    if opts.activation_offload not in ("auto", False, 0.0):
        return f"activation_offload={opts.activation_offload!r} asks for paged activations"
    return None


def quantized(units) -> str | None:
    n = sum(1 for u in units for s in u.slots if s.quant_format is not None)
    return f"{n} frozen weights are quantized (stock training would need them dequantized)" if n else None


def why_not_stock(meter) -> str | None:
    """What the measurements lack for costing stock training (None: nothing)."""
    return None if meter.activation_bytes else "no training forward pass was measured"


def stock_bytes(units, meter, after_stack: int) -> dict:
    """Device bytes of stock training with torch AdamW, by class."""
    params = {s.param: s for u in units for s in u.slots}
    trainable = [s for s in params.values() if s.trainable]
    return {
        "weights": sum(s.nbytes for s in params.values()),
        "gradients": sum(s.nbytes for s in trainable),
        "AdamW moments": 2 * sum(s.nbytes for s in trainable),
        "activations (measured)": sum(meter.activation_bytes.values()),  # as with the weights resident
        "loss and head (measured)": after_stack,
    }
