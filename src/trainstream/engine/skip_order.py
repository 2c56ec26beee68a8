"""What a non-finite gradient skips when updates follow backward's order of units.

With eager updates the host path updates each unit as backward completes it, so a gradient
found not finite skips its own unit and every unit after it in that order; the units before
it stand (docs/semantics.md). The device state updates all of its units in one launch per
kernel, so the decision is made per slot, on the device, from one mark per slot: a slot is
skipped when any slot of its own unit or of an earlier one was found. Laid out one unit after
another in the update's order, that is the running count of marks, read at the last slot of
each slot's unit. Nothing here reads the marks back: the result feeds the kernels' per-tensor
skip (ops.adamw MappedAdamW's `tensor_skip`) on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def unit_ends(sizes: Sequence[int]) -> list[int]:
    """For slots laid out unit after unit (`sizes[k]` slots of unit k, in the update's
    order), the index of the last slot of each slot's unit."""
    out: list[int] = []
    end = -1
    for size in sizes:
        if size < 1:
            raise ValueError(f"unit_ends: every unit has at least one slot, got sizes {list(sizes)}")
        end += size
        out += [end] * size
    return out


def skipped(found: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """int32, one value per entry of `ends`: non-zero where the unit of slot ``ends[j]`` (the
    last slot of a unit, as unit_ends gives it) or a unit before it holds a slot whose mark in
    `found` is non-zero. `found`: int32, one mark (0 or 1) per slot in the update's order;
    `ends`: int64 indices into it, on its device. Two kernels on a GPU, no host sync."""
    return torch.cumsum(found, 0, dtype=torch.int32).index_select(0, ends)


def first_found(marks: Sequence[int], order: Sequence[int] | None = None) -> int | None:
    """The update-order index of the first slot marked, or None: `marks` read back on the
    host, ``marks[j]`` the mark of slot ``order[j]`` (None: of slot j)."""
    if order is None:
        return next((i for i, m in enumerate(marks) if m), None)
    return min((order[j] for j, m in enumerate(marks) if m), default=None)
