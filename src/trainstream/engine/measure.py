"""Saved-activation bytes per block, counted over the first training forward passes.

The planner sizes activation paging from these counts. They are taken as the block saves
its tensors for backward (the saved-tensor pack hook), once per storage, with the block's
weights as placed: under bf16 autocast a resident block's count includes autocast's copies
of its trainable weights (`activation_cast`), which a paged block does not make, so a
paged block's count adds the copies it would have made (cast_bytes) and either placement
is comparable. A block recomputed in backward saves nothing of its own in forward (the
checkpoint's hooks take the place of ours): its count is what an earlier pass measured, and
what it keeps is its inputs, counted for every block (`activation_inputs`).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_VIEWS = {
    "TBackward0",
    "TransposeBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "AliasBackward0",
}


def is_weight_copy(t: torch.Tensor, unit) -> bool:
    """Is `t` (a view of) autocast's copy of one of `unit`'s trainable weights? Its autograd
    history is then views, one ToCopyBackward0, and the weight's AccumulateGrad."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        name = type(fn).__name__
        if name not in _VIEWS and name != "ToCopyBackward0":
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        if name == "ToCopyBackward0":
            leaf = nxt[0]
            return type(leaf).__name__ == "AccumulateGrad" and any(leaf.variable is s.param for s in unit.slots)
        fn = nxt[0]
    return False


def weight_copy_bytes(slots) -> int:
    """Bytes of bf16 copies of the fp32 weight matrices among `slots` (what autocast makes
    of resident weights; biases and norms are not kept by backward, so not counted)."""
    return sum(s.param.numel() * 2 for s in slots if s.dtype == torch.float32 and s.param.dim() >= 2)


def cast_bytes(unit) -> int:
    """The copies autocast would make of `unit`'s weights had they been resident, as this
    pass fetched them in bf16; an upper bound of what backward keeps (a Linear whose input
    needs no gradient keeps no copy of its weight). A quantized weight is dequantized for
    each use, resident or not, so it never counts."""
    return weight_copy_bytes(
        [s for s in unit.slots if unit.fetch_dtypes.get(s) == torch.bfloat16 and s.quant_format is None]
    )


def activations_as_placed(meter, unit, paged: bool) -> int:
    """`unit`'s measured saved-activation bytes (0 if not measured) with its weights paged
    or resident: paged, without autocast's copies of them."""
    measured = meter.activation_bytes.get(unit.block, 0)
    return measured - meter.activation_cast.get(unit.block, 0) if paged else measured


class ActivationMeter:
    MEASURED_PASSES = 2

    def __init__(self, resident_storages: set):
        self.resident_storages = resident_storages  # device storages of resident weights: not activations
        self.activation_bytes: dict = {}  # block -> largest count of the measured passes
        self.activation_cast: dict = {}  # block -> of that, autocast's copies of its weights
        self.activation_inputs: dict = {}  # block -> bytes of its input tensors on the device (largest)
        self._passes = 0
        self.measuring = False  # this forward pass counts activations
        self._counting: dict | None = None  # storage pointer -> (weak ref, bytes), in the block running now
        self._counted = 0
        self._counted_cast = 0

    def new_pass(self) -> None:
        """A forward pass starts outside backward."""
        self.measuring = torch.is_grad_enabled() and self._passes < self.MEASURED_PASSES
        if self.measuring:
            self._passes += 1

    def start(self) -> bool:
        """Count the block about to run? Only in a measured pass, and never under someone
        else's saved-tensor hooks (a checkpoint's), which ours would override."""
        if (
            not self.measuring
            or not torch.is_grad_enabled()
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        ):
            return False
        self._counting = {}
        self._counted = 0
        self._counted_cast = 0
        return True

    def count_inputs(self, unit, tensors, device) -> None:
        """The tensors a block's forward is called with, in a measured pass: what a checkpoint
        around the block keeps until its backward (each storage once, weights not counted)."""
        if not self.measuring:
            return
        seen, total = set(), 0
        for t in tensors:
            if t.device != device:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or ptr in self.resident_storages:
                continue
            seen.add(ptr)
            total += storage.nbytes()
        if total > self.activation_inputs.get(unit.block, -1):
            self.activation_inputs[unit.block] = total

    def count(self, t: torch.Tensor, unit) -> None:
        """A tensor the running block saves (not a weight the engine fetched)."""
        if self._counting is None:
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.resident_storages:
            return
        seen = self._counting.get(ptr)
        if seen is None or seen[0].expired():  # a paged storage's address may be reused in the block
            self._counting[ptr] = (StorageWeakRef(storage), storage.nbytes())
            self._counted += storage.nbytes()
            if is_weight_copy(t, unit):
                self._counted_cast += storage.nbytes()

    def stop(self, unit, counted: bool) -> None:
        if not counted:
            return
        total, cast = self._counted, self._counted_cast
        if unit.paged:
            # Its weights came in bf16: autocast made no copies, which resident it would.
            cast = cast_bytes(unit)
            total += cast
        if total >= self.activation_bytes.get(unit.block, 0):
            self.activation_bytes[unit.block] = total
            self.activation_cast[unit.block] = cast
        self._counting = None
