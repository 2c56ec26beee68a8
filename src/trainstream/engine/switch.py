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

The mode is part of the optimizer's state_dict (MODE_KEY), so a run resumed from a state
saved after the switch switches as it loads, before its first step: it continues with the
optimizer the uninterrupted run had (see [Note: resuming in the saved mode]).
"""

from __future__ import annotations

# The optimizer state_dict's key for the mode it was saved in; torch's optimizers ignore it.
MODE_KEY = "trainstream_mode"
MODES = ("offload", "stock")  # the engine's update, or torch's fused AdamW after the switch


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


def why_not_stock(meter, block_units=()) -> str | None:
    """What the measurements lack for costing stock training (None: nothing). A block
    recomputed since the first pass never saved its activations, so they were not measured:
    costing stock training without them would count too little."""
    if not meter.activation_bytes:
        return "no training forward pass was measured"
    unmeasured = [u.block for u in block_units if u.block not in meter.activation_bytes]
    if unmeasured:
        return (
            f"the activations of blocks {unmeasured} were not measured (recomputed in backward from the first pass on)"
        )
    return None


def stock_bytes(units, meter, after_stack: int, averaging: int = 0) -> dict:
    """Device bytes of stock training with torch AdamW, by class. `averaging`: what data
    parallel's gradient buckets hold on the device at the end of backward (0: none there)."""
    params = {s.param: s for u in units for s in u.slots}
    trainable = [s for s in params.values() if s.trainable]
    need = {
        "weights": sum(s.nbytes for s in params.values()),
        "gradients": sum(s.nbytes for s in trainable),
        "AdamW moments": 2 * sum(s.nbytes for s in trainable),
        "activations (measured)": sum(meter.activation_bytes.values()),  # as with the weights resident
        "loss and head (measured)": after_stack,
    }
    if averaging:
        need["gradient buckets (data parallel)"] = averaging
    return need


# [Note: resuming in the saved mode]
# offload="auto" switches to torch's fused AdamW after its measured steps, and the two
# optimizers round differently; a resumed run that measured its own steps again would take
# host updates where the uninterrupted run took fused ones. A state_dict saved after the
# switch therefore switches the run loading it first, and its state then loads into the
# fused AdamW. Only where the switch could have happened: options that rule it out keep the
# engine, and the events say why.
def saved_mode(state_dict) -> str | None:
    """The mode an optimizer state_dict was saved in; None for one without it (torch's own,
    or saved before the mode was recorded). A value that is not a mode is a ValueError."""
    if not isinstance(state_dict, dict):
        return None  # not a state dict: the load's own checks name what is wrong
    saved = state_dict.get(MODE_KEY)
    if saved is not None and saved not in MODES:
        raise ValueError(f"trainstream: the optimizer state_dict's {MODE_KEY!r} is {saved!r}; accepted: {MODES}")
    return saved


def why_not_resume_in_stock(opts, units) -> str | None:
    """Why a run loading a state saved after the switch keeps the engine (None: it switches)."""
    if opts.offload != "auto":
        return f"offload={opts.offload!r} keeps the engine"
    return explicit_paging(opts) or quantized(units)
