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
"""

from __future__ import annotations

import functools
import weakref
from collections import deque

import torch

from .. import ops
from .device import DONE, DeviceUpdate


def _view_as(region: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The landing buffer for `g` inside the slot's reserved room (sized for the param's
    dtype; a gradient is never wider than its param)."""
    flat = region.view(-1).view(torch.uint8)
    n = g.numel() * g.dtype.itemsize
    if n > flat.numel():
        raise RuntimeError(f"trainstream: a {g.dtype} gradient does not fit its parameter's landing buffer")
    return flat[:n].view(g.dtype).view(g.shape)


def _post_accumulate(streamer_ref, slot_ref, param) -> None:
    streamer, slot = streamer_ref(), slot_ref()
    if streamer is not None and slot is not None:
        streamer._on_grad(slot)


class GradStreamer:
    SMALL_GRAD_BYTES = 1 << 20

    def __init__(self, engine):
        self.engine = engine
        self.passes = 0  # backward passes in the current accumulation window
        self.in_backward = False
        self._ready = deque()  # units whose gradients have all been issued D2H, in order
        self._partial = set()  # units with some gradients this pass (unused params exist)
        self._pass_id = 0  # numbers every backward pass (a slot's seen_pass)
        self._last_unit = None  # the unit the last gradient belonged to
        self._hooks = []

    def install(self) -> None:
        # The hook dict is owned by the parameter's C++ autograd metadata, which Python's
        # cyclic GC cannot see: a hook holding the streamer (-> engine -> model -> param) or
        # the slot (-> param) strongly would make param, engine and model immortal. So the
        # hook holds both weakly; they are alive whenever backward can run.
        streamer = weakref.ref(self)
        for unit in self.engine.units:
            for slot in unit.trainable:
                self._hooks.append(
                    slot.param.register_post_accumulate_grad_hook(
                        functools.partial(_post_accumulate, streamer, weakref.ref(slot))
                    )
                )

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- during backward -------------------------------------------------------------------

    def _begin_pass(self) -> None:
        n = self.engine.opts.accumulation_steps
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
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def begin_pass(self) -> None:
        """Backward reached the model's output: the pass starts in the outer backward, so its
        end callback runs when all of backward is done (a first gradient inside a reentrant
        checkpoint's own backward would tie it to that inner one)."""
        if not self.in_backward:
            self._begin_pass()

    def _on_grad(self, slot) -> None:
        if not self.in_backward:
            self._begin_pass()
        p = slot.param
        g = p.grad
        if g is None:
            return
        if g.is_sparse:
            raise ValueError(f"trainstream: sparse gradients are not supported ({slot.name})")
        engine, backend = self.engine, self.engine.backend
        unit = slot.unit
        if slot.seen_pass == self._pass_id:
            # A second gradient in one pass: the parameter is used by several reentrant
            # checkpoint segments, each with its own backward. Summed while it waits on the device.
            waiting = next((w for w in unit.waiting if w[0] is slot), None)
            if waiting is None:
                raise RuntimeError(
                    f"trainstream: {slot.name} got a second gradient in one backward pass after the first had "
                    "left for host memory (a parameter used by several reentrant checkpoint segments); use "
                    "checkpoint(..., use_reentrant=False), or keep the parameter inside one segment"
                )
            summed = waiting[1].add_(g)
            if engine.clip_on_device:
                slot.norm = torch.linalg.vector_norm(summed if summed.dtype == torch.float32 else summed.float())
            p.grad = None
            return
        slot.seen_pass = self._pass_id
        nbytes = g.numel() * g.element_size()
        if engine.device_grads:
            # optimizer_mode="gpu": the update reads the gradient where it is, as soon as the
            # unit is complete; the cap holds back a backward that outruns the updates.
            engine.inflight.make_room(nbytes, engine.max_inflight_bytes)
            slot.device_grad = g
            p.grad = None
            self._landed(slot, DONE)
            return
        if engine.clip_on_device:
            # Norm of the gradient as an fp32 tensor, so a bf16 gradient (a paged block under
            # autocast) gives the same bits as the fp32 gradient of the unpaged run.
            slot.norm = torch.linalg.vector_norm(g if g.dtype == torch.float32 else g.float())
        p.grad = None
        previous, self._last_unit = self._last_unit, unit
        if previous is not None and previous is not unit and previous.waiting:
            self._send(previous)  # backward has moved on: what it left waiting goes now
        unit.waiting.append((slot, g, backend.compute_stream()))
        if unit.landed + len(unit.waiting) == len(unit.trainable) or nbytes >= self.SMALL_GRAD_BYTES:
            self._send(unit)
        elif self._ready and self._ready[0].grad_event.query():
            self.poll()

    def _send(self, unit) -> None:
        """Copy the unit's waiting gradients to their landing buffers, one batch on the D2H
        stream, and count them landed."""
        engine, backend = self.engine, self.engine.backend
        batch, unit.waiting = unit.waiting, []
        nbytes = sum(g.numel() * g.element_size() for _, g, _ in batch)
        for slot, g, _ in batch:
            if slot.reader is not None:
                _wait_read(slot.reader)  # the last job reading this buffer (long finished, as a rule)
                slot.reader = None
            if slot.stage is None or slot.stage.dtype != g.dtype:
                slot.stage = _view_as(slot.stage_region, g)
        engine.inflight.make_room(nbytes, engine.max_inflight_bytes)
        backend.follow(backend.copy_out, [stream for *_, stream in batch])  # each gradient's producer
        with backend.on(backend.copy_out):
            for slot, g, _ in batch:
                slot.stage.copy_(g, non_blocking=True)
                backend.keep_until(g, backend.copy_out)
        event = backend.record(backend.copy_out)
        engine.inflight.add(event, nbytes)  # the device gradients are freed once copied
        for slot, *_ in batch:
            self._landed(slot, event, poll=False)
        self.poll()

    def _landed(self, slot, event, poll: bool = True) -> None:
        """`slot`'s gradient is on its way (`event`: its copy); the unit is ready for its
        update once all of its gradients are."""
        unit = slot.unit
        unit.grad_event = event
        slot.fresh = True
        unit.landed += 1
        if unit.landed == len(unit.trainable):
            self._partial.discard(unit)
            self._ready.append(unit)
        else:
            self._partial.add(unit)
        if poll:
            self.poll()

    def recover(self) -> None:
        """A backward pass that raised never reached its end callback: close it here, when
        no backward is running, dropping the window's gradients (its updates, if any were
        queued already, stand)."""
        if self.in_backward and torch._C._current_graph_task_id() == -1:
            self._drop_pass()
            self.engine.after_backward()
            self.engine.events.add("a backward pass raised: its gradients were dropped")

    def _drop_pass(self) -> None:
        """Forget the window's gradients, landed, waiting or in flight."""
        self._ready.clear()
        self._partial.clear()
        self.in_backward = False
        self._last_unit = None
        for unit in self.engine.units:
            unit.landed = 0
            unit.waiting = []
            for s in unit.trainable:
                s.fresh = False
                s.device_grad = None
        self.reset_window()

    def poll(self) -> None:
        """Hand on every unit whose gradient copies have finished (D2H is in order, so the
        queue's head finishes first); then let finished updates travel to the device."""
        while self._ready and self._ready[0].grad_event.query():
            self._hand_on(self._ready.popleft())
        self.engine.weights.land_updates()

    def _end_pass(self) -> None:
        """End of a backward pass (autograd's final callback): wait for the copies still in
        flight and hand on every unit that got gradients, complete or not."""
        try:
            for unit in self.engine.units:
                if unit.waiting:  # a unit with a parameter this pass did not reach
                    self._send(unit)
            for unit in [*self._ready, *self._partial]:
                unit.grad_event.synchronize()
                self._hand_on(unit)
            engine = self.engine
            if self.passes == engine.opts.accumulation_steps and not engine.opts.max_grad_norm:
                for unit in engine.update_order():  # got gradients only in earlier micro-batches
                    if not unit.queued and any(s.has_grad for s in unit.trainable):
                        engine.queue_update(unit)
        except BaseException:
            self._drop_pass()  # no half-landed state for the next pass to count
            self.engine.events.add("the end of a backward pass raised: its gradients were dropped")
            raise
        finally:
            self._ready.clear()
            self._partial.clear()
            self.in_backward = False
            self.engine.after_backward()

    def _hand_on(self, unit) -> None:
        engine = self.engine
        landed = [s for s in unit.trainable if s.fresh]
        unit.landed = 0
        if engine.opts.accumulation_steps > 1:
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
                        [s.grad_sum for s in group], [s.stage for s in group], threads=engine.opts.threads
                    )
                    for s in group:
                        s.reader = handle
        for s in landed:
            s.fresh = False
            s.has_grad = True
        if self.passes == engine.opts.accumulation_steps and not engine.opts.max_grad_norm:
            engine.queue_update(unit)

    # -- window bookkeeping ------------------------------------------------------------------

    def flush(self) -> None:
        """Hand on everything still waiting (called by step(); backward is over by then)."""
        for unit in [*self._ready, *self._partial]:
            unit.grad_event.synchronize()
            self._hand_on(unit)
        self._ready.clear()
        self._partial.clear()

    def grad_of(self, slot) -> torch.Tensor:
        """The gradient the update reads: on the device (optimizer_mode="gpu" without
        clipping or accumulation), the landing buffer, or the window's sum."""
        if slot.device_grad is not None:
            return slot.device_grad
        return slot.grad_sum if self.engine.opts.accumulation_steps > 1 else slot.stage

    def reset_window(self) -> None:
        self.passes = 0
        for unit in self.engine.units:
            unit.queued = False
            for s in unit.trainable:
                s.has_grad = False
                s.norm = None

    def global_norm(self, slots) -> torch.Tensor:
        """The L2 norm clip_grad_norm_ would compute over this window's gradients: from the
        per-gradient device norms (one pass), or from the host sums (accumulation)."""
        if self.engine.opts.accumulation_steps > 1:
            for s in slots:  # the host sums may still be being added to on the pool
                if s.reader is not None:
                    _wait_read(s.reader)
            return torch.nn.utils.get_total_norm([s.grad_sum for s in slots], 2.0)
        norms = [s.norm for s in slots if s.norm is not None]
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms), 2.0).cpu()


def _wait_read(reader) -> None:
    """Wait until `reader` (a host job, or a device update) has done with a gradient buffer:
    a device update's kernel reads it, so its end suffices, not its moments' copies home."""
    (reader.wait_read if isinstance(reader, DeviceUpdate) else reader.wait)()
