"""quantize_model(): the frozen weights of a model's block stack stored as codes, in place,
before wrap(). The weights chosen are those wrap(quantize=...) would choose itself
(engine.layout.quantizable_slots), so the two never disagree about what may be quantized."""

from __future__ import annotations

import torch

from . import stored
from .weight import FORMATS, QuantizedWeight


def check_format(quantize, caller: str) -> str:
    if not isinstance(quantize, str) or quantize not in FORMATS:
        raise ValueError(f"{caller}: quantize must be one of {list(FORMATS)}, got {quantize!r}")
    return quantize


def check_block_size(block_size, caller: str, name: str = "block_size") -> int:
    from ..options import MAX_QUANT_BLOCK_SIZE

    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or not 2 <= block_size <= MAX_QUANT_BLOCK_SIZE
        or block_size % 2
    ):
        raise ValueError(
            f"{caller}: {name} must be an even integer >= 2 and <= {MAX_QUANT_BLOCK_SIZE}, got {block_size!r}"
        )
    return block_size


def block_slots(model: torch.nn.Module, blocks=None) -> tuple[list, object]:
    """The slots wrap() would store quantized in `model` (frozen weight tensors of its block
    stack: found as wrap() finds it, or the `blocks` named), and the stack."""
    from ..engine.blocks import find_blocks, named_stack
    from ..engine.layout import build_units, quantizable_slots

    stack = named_stack(model, list(blocks)) if blocks is not None else find_blocks(model)
    trainable = {p for p in model.parameters() if p.requires_grad}
    block_units, _, unpageable = build_units(model, stack.blocks, trainable)
    for u in block_units:  # those holding codes already are left to them
        for s in u.slots:
            if stored.codes_of(s.param) is not None:
                s.quant_format = "held"
    slots, _ = quantizable_slots(block_units, stack.blocks, unpageable)
    return slots, stack


def quantize_model(model, quantize="nf4", *, blocks=None, block_size=64, pin_budget=None) -> dict:
    """Store the frozen (``requires_grad=False``) weight tensors of `model`'s block stack as
    `quantize` codes ("nf4" or "int8", `block_size` values per fp32 scale), in place: each
    parameter keeps its identity, shape and dtype, its values become codes. The weights are
    those ``wrap(quantize=...)`` would choose (nn.Linear, GPT-2's Conv1D, fused MoE expert
    tensors; not biases, norms, embeddings or anything trainable); weights already holding
    codes are left as they are. ``wrap()`` then streams these codes as they are, whatever
    its own `quantize` option (there are no values left to quantize otherwise).

    The codes stay on the device of each weight (CPU or CUDA). Until ``wrap()``, the model
    still computes and its ``state_dict()`` holds the dequantized values; assigning to a
    quantized weight fails loudly.

    `blocks`: the block stack (a list of modules), found automatically when None; pass the
    same list to ``wrap(blocks=...)``. `pin_budget`: only None is accepted: in this engine
    ``wrap()`` decides where codes live (on the device for resident blocks, in its pinned
    host arena for paged ones, checked against the pinned-memory limit then), so a budget here
    would bound nothing.

    Returns ``{"tensors": n, "bytes_before": b, "bytes_after": a}``: the weights quantized by
    this call and their bytes before (in their dtype) and after (codes plus scales).
    """
    caller = "quantize_model()"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}")
    fmt = check_format(quantize, caller)
    block_size = check_block_size(block_size, caller)
    if pin_budget is not None:
        raise ValueError(
            f"{caller}: pin_budget accepts only None, got {pin_budget!r}: wrap() places the codes (pinned host "
            "memory for paged blocks, checked against the pinned-memory limit there)"
        )
    if blocks is not None and (
        not isinstance(blocks, (list, tuple)) or not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks)
    ):
        raise ValueError(f"{caller}: blocks must be None or a non-empty list of modules of the model")
    if getattr(model, "_trainstream_engine", None) is not None:
        raise ValueError(f"{caller}: the model is wrapped; quantize it before wrap() (or unwrap() it first)")
    for name, module in model.named_modules():
        lost = stored.lost_codes(module)
        if lost:  # its data is the NaN placeholder: quantizing it would store NaN codes
            raise ValueError(
                f"{caller}: {name + '.' if name else ''}{lost[0]} was stored quantized and this copy of the model "
                "lost its codes (copy.deepcopy does not carry them): copy the model before quantizing it"
            )
    slots, stack = block_slots(model, blocks)
    if not stack.blocks:
        raise ValueError(f"{caller}: {stack.describe()}")
    before = after = 0
    for s in slots:
        owner_name, _, name = s.name.rpartition(".")
        owner = model.get_submodule(owner_name)
        with torch.no_grad():
            q = QuantizedWeight.quantize(s.param.data, fmt, block_size)
        before += s.full_nbytes
        after += q.nbytes
        stored.store(owner, name, q, block=stack.blocks[s.unit.block])
    return {"tensors": len(slots), "bytes_before": before, "bytes_after": after}
