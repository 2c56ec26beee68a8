"""The non-finite check decided on the device (optimizer_mode="gpu", gradients left on the
device): see [Note: non-finite gradients] in grads.py.

One int32 flag on the device per accumulation window. Before each unit's update, on the
update stream, ops.mark_nonfinite_ reads the unit's gradients and sets the flag (and the
unit's marks, one int32 per gradient in a host buffer allocated at wrap()) when a value is
not finite; the unit's AdamW kernels, queued right after it, read the flag and write nothing
when it is set. The flag is never cleared within the window, so once one unit's gradient
is not finite, that unit and every unit queued after it in the window are skipped, with no
host read in between.

The host learns the outcome later, from the marks, once the unit's update has run: each
queued update is a Pending record, settled (oldest first, the order the stream ran them in)
where the host can see it has run, or where it must wait for it anyway.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .. import ops


@dataclass
class Pending:
    """A unit's update queued behind the check, not yet settled."""

    unit: object
    slots: list  # the slots the update counted a step for (in unit.trainable order)
    handle: object  # its DeviceUpdate: the marks are readable once handle.event has passed
    window: int  # the window serial the update was queued in
    undo: object  # called if the update was skipped: takes back what the host advanced for it


@dataclass(frozen=True)
class Settled:
    """A settled update: `skipped` (the window's flag was set when its kernels ran) and
    `first`, the first slot of the window found not finite when this update is where it
    was found (None otherwise)."""

    pending: Pending
    skipped: bool
    first: object


class DeviceCheck:
    """Owns the window flag, each unit's marks, and the updates queued behind the check."""

    # The check's grid, uncapped (0): the unit's AdamW kernels wait behind it on the update
    # stream, and the last units' updates (after backward) are on the step's critical path, so
    # it must read the gradients at the speed of the whole GPU. Capped at 16 blocks, it made the
    # engine suite's MLP step 3.9% slower on the H200; uncapped, 0.2% (the nonfinite suite).
    MAX_BLOCKS = 0

    def __init__(self, backend, units: list):
        self.backend = backend
        trainable = [u for u in units if u.trainable]
        marks = backend.host_empty((sum(len(u.trainable) for u in trainable),), torch.int32)
        self._marks, offset = {}, 0
        for u in trainable:  # a view per unit, one value per trainable slot in unit.trainable order
            self._marks[u] = marks[offset : offset + len(u.trainable)]
            offset += len(u.trainable)
        self._order: dict = {}  # unit -> the slots its marks stand for, in order (check)
        self._given: dict = {}  # unit -> the slots as check() was given them: the first found is named in it
        self.flag = torch.zeros((), dtype=torch.int32, device=backend.device)
        self._dirty = False  # a check was queued since the flag was last cleared
        self._pending: deque = deque()
        self._bad_window = None  # the serial of the last window settled with a gradient not finite

    def check(self, unit, slots: list, grads: list) -> torch.Tensor:
        """On the current stream (the update's), before `unit`'s kernels: mark the gradients
        of `slots` (`grads`, on the device) that are not finite and set the flag. Returns the
        flag, for the kernels' skip_flag. The first of `slots` found is the one named (the
        caller gives them in the order their gradients came, as the host check names them). The unit's earlier update must be settled (its
        marks read): they are cleared here, on the host."""
        if any(p.unit is unit for p in self._pending):
            raise RuntimeError(f"trainstream internal: {unit.name}'s last update was not settled before its next")
        marks = self._marks[unit]
        marks.zero_()
        by_dtype: dict = {}  # one launch per gradient dtype, each marking a run of the unit's marks
        for s, g in zip(slots, grads):
            by_dtype.setdefault(g.dtype, []).append((s, g))
        order, offset = [], 0
        for items in by_dtype.values():
            found = marks[offset : offset + len(items)]
            ops.mark_nonfinite_([g for _, g in items], found, self.flag, max_blocks=self.MAX_BLOCKS)
            order += [s for s, _ in items]
            offset += len(items)
        self._order[unit] = order  # which slot each mark is, until the update is settled
        self._given[unit] = list(slots)
        self._dirty = True
        return self.flag

    def queued(self, pending: Pending) -> None:
        self._pending.append(pending)

    def new_window(self) -> None:
        """A new window: clear the flag on the update stream, behind every kernel of the last."""
        if self._dirty:
            with self.backend.on(self.backend.update):
                self.flag.zero_()
            self._dirty = False

    def pending(self) -> list:
        """The updates not settled yet, oldest first."""
        return list(self._pending)

    def has_pending(self, window: int) -> bool:
        return any(p.window == window for p in self._pending)

    def settle(self, wait: bool = False, unit=None) -> list:
        """Settle, oldest first, the updates whose kernels have run: all of them if `wait`
        (waiting for the last), else those the stream is already past; with `unit`, at least
        up to that unit's (waiting for it). Returns a Settled per update settled."""
        last = None
        if wait:
            last = self._pending[-1] if self._pending else None
        elif unit is not None:
            last = next((p for p in reversed(self._pending) if p.unit is unit), None)
        if last is not None:
            last.handle.wait_read()  # the kernels' end: every earlier one on the stream has run too
        out = []
        while self._pending and (last is not None or self._pending[0].handle.event.query()):
            p = self._pending.popleft()
            out.append(self._outcome(p))
            if p is last:
                last = None
        return out

    def _outcome(self, p: Pending) -> Settled:
        marks = self._marks[p.unit].tolist()
        bad = {s for s, m in zip(self._order.pop(p.unit), marks) if m}
        first = next((s for s in self._given.pop(p.unit) if s in bad), None)  # the first in check()'s order
        if self._bad_window == p.window:  # an earlier unit of its window set the flag
            return Settled(p, True, None)
        if first is not None:
            self._bad_window = p.window
            return Settled(p, True, first)
        return Settled(p, False, None)


def found_before_an_exception(slot, nonfinite: str) -> str:
    """The event of a gradient found not finite in a backward pass that then raised (an
    exception of the user's, an interrupt): that exception surfaces as itself, and the find
    is said here, alike on the host path and for device state. `nonfinite`: the option."""
    return (
        f"the gradient of {slot.name} is not finite (nonfinite={nonfinite!r}), found before the exception that "
        "stopped backward: that pass's gradients were dropped with it"
    )
