"""Gradients to pinned host memory during backward, and each unit's hand-off to the optimizer.

As autograd finishes a parameter's gradient (post-accumulate-grad hook), it is copied to a
pinned host buffer on the D2H stream and the device copy is dropped, so the full set of
gradients never exists in VRAM. When every trainable parameter of a unit has landed and
the copies are done, the unit is handed on: on the last backward pass of an accumulation
window its host AdamW update is queued at once, while backward goes on; on earlier passes
the gradient is added to a host fp32 sum. With optimizer_mode="gpu" and neither clipping nor
accumulation, a gradient is not copied: it stays on the device until its unit's update,
queued on the device as soon as the unit is complete, has read it.

Gradients smaller than SMALL_GRAD_BYTES (a LoRA adapter's, a norm's) wait on the device
until their unit's last gradient arrives and leave with it, in one batch: each copy costs
the autograd thread a few stream operations in Python, which for hundreds of small tensors
took more of a step than the GPU's work. A unit that never completes (an unused parameter)
sends what waits at the end of the pass.

Nothing here blocks the autograd thread on a copy: finished copies are noticed by polling
their events at each hook, and whatever is still in flight when backward ends is waited
for in the end-of-backward callback.

[Note: non-finite gradients] (wrap(nonfinite=...)). Where the gradients go to host memory,
each batch gets its squared norms taken on the device, on the copy-out stream behind the
copies, and sent to host memory with them (`unit.checks`: views of a buffer per unit
allocated at wrap(), whose reuse waits for its reader as a landing buffer's does). They are
read where the unit is handed on, which already waits for that copy, so the check costs one
reduction per batch and no host sync. A value that is not finite is confirmed on the
gradient itself (a finite gradient's square can overflow), and then:
- updates held for the end of the window (clipping, accumulation): the window is marked
  and at its end every unit's gradients are dropped (GradWindow.SKIPPED), nothing updated;
  with clipping the global norm at step() is the check, and nothing else runs;
- updates queued as units land: that unit and every unit handed on after it in the pass
  are SKIPPED; those queued before it stand.
Where the gradients stay on the device (optimizer_mode="gpu", neither clipping nor
accumulation), the device decides, in stream order, and no host read comes before an update
(nonfinite.py): a unit is handed on as soon as its gradients are there, and on the update
stream, right before its AdamW kernels, ops.mark_nonfinite_ reads its gradients (values, not
squares) and sets the window's device flag, which those kernels and every later one of the
window read and then write nothing. So the same units are skipped as above, and the kernels
overlap backward (a host read of each unit's check would hold every update until backward's
GPU work had reached it, and the gradients would pile up against max_inflight_bytes). The
host learns which were skipped from each unit's marks once its update has run, oldest first
(settle_device_checks): where it sees that it has (each report point), before the unit's
next update (whose step count depends on it), and waiting, at synchronize() (state_dict())
and when optimizer.skipped_steps or memory_report() is read. A skipped update's step counts
are then taken back; a skip within the window marks its unit SKIPPED; each window is
reported once all of its updates are settled, with the step it belongs to.
A SKIPPED unit's landing buffers and sums are rewritten by the next window's first pass,
as after zero_grad(); its weights, moments and step count are untouched. "raise" skips as
"skip" does, reports nothing, and raises FloatingPointError at the end of backward (the pass
is then dropped, as any pass that raises), not in the hook that found it: an exception of the
user's later in that backward surfaces as itself, and the find goes into the events
(raised_pass). With the check on the device it waits for the pass's updates first (the unit
found and those after it were skipped on the device). A skipped window of several passes is
named by its sums, in its last pass's order (skip_window), as device state names it.
"ignore" checks nothing.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from .. import ops
from ..sizes import MiB
from .device import DONE, DeviceUpdate
from .layout import GradWindow
from .nonfinite import DeviceCheck, Pending, found_before_an_exception


def _view_as(region: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The landing buffer for `g` inside the slot's reserved room (sized for the param's
    dtype; a gradient is never wider than its param)."""
    flat = region.view(-1).view(torch.uint8)
    n = g.numel() * g.dtype.itemsize
    if n > flat.numel():
        raise RuntimeError(f"trainstream: a {g.dtype} gradient does not fit its parameter's landing buffer")
    return flat[:n].view(g.dtype).view(g.shape)


@dataclass(frozen=True)
class GradSettings:
    """What the streamer reads of the run's options."""

    accumulation_steps: int
    clip: bool  # max_grad_norm is set: every update waits for step() and the global norm
    on_device: bool  # gradients stay where autograd made them, for the device update
    threads: int | None  # host threads for the accumulation sums
    nonfinite: str = "skip"  # a gradient that is not finite: "skip", "raise" or "ignore" (see the note)


class GradStreamer:
    """Owns each gradient's way from autograd to the update. Its methods answer with the
    units whose update may be queued now; queuing them is the caller's."""

    SMALL_GRAD_BYTES = MiB

    def __init__(self, backend, units: list, update_order: list, ledger, settings: GradSettings, events):
        self.backend = backend
        self.units = units
        self.update_order = update_order  # the order the next forward needs the units in
        self.ledger = ledger
        self.settings = settings
        self.events = events
        self.clip_on_device = settings.clip and settings.accumulation_steps == 1
        # Updates wait for the end of the window (step() with clipping, the end of the last
        # backward pass with accumulation) rather than being queued as each unit lands.
        self.hold = settings.clip or settings.accumulation_steps > 1
        # The squared norms of every batch go to the host with it; with clipping the global
        # norm computed at step() is the check; with the gradients left on the device, the
        # check runs on the device before each update (see the note).
        checks = settings.nonfinite != "ignore"
        self.check_batches = checks and not settings.clip and not settings.on_device
        self.device_check = DeviceCheck(backend, units) if checks and settings.on_device else None
        self.nonfinite = None  # the window's first slot whose gradient was not finite
        self._skipped: list = []  # units SKIPPED on the host and not yet reported (take_skipped)
        self._skipped_first = None  # the window's first slot not finite, when they were skipped
        self.window_serial = 0  # numbers the windows (reset_window); the device check's records carry it
        self._counted: set = set()  # serials of windows already counted in skipped_steps
        self._labels: dict = {}  # window serial -> the step label take_skipped was last given in it
        self._device_skips: dict = {}  # window serial -> (first slot, [units]) the device skipped, to report
        self.passes = 0  # backward passes in the current accumulation window
        self.in_backward = False
        self._ready = deque()  # units whose gradients have all been issued D2H, in order
        # Units with some gradients this pass (unused params exist), in the order their first
        # gradient landed: an insertion-ordered dict, not a set, because the end of the pass
        # hands them on in this order, and under nonfinite="skip" with eager updates which
        # units are skipped ("that unit and every unit handed on after it") depends on it.
        self._partial: dict = {}
        # The non-finite check's host buffers, allocated once here (not per batch: a pinned
        # allocation on the autograd thread can synchronize the device): per unit, one fp32
        # value per trainable slot (_squares_to_host).
        self._check_room: dict = self._carve_check_room() if self.check_batches else {}
        self._pass_id = 0  # numbers every backward pass (a slot's seen_pass)
        self._last_unit = None  # the unit the last gradient belonged to
        # With clipping the check comes at step() (the global norm), after every unit was
        # handed on, and a skipped window of several passes is named by its sums (skip_window):
        # the pass's order is recorded so that the first gradient not finite is found in it,
        # as a check at hand-on finds it (first_nonfinite_in_window). Per pass: units in the
        # order handed on, slots in the order their gradients came.
        # The check on the device (check_on_device) names a unit's gradients in that order too.
        hold = settings.clip or settings.accumulation_steps > 1
        self._records_order = (hold or settings.on_device) and settings.nonfinite != "ignore"
        self._handed: dict = {}
        self._arrived: dict = {}

    def _carve_check_room(self) -> dict:
        """One host transfer buffer (pinned on a GPU) for every unit's squared norms, carved
        into a view of len(unit.trainable) values per unit."""
        units = [u for u in self.units if u.trainable]
        room = self.backend.host_empty((sum(len(u.trainable) for u in units),), torch.float32)
        views, offset = {}, 0
        for u in units:
            views[u] = room[offset : offset + len(u.trainable)]
            offset += len(u.trainable)
        return views

    # -- during backward -------------------------------------------------------------------

    def begin_pass(self) -> None:
        n = self.settings.accumulation_steps
        if self.passes >= n:
            raise RuntimeError(
                f"trainstream: backward pass {self.passes + 1} since the last optimizer.step(), but "
                f"accumulation_steps={n}: call optimizer.step() after every {n} backward pass(es) "
                f"(or optimizer.zero_grad() to drop the gradients)"
            )
        self.passes += 1
        self._pass_id += 1
        self._last_unit = None
        self.in_backward = True
        if self._records_order:
            self._handed, self._arrived = {}, {}

    def on_grad(self, slot) -> list:
        """autograd finished `slot`'s gradient (in p.grad); a pass has begun. Returns the
        units handed on."""
        p = slot.param
        g = p.grad
        if g is None:
            return []
        if g.is_sparse:
            raise ValueError(f"trainstream: sparse gradients are not supported ({slot.name})")
        unit = slot.unit
        if slot.seen_pass == self._pass_id:
            # A second gradient in one pass: the parameter is used by several reentrant
            # checkpoint segments, each with its own backward. Summed while it waits on the device.
            waiting = next((w for w in unit.waiting if w[0] is slot), None)
            if waiting is None:
                raise RuntimeError(
                    f"trainstream: {slot.name} got a second gradient in one backward pass after the first had "
                    "left for host memory: a parameter used by several reentrant checkpoint segments (use "
                    "checkpoint(..., use_reentrant=False), or keep the parameter inside one segment), or a "
                    "backward() run again over a graph whose earlier backward raised (run the forward again)"
                )
            summed = waiting[1].add_(g)
            if self.clip_on_device:
                slot.norm = torch.linalg.vector_norm(summed if summed.dtype == torch.float32 else summed.float())
            p.grad = None
            return []
        slot.seen_pass = self._pass_id
        if self._records_order:
            self._arrived[slot] = len(self._arrived)
        nbytes = g.numel() * g.element_size()
        if self.settings.on_device:
            # The update reads the gradient where it is, as soon as the unit is complete; the
            # cap holds back a backward that outruns the updates.
            self.ledger.make_room(nbytes)
            slot.device_grad = g
            p.grad = None
            self._landed(slot, DONE)  # the check runs on the device, ahead of the update (check_on_device)
            return self.poll()
        if self.clip_on_device:
            # Norm of the gradient as an fp32 tensor, so a bf16 gradient (a paged block under
            # autocast) gives the same bits as the fp32 gradient of the unpaged run.
            slot.norm = torch.linalg.vector_norm(g if g.dtype == torch.float32 else g.float())
        p.grad = None
        ready = []
        previous, self._last_unit = self._last_unit, unit
        if previous is not None and previous is not unit and previous.waiting:
            ready += self._send(previous)  # backward has moved on: what it left waiting goes now
        unit.waiting.append((slot, g, self.backend.compute_stream()))
        if unit.landed + len(unit.waiting) == len(unit.trainable) or nbytes >= self.SMALL_GRAD_BYTES:
            ready += self._send(unit)
        elif self._ready and self._ready[0].grad_event.query():
            ready += self.poll()
        return ready

    def _send(self, unit) -> list:
        """Copy the unit's waiting gradients to their landing buffers, one batch on the D2H
        stream, and count them landed."""
        backend = self.backend
        batch, unit.waiting = unit.waiting, []
        nbytes = sum(g.numel() * g.element_size() for _, g, _ in batch)
        for slot, g, _ in batch:
            if slot.reader is not None:
                _wait_read(slot.reader)  # the last job reading this buffer (long finished, as a rule)
                slot.reader = None
            if slot.stage is None or slot.stage.dtype != g.dtype:
                slot.stage = _view_as(slot.stage_region, g)
        self.ledger.make_room(nbytes)
        backend.follow(backend.copy_out, [stream for *_, stream in batch])  # each gradient's producer
        with backend.on(backend.copy_out):
            for slot, g, _ in batch:
                slot.stage.copy_(g, non_blocking=True)
                backend.keep_until(g, backend.copy_out)
            if self.check_batches:
                unit.checks += self._squares_to_host(unit, [slot for slot, *_ in batch], [g for _, g, _ in batch])
        event = backend.record(backend.copy_out)
        self.ledger.add(event, nbytes)  # the device gradients are freed once copied
        for slot, *_ in batch:
            self._landed(slot, event)
        # The copies are queued: the device gradients go. The list they waited in is emptied,
        # not only let go of, so that their memory never depends on what else still holds
        # that list (a shallow copy of the unit kept alive by a reference cycle held every
        # unit's first batch until the cyclic GC ran: up to the whole model's gradients).
        batch.clear()
        return self.poll()

    def _squares_to_host(self, unit, slots: list, grads: list) -> list:
        """The squared norm of each of `grads` (fp32), taken on the current stream and copied
        into `unit`'s check buffer behind it: readable once that stream's next event has
        passed. Returns (host view, slots) per kernel launch (one per gradient dtype).

        The buffer is reused every pass, so a write must never overtake the read of the values
        before it (the rule of the gradient landing buffers, whose reuse waits for their
        reader). Its reader is the host, in _first_nonfinite at the unit's hand-on, which waits
        for the copy and is done when it returns; a pass gives each slot at most one value
        (seen_pass), written after the values already in `unit.checks`, and `unit.checks` is
        emptied only when they have been read or dropped (hand-on, skip, a dropped pass). The
        next pass's copies are queued after this pass's hand-on, and a dropped pass's copies
        still in flight are on the same stream as the next ones, so they land first."""
        room = self._check_room[unit]
        offset = sum(len(covered) for _, covered in unit.checks)
        if offset + len(slots) > room.numel():
            raise RuntimeError(f"trainstream internal: more gradients of {unit.name} in one pass than it has")
        groups: dict = {}
        for s, g in zip(slots, grads):
            key = g.dtype if g.is_contiguous() and g.dtype in _SQ_NORM_DTYPES else None
            groups.setdefault(key, []).append((s, g))
        out = []
        for key, items in groups.items():
            gs = [g for _, g in items]
            if key is None:  # a strided gradient: torch's norm answers the same question
                sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in gs])
            else:
                sq = ops.grad_sq_norms(gs)
            host = room[offset : offset + len(gs)]
            offset += len(gs)
            host.copy_(sq, non_blocking=True)
            out.append((host, [s for s, _ in items]))
        return out

    # -- the check on the device (optimizer_mode="gpu", gradients left there; nonfinite.py) --------

    def check_on_device(self, unit, slots: list):
        """Called by the updater on the update stream, before `unit`'s kernels: the device
        flag those kernels skip on (None when the device does not check). The unit's last
        update is settled first, so that what the host advanced for it is right before the
        next is counted; its kernels ran before this unit's forward did, so the wait is, as a
        rule, for work long done."""
        if self.device_check is None:
            return None
        self.settle_device_checks(unit=unit)
        if self._arrived:  # the order the unit's gradients came in names the first found (nonfinite.py)
            arrived, n = self._arrived, len(self._arrived)
            slots = sorted(slots, key=lambda s: arrived.get(s, n))
        return self.device_check.check(unit, slots, [s.device_grad for s in slots])

    def checked_on_device(self, unit, slots: list, handle, undo) -> None:
        """`unit`'s update of `slots` was queued behind the check (`handle`: its DeviceUpdate);
        `undo()` takes back what the host advanced for it, should the device have skipped it."""
        self.device_check.queued(Pending(unit, slots, handle, self.window_serial, undo))

    def settle_device_checks(self, wait: bool = False, unit=None) -> None:
        """Learn which updates the device skipped, oldest first: those whose kernels have
        run, all (`wait`), or at least up to `unit`'s. A skipped update is taken back
        (`undo`); a skip of the current window marks its unit SKIPPED and sets the window's
        first non-finite slot; each window's skipped units are reported once all of its
        updates are settled (take_skipped)."""
        if self.device_check is None:
            return
        for done in self.device_check.settle(wait=wait, unit=unit):
            if not done.skipped:
                continue
            p = done.pending
            p.undo()
            current = p.window == self.window_serial
            if current:  # as _skip: its gradients are dropped, and nothing hands it on again
                p.unit.window = GradWindow.SKIPPED
                for s in p.unit.trainable:
                    s.has_grad = False
                if self.nonfinite is None:
                    self.nonfinite = done.first
            if self.settings.nonfinite == "raise":
                # end_pass raises for the current window; an earlier one was a pass that raised
                # (and was dropped) before its end could.
                if not current:
                    self.events.add(
                        f"the update of {p.unit.name}, queued by a backward pass that raised, was skipped on the "
                        "device (a gradient not finite)"
                    )
                continue
            self._device_skips.setdefault(p.window, (done.first, []))[1].append(p.unit)

    def _first_nonfinite(self, unit):
        """The first of `unit`'s freshly landed slots whose gradient is not finite, or None.
        The squared norms say where to look; the gradient itself decides (a huge finite value
        overflows its square). A slot no check covered is looked at directly."""
        covered = set()
        for host, slots in unit.checks:
            covered.update(slots)
            for value, s in zip(host.tolist(), slots):
                if not math.isfinite(value) and not _all_finite(self._this_pass(s)):
                    return s
        for s in unit.trainable:
            if s.fresh and s not in covered and not _all_finite(self._this_pass(s)):
                return s
        return None

    def _this_pass(self, s) -> torch.Tensor:
        """This pass's gradient of `s`, where it landed (before any sum)."""
        return s.device_grad if s.device_grad is not None else s.stage

    def _landed(self, slot, event) -> None:
        """`slot`'s gradient is on its way (`event`: its copy); the unit is ready for its
        update once all of its gradients are."""
        unit = slot.unit
        unit.grad_event = event
        unit.window = GradWindow.LANDING
        slot.fresh = True
        unit.landed += 1
        if unit.landed == len(unit.trainable):
            self._partial.pop(unit, None)
            self._ready.append(unit)
        else:
            self._partial[unit] = None

    def abandoned(self) -> bool:
        """A backward pass that raised never reached its end: one is open while no backward runs."""
        return self.in_backward and torch._C._current_graph_task_id() == -1

    def raised_pass(self) -> bool:
        """A backward pass that raised never reached its end: True (and the window's
        gradients dropped) when one is found open while no backward runs. Updates already
        queued stand."""
        if self.abandoned():
            self.events.add("a backward pass raised: its gradients were dropped" + self.describe_queued())
            if self.nonfinite is not None and (self.hold or self.settings.nonfinite == "raise"):
                # Not reported by a skip (eager "skip" reports the units it skipped): said here,
                # not lost with the pass.
                self.events.add(found_before_an_exception(self.nonfinite, self.settings.nonfinite))
            self.drop_pass()
            return True
        return False

    def describe_queued(self) -> str:
        """Which units' updates this window already queued (they stand), for the events."""
        queued = [u.name for u in self.units if u.window is GradWindow.QUEUED]
        if not self.hold and queued:
            return f"; updates queued before it stand, for {queued}; the other units are not updated"
        return "; no unit was updated from them"

    def drop_pass(self) -> None:
        """Forget the window's gradients, landed, waiting or in flight."""
        self._ready.clear()
        self._partial.clear()
        self.in_backward = False
        self._last_unit = None
        for unit in self.units:
            unit.landed = 0
            unit.waiting = []
            unit.checks = []
            for s in unit.trainable:
                s.fresh = False
                s.device_grad = None
        self.reset_window()

    def poll(self) -> list:
        """Hand on every unit whose gradient copies have finished (D2H is in order, so the
        queue's head finishes first)."""
        ready = []
        while self._ready and self._ready[0].grad_event.query():
            ready += self._hand_on(self._ready.popleft())
        return ready

    def end_pass(self):
        """End of a backward pass (autograd's final callback): wait for the copies still in
        flight and hand on every unit that got gradients, complete or not. Yields each unit
        as it is handed on, so that its update is queued before the next copy is waited for."""
        for unit in self.units:
            if unit.waiting:  # a unit with a parameter this pass did not reach
                yield from self._send(unit)
        for unit in [*self._ready, *self._partial]:
            unit.grad_event.synchronize()
            yield from self._hand_on(unit)
        if self.device_check is not None and self.settings.nonfinite == "raise":
            # Every update of the pass is queued by now (each unit was queued as it was
            # yielded): wait for them. The gradient found not finite's update and every later
            # one were skipped on the device, and are taken back.
            self.settle_device_checks(wait=True)
        self._raise_found()
        if self._window_complete():
            if self.nonfinite is not None:
                self.skip_window()
            else:  # every unit of a held window, and those that got gradients only in earlier passes
                yield from self.take_pending()

    def _raise_found(self) -> None:
        """nonfinite="raise": the pass is over (its end, or step()'s flush) and a gradient
        was found not finite in it: raise, naming the first (the caller drops the pass). The
        check does not raise where it finds one, in backward's hooks: an exception of the
        user's later in that backward surfaces as itself, and raised_pass reports the find."""
        if self.settings.nonfinite == "raise" and self.nonfinite is not None:
            raise FloatingPointError(
                f"trainstream: the gradient of {self.nonfinite.name} is not finite (wrap(nonfinite='raise')); "
                "this backward pass's gradients are dropped"
            )

    def take_pending(self) -> list:
        """Units with gradients in this window whose update has not been queued yet."""
        if self.nonfinite is not None and self.hold:
            return []  # the window is skipped whole (skip_window)
        return [
            u for u in self.update_order if u.window is not GradWindow.QUEUED and any(s.has_grad for s in u.trainable)
        ]

    def skip_window(self, first=None) -> None:
        """Drop every gradient of the window not yet handed to the optimizer: none of those
        units is updated (GradWindow.SKIPPED). `first`: the slot found not finite, if the
        caller found it (the global norm at step())."""
        if self.nonfinite is None:
            self.nonfinite = first
        elif first is None and self.passes > 1:
            # A window of several passes is named by its sums, in its last pass's order (a
            # later pass's find can come first in it), as device state names it, whose check
            # reads the sums autograd made (docs/semantics.md); a pass's own check decides
            # only that the window is skipped. Read on this path alone, once per such window.
            slots = [s for u in self.units for s in u.trainable if s.has_grad]
            for s in slots:
                if s.reader is not None:
                    _wait_read(s.reader)  # the pool may still be adding the last pass's gradients
            self.nonfinite = self.first_nonfinite_in_window(slots) or self.nonfinite
        for unit in self.update_order:
            if unit.window is not GradWindow.QUEUED and any(s.has_grad or s.fresh for s in unit.trainable):
                self._skip(unit)

    def _skip(self, unit, report: bool = True) -> None:
        """`unit` is not updated from this window (its gradients dropped); `report`: it is
        reported and counted as skipped (take_skipped), naming the window's first."""
        unit.landed = 0
        unit.checks = []
        for s in unit.trainable:
            s.fresh = False
            s.has_grad = False
            s.device_grad = None
            s.norm = None
        unit.window = GradWindow.SKIPPED
        if report:
            if not self._skipped:
                self._skipped_first = self.nonfinite  # kept: a pass dropped before the report forgets it
            self._skipped.append(unit)

    def take_skipped(self, step: int):
        """(first non-finite slot, units SKIPPED, whether this is the window's first report,
        the step it belongs to), one report per call, or None when there is nothing new to
        report. `step`: the label of the current window's step (the caller's count). Windows
        the device check skipped in are reported once all of their updates are settled, which
        may be after the window has ended: with the label they had then."""
        self._labels[self.window_serial] = step
        for serial in sorted(self._device_skips):
            current = serial == self.window_serial
            if (current and self.in_backward) or self.device_check.has_pending(window=serial):
                continue  # more of this window may still turn out skipped: one report, when it is whole
            first, units = self._device_skips.pop(serial)
            return first, units, self._count(serial), self._labels.get(serial, step)
        if not self._skipped:
            return None
        units, self._skipped = self._skipped, []
        return self._skipped_first, units, self._count(self.window_serial), step

    def count_skip(self) -> bool:
        """True the first time the current window is reported skipped: a skip found outside
        the streamer (the device-state update, engine.py) counts in optimizer.skipped_steps
        only if no report of the window counted it already."""
        return self._count(self.window_serial)

    def _count(self, serial: int) -> bool:
        """True the first time window `serial` is reported (optimizer.skipped_steps counts it once)."""
        first = serial not in self._counted
        self._counted.add(serial)
        return first

    def first_nonfinite_in_window(self, slots):
        """The first of `slots` in the last pass's backward order (units as they were handed
        on, each unit's slots as their gradients came; the rest after, as given) whose window
        gradient (the host sum, or the landed one) is not finite; None if they all are (the
        global norm at step() overflowed)."""
        if self._handed:
            handed, arrived, n = self._handed, self._arrived, len(self._arrived)
            slots = sorted(slots, key=lambda s: (handed.get(s.unit, len(handed)), arrived.get(s, n)))
        for s in slots:
            if not _all_finite(self.grad_of(s)):
                return s
        return None

    def queued(self, unit) -> None:
        """`unit`'s update for this window was queued (until then it stays pending: a step()
        that raised before queuing it finds it again)."""
        unit.window = GradWindow.QUEUED

    def close_pass(self) -> None:
        self._ready.clear()
        self._partial.clear()
        self.in_backward = False

    def _window_complete(self) -> bool:
        """The window's last pass, and nothing holds the updates for step() (clipping)."""
        return self.passes == self.settings.accumulation_steps and not self.settings.clip

    def _hand_on(self, unit) -> list:
        if self._records_order:
            self._handed.setdefault(unit, len(self._handed))
        if self.check_batches:
            bad = self._first_nonfinite(unit)
            unit.checks = []
            if bad is not None and self.nonfinite is None:
                self.nonfinite = bad
            if self.nonfinite is not None and not self.hold:
                # This unit and every later one of the pass; "raise" raises at the pass's end
                # (_raise_found), so that an exception of the user's later in backward surfaces
                # as itself, and its pass's gradients are dropped, not reported as a skip.
                self._skip(unit, report=self.settings.nonfinite != "raise")
                return []
        landed = [s for s in unit.trainable if s.fresh]
        unit.landed = 0
        if self.settings.accumulation_steps > 1:
            firsts = [s for s in landed if not s.has_grad]
            for s in firsts:
                if s.grad_sum is None:  # optimizer_mode="gpu" on a GPU: pinned at wrap(), the kernel maps it
                    s.grad_sum = torch.empty(s.param.shape, dtype=torch.float32)
                s.grad_sum.copy_(s.stage)  # bf16 -> fp32 is exact
            rest = [s for s in landed if s.has_grad]
            if rest:
                by_dtype = {}
                for s in rest:
                    by_dtype.setdefault(s.stage.dtype, []).append(s)
                for group in by_dtype.values():
                    handle = ops.accumulate_(
                        [s.grad_sum for s in group], [s.stage for s in group], threads=self.settings.threads
                    )
                    for s in group:
                        s.reader = handle
        for s in landed:
            s.fresh = False
            s.has_grad = True
        unit.window = GradWindow.LANDED
        return [] if self.hold else [unit]

    # -- window bookkeeping ------------------------------------------------------------------

    def flush(self):
        """Hand on everything still waiting (called by step(); backward is over by then).
        Yields each unit as it is handed on."""
        try:
            for unit in [*self._ready, *self._partial]:
                unit.grad_event.synchronize()
                yield from self._hand_on(unit)
            self._raise_found()
        finally:
            self._ready.clear()
            self._partial.clear()

    def read_by(self, slots, handle) -> None:
        """`handle` (a host job or a device update) reads the landed gradients of `slots`:
        their buffers are not written again before it has."""
        for s in slots:
            s.reader = handle

    def release_device_grads(self, slots) -> None:
        """The update that reads these device gradients is queued: they may go."""
        for s in slots:
            s.device_grad = None

    def use_sum_buffers(self, take) -> None:
        """Carve the accumulation sums from `take(shape, dtype)` (the device update's pinned
        arena, which its kernel maps) instead of plain host memory."""
        for unit in self.units:
            for s in unit.trainable:
                s.grad_sum = take(s.param.shape, torch.float32)

    def grad_of(self, slot) -> torch.Tensor:
        """The gradient the update reads: on the device (optimizer_mode="gpu" without
        clipping or accumulation), the landing buffer, or the window's sum."""
        if slot.device_grad is not None:
            return slot.device_grad
        return slot.grad_sum if self.settings.accumulation_steps > 1 else slot.stage

    def reset_window(self) -> None:
        self.passes = 0
        self.nonfinite = None
        self.window_serial += 1
        if self.device_check is not None:
            self.device_check.new_window()  # behind every kernel of the window that ends
            # Only windows with updates still to settle or skips still to report keep their labels.
            keep = set(self._device_skips) | {p.window for p in self.device_check.pending()}
            self._labels = {w: v for w, v in self._labels.items() if w in keep}
            self._counted = {w for w in self._counted if w in keep}
        else:
            self._labels.clear()
            self._counted.clear()
        for unit in self.units:
            unit.window = GradWindow.EMPTY
            for s in unit.trainable:
                s.has_grad = False
                s.norm = None

    def global_norm(self, slots) -> torch.Tensor:
        """The L2 norm clip_grad_norm_ would compute over this window's gradients: from the
        per-gradient device norms (one pass), or from the host sums (accumulation)."""
        if self.settings.accumulation_steps > 1:
            for s in slots:  # the host sums may still be being added to on the pool
                if s.reader is not None:
                    _wait_read(s.reader)
            return torch.nn.utils.get_total_norm([s.grad_sum for s in slots], 2.0)
        norms = [s.norm for s in slots if s.norm is not None]
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms), 2.0).cpu()


_SQ_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what ops.grad_sq_norms reads


def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _wait_read(reader) -> None:
    """Wait until `reader` (a host job, or a device update) has done with a gradient buffer:
    a device update's kernel reads it, so its end suffices, not its moments' copies home."""
    (reader.wait_read if isinstance(reader, DeviceUpdate) else reader.wait)()
