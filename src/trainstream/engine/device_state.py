"""Device state: a small trainable set (a LoRA's adapters) trained where it computes.

The plan (placement.py, Plan.device_state) names the trainable slots whose whole state stays
on the compute device: weights, the gradient, AdamW's two moments and, for a param that is
not fp32, an fp32 master. Nothing of them crosses PCIe and no landing machinery runs per
gradient: autograd accumulates ``p.grad`` exactly as it does without the engine (summed over
an accumulation window, as torch sums). The update takes the host path's timing
(docs/semantics.md, the table of when updates apply), so that a loop trains the same on
either path: without clipping it is queued at the end of the window's last backward pass
(the engine's _end_pass), with max_grad_norm it is held for step(), clipped by the global
norm over host and device-state gradients together. Either way ``p.grad`` is consumed when
the update is queued (None afterwards, as on the host path).

A gradient that is not finite skips what the host path skips: in a held window (clipping,
accumulation) the whole update; with eager updates (neither), the unit found and every unit
after it in the order backward completed them (`on_grad` records it, as the host path hands
units on in that order), those before it standing. The parameter reported is the first in that
order, a unit's own in the order their gradients came (recorded wherever the check is on, held
windows too: batches, first_nonfinite), as the host path reports it. The check is lazy, as the device check of
optimizer_mode="gpu" (nonfinite.py): ops.mark_nonfinite_ marks each gradient on the device
ahead of the kernels, one launch per gradient dtype, and skip_order.py turns the marks into a
skip per slot (its unit or an earlier one holds a mark) that the kernels read, one launch
per param group and (gradient dtype, master or not) for every unit at once; the host learns
the outcome later (`settle`), reading the marks once the kernels have run, and takes the
skipped step counts back. ``zero_grad()`` clears ``p.grad`` as torch does (the optimizer's
own zero_grad).

Data parallel (docs/distributed.md): every rank keeps the whole device state, replicated.
The window's last backward pass averages its gradients over the ranks before the update is
queued (distributed.BucketAverage, [Note: averaging buckets]: buckets launched as the pass
completes them, all waited for at its end); the passes before it sum ``p.grad`` locally, as
DDP's no_sync does, and a step() that ends a window early averages it there. An all-reduce
gives every rank the same bits, so every rank applies the same update, and what is read from
the averages (a value not finite, which the sum carries over from any rank; the clipping
norm, counted once) is alike everywhere. What a gradient that is not finite skips or names
follows a fixed order standing in for backward's (the reduction order, `backward_order`):
each rank's own could differ.

Invariants:
- the moments are ``optimizer.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` on the device in the
  plan's moment dtype, ``["step"]`` a float32 CPU tensor as on the host path (a 0-dim view
  of one tensor of every slot's count, so that one op advances them): state_dict() is
  torch's format, and a load lands the moments back on the device (adopt_state);
- a master is this module's, not the optimizer state's: the optimizer's state_dict() reads
  it (master_of) and its load_state_dict() hands a saved one in (take_master), as for the
  host path's ([Note: masters in state dicts], optimizer.py); the param holds the master
  rounded to nearest even. A user's
  in-place edit of the param moves its version counter, and the master takes the edit
  before the next update (take_edits); the update's own writes go through ``p.data``,
  whose counter is its own;
- an update queued behind the check is settled before the next one is queued (its step
  counts are what the next reads);
- on CUDA the update is the engine's AdamW kernel on the current stream (behind backward,
  ahead of the next forward: nothing else waits for it); on the CPU path the host AdamW,
  which gives the same bits, done when update() returns, and settled at the next report;
- a step makes the host wait for the device nowhere: the check's outcome is read once its
  event has passed, and settling before the next update synchronizes only with an update
  still running (the previous step's, as a rule long done).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .. import ops
from . import skip_order

_LAYOUTS_KEPT = 4  # eager updates repeat one layout; a raised pass or a held window adds one


class _Layout:
    """One update's slots as its launches take them, built once and kept while they repeat.

    - slots: the batches' slots one batch after another (the update's order); unit_start[i]:
      the index of the first slot of slot i's batch (a skip runs from there to the end);
    - mark_groups: the check's launches, one per gradient dtype, as update-order positions;
      their marks lie one group after another, mark_order giving each mark's update-order
      position (None: the update's order itself), to_update_order its inverse (on the device);
    - launches: the optimizer's (device_state_launches), skip_ends: for each of their slots
      laid out one launch after another, the update-order index of the last slot of its batch
      (skip_order.skipped reads the running count of marks there);
    - states: each slot's optimizer state, step_views the step counts it holds (views of
      DeviceState._step_counts), step_positions / step_index where those are; storage: each
      param's data_ptr(), which the launches hold (a param given new storage makes a new
      layout)."""

    def __init__(self, state: DeviceState, batches, slots: list, grad_dtypes: tuple, storage: list):
        backend, n = state.backend, len(slots)
        self.slots, self.storage = slots, storage
        sizes = [len(ss) for _, ss in batches]
        self.one_batch = len(sizes) == 1  # a held window's, skipped whole
        self.unit_start, first = [], 0
        for size in sizes:
            self.unit_start += [first] * size
            first += size
        by_dtype: dict = {}
        for i, dtype in enumerate(grad_dtypes):
            by_dtype.setdefault(dtype, []).append(i)
        self.mark_groups = list(by_dtype.values())
        order = [i for group in self.mark_groups for i in group]
        self.mark_order = None if order == list(range(n)) else order
        self.to_update_order = None
        if self.mark_order is not None:
            inverse = [0] * n
            for j, i in enumerate(order):
                inverse[i] = j
            self.to_update_order = _index(inverse, backend)
        self.launches = state.optimizer.device_state_launches(backend.device, slots, list(grad_dtypes), state.masters)
        ends = skip_order.unit_ends(sizes)
        self.skip_ends = _index([ends[i] for launch in self.launches for i in launch.positions], backend)
        self.states = [state.optimizer.state[s.param] for s in slots]  # the dicts: a load replaces them
        self.step_views = [state._step_views[state._slot_index[s]] for s in slots]
        self.step_positions = [state._slot_index[s] for s in slots]  # into DeviceState._step_counts
        every = n == len(state.slots)  # each slot once: all of them, in another order
        self.step_index = None if every else torch.tensor(self.step_positions, dtype=torch.int64)


def _index(values: list, backend) -> torch.Tensor:
    """int64 indices on the compute device; on a GPU by a non-blocking copy from pinned memory
    (a layout is built in backward's final callback, where a pageable copy would sync)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(backend.device, non_blocking=True) if backend.is_cuda else t


@dataclass
class Queued:
    """A device-state update queued behind the non-finite check, not settled yet."""

    layout: _Layout  # its slots in the update's order, and how the check's marks are laid out
    event: object  # the end of its kernels and the marks' copy (the backend's event; DONE on the CPU)
    step: int  # the step it belongs to, for the events
    grads: list  # the gradients its kernels read, held until they have run


@dataclass(frozen=True)
class Skipped:
    """A settled update that the check skipped, from batch `first`'s unit on."""

    first: object  # the first slot found not finite
    units: list  # the units skipped (their names go into the events)
    step: int


class DeviceState:
    """Owns the device-state slots' moments' placement, masters and update."""

    def __init__(self, optimizer, slots: list, backend, backward_order: list | None = None):
        """Built with the engine, before the weights are placed on the device: the masters
        and moments are made there at the first update (_place), as torch makes its state.
        `backward_order`: `slots` in a fixed order standing in for backward's where no hook
        records it (data parallel: each rank's own order could differ, and what a gradient
        that is not finite skips or names must be alike on every rank); None: as given."""
        self.optimizer = optimizer  # the AdamW math and the state dicts
        self.slots = slots  # in the engine's update order
        self.backend = backend
        self._fixed = None if backward_order is None else {s: i for i, s in enumerate(backward_order)}
        self.masters: dict = {}  # param -> fp32 master on the device, for params not fp32
        self._versions: dict = {}  # param -> its _version when the master last matched it
        # A converted OffloadAdamW's fp32 masters of bf16 params (optimizer.py, _carried; the
        # optimizer's attach() hands its own on and forgets them).
        mine = {s.param for s in slots}
        self._carried = {p: m for p, m in getattr(optimizer, "_carried", {}).items() if p in mine}
        # slot -> (its state dict, exp_avg, exp_avg_sq) as _place left them: a slot is placed while
        # the optimizer still holds exactly those (a user replacing the state, a moment or the
        # whole optimizer.state makes it place again, as torch would read what is there).
        self._placed: dict = {}
        # unit -> how many device-state params it has (on_grad, once per gradient): fixed at
        # wrap(), where the slots' flags are set for good.
        self._counts: dict = {}
        for s in slots:
            self._counts[s.unit] = self._counts.get(s.unit, 0) + 1
        self._queued: list = []  # Queued updates not settled yet, oldest first
        self._layouts: dict = {}  # the updates' layouts (_Layout), by their slots, batches and dtypes
        # Every placed slot's ``state["step"]`` is a 0-dim view of one entry of this float32
        # CPU tensor (still torch's format), so that one op advances or reads them all.
        self._step_counts = torch.zeros(max(len(slots), 1), dtype=torch.float32)
        self._step_views = [self._step_counts[i] for i in range(len(slots))]
        self._slot_index = {s: i for i, s in enumerate(slots)}
        # The check's marks, one int32 per slot, in a host buffer (pinned on a GPU) made here:
        # a pinned allocation on the autograd thread can synchronize the device, and a device
        # buffer's read would be a copy on the current stream, behind whatever follows the
        # update. One update at most uses it at a time: each is settled before the next.
        self._marks = backend.host_empty((max(len(slots), 1),), torch.int32)
        self.new_pass()  # this pass's order of units (on_grad)

    def __len__(self) -> int:
        return len(self.slots)

    def adopt_state(self) -> None:
        """The optimizer's state was replaced (load_state_dict): its moments go to the device
        before the next update."""
        self._placed.clear()
        self._layouts.clear()  # their launches hold the moments replaced

    def _place(self, slots) -> None:
        """The moments of `slots` on the device in the moment dtype: those the optimizer holds
        (a converted optimizer's, a loaded state dict's) are moved there, zeros at step 0 where
        it holds none (torch makes a param's state at its first update too); and a master for
        each param that is not fp32, from the param (or the master carried in, where the param
        is what that rounds to)."""
        device, dtype = self.backend.device, self.optimizer.moment_dtype
        if slots:
            self._layouts.clear()  # a layout's launches hold the moments and masters made here
        for s in slots:
            p = s.param
            if p.dtype != torch.float32 and p not in self.masters:
                master = p.detach().to(dtype=torch.float32, copy=True)
                kept = self._carried.pop(p, None)
                if kept is not None and kept.shape == p.shape and torch.equal(kept.to(p.device, p.dtype), p.detach()):
                    master.copy_(kept)  # its low bits stand
                self.masters[p] = master
                self._versions[p] = p._version
            state = self.optimizer.state[s.param]
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            self._own_step(state, s)
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros(s.param.shape, dtype=dtype, device=device)
                elif state[key].device != device or state[key].dtype != dtype:
                    state[key] = state[key].to(device=device, dtype=dtype).contiguous()
            self._placed[s] = (state, state["exp_avg"], state["exp_avg_sq"])

    def _in_placing_order(self, batches, slots: set) -> list:
        """`slots` of `batches` in the order their states enter optimizer.state (the order of
        state_dict()'s "state", as the host path makes them): batch by batch, each unit's in
        its own order, a batch of every unit's (None) in update order; not the order the
        gradients came in, which a batch's slots follow."""
        out = []
        for unit, _ in batches:
            out += [s for s in (self.slots if unit is None else unit.device_state_slots) if s in slots]
        return out

    def _unplaced(self, slots) -> list:
        """The slots whose state is not what _place left: never placed, or replaced since (the
        launches and layouts hold the moments they were built over)."""
        state, placed = self.optimizer.state, self._placed
        out = []
        for s in slots:
            rec = placed.get(s)
            st = state.get(s.param)
            if rec is None or st is not rec[0] or st.get("exp_avg") is not rec[1] or st.get("exp_avg_sq") is not rec[2]:
                out.append(s)
        return out

    def _own_step(self, state: dict, slot) -> None:
        """`slot`'s step count becomes its view of _step_counts, holding the value the state
        holds (a loaded or converted state's, or one a user set)."""
        i = self._slot_index[slot]
        view = self._step_views[i]
        if state["step"] is not view:
            self._step_counts[i] = float(state["step"])
            state["step"] = view

    def _advance_steps(self, layout: _Layout) -> list:
        """Count a step for each of the layout's slots (one op) and return their counts, as
        ints in the layout's order. A step count replaced since it was placed (by hand) is
        taken in first."""
        if not all(map(operator.is_, [st["step"] for st in layout.states], layout.step_views)):
            for st, s in zip(layout.states, layout.slots):
                self._own_step(st, s)
        if layout.step_index is None:
            self._step_counts += 1
        else:
            self._step_counts[layout.step_index] += 1
        counts = self._step_counts.tolist()
        return [int(counts[i]) for i in layout.step_positions]

    def master_of(self, p):
        """`p`'s fp32 master (on the device): the one made at its first update, else one
        carried or loaded in that `p` still rounds to (its first update takes it), else None
        (`p` itself is where that update starts)."""
        master = self.masters.get(p)
        if master is None:
            kept = self._carried.get(p)
            if kept is not None and torch.equal(kept.to(p.device, p.dtype), p.detach()):
                return kept
        return master

    def take_master(self, p, master: torch.Tensor) -> bool:
        """A loaded fp32 master of `p` (optimizer.load_state_dict): taken where `p` holds what
        it rounds to, else the weights win. Before `p`'s first update it is carried to that
        update (_place checks it again there). Returns whether it was taken."""
        if not torch.equal(p.detach(), master.to(p.device, p.dtype)):
            return False
        made = self.masters.get(p)
        if made is None:
            self._carried[p] = master
        else:
            made.copy_(master)
            self._versions[p] = p._version  # p holds its rounding: no edit left to take
        return True

    # -- the window's gradients -------------------------------------------------------------

    def with_grads(self) -> list:
        """The slots with a gradient this window (torch's AdamW skips a param without one)."""
        out = [s for s in self.slots if s.param.grad is not None]
        for s in out:
            if s.param.grad.is_sparse:
                raise ValueError(f"trainstream: sparse gradients are not supported ({s.name})")
        return out

    def has_grads(self) -> bool:
        return any(s.param.grad is not None for s in self.slots)

    def _grads(self, slots) -> list:
        grads = [s.param.grad for s in slots]  # `.grad` is a checked getter: read once
        return [g if g.is_contiguous() else g.contiguous() for g in grads]

    def norms(self, slots) -> list:
        """Each gradient's L2 norm in fp32 (one multi-tensor launch on CUDA), as the host path
        takes it and as torch's clip_grad_norm_ takes it of an fp32 gradient."""
        if not slots:
            return []
        return list(torch._foreach_norm(self._grads(slots), 2.0, dtype=torch.float32))

    def first_nonfinite(self, slots=None):
        """The first slot (of `slots`, default: those with a gradient) in backward's order
        (in_backward_order) whose gradient is not finite, or None. One host read when all
        are: the norms say where to look, the gradient itself decides (a huge finite value
        overflows its square)."""
        slots = self.with_grads() if slots is None else slots
        norms = self.norms(slots)
        if not norms or bool(torch.isfinite(torch.stack(norms)).all()):
            return None
        norm_of = dict(zip(slots, norms))
        for s in self.in_backward_order(slots):
            n = norm_of[s]
            if not bool(torch.isfinite(n)) and not bool(torch.isfinite(s.param.grad).all()):
                return s
        return None

    def drop(self) -> None:
        """Forget the window's gradients (a skipped or dropped window): p.grad goes to None."""
        for s in self.slots:
            s.param.grad = None
        self.new_pass()

    # -- the order backward completes units in (eager updates with the check on) -------------

    def on_grad(self, slot) -> None:
        """autograd finished `slot`'s gradient (the post-accumulate-grad hook, called where
        the order decides what a non-finite gradient skips or names): a unit counts as
        complete once all of its device-state params have one this pass."""
        unit = slot.unit
        seen = self._seen.get(unit)
        if seen is None:
            seen = self._seen[unit] = {}  # the unit's slots in their gradients' order (a dict keeps it)
        elif slot in seen:
            return  # a second gradient in one pass (reentrant checkpoint segments), summed by autograd
        seen[slot] = None
        if len(seen) == self._counts[unit]:
            self._complete.append(unit)

    def _units_in_backward_order(self) -> list:
        """The units this pass reached, in the order the host path hands them on: those
        complete as they completed, then those only some of whose params got a gradient, by
        their first."""
        complete = set(self._complete)
        return list(self._complete) + [u for u in self._seen if u not in complete]

    def _slots_of(self, unit, has) -> list:
        """`unit`'s slots in `has`, in the order their gradients came this pass (the host path
        checks a unit's gradients in that order), then those no hook saw, in the unit's (or
        the fixed order)."""
        seen = self._seen.get(unit, {})
        unseen = [s for s in unit.device_state_slots if s in has and s not in seen]
        return [s for s in seen if s in has] + self._in_fixed_order(unseen)

    def _in_fixed_order(self, slots) -> list:
        """`slots` in the fixed order that stands in for backward's, if there is one."""
        return list(slots) if self._fixed is None else sorted(slots, key=self._fixed.__getitem__)

    def in_backward_order(self, slots) -> list:
        """`slots` in the order backward produced their gradients this pass (units as
        _units_in_backward_order, each unit's as _slots_of), which decides the parameter a
        non-finite gradient is reported by (docs/semantics.md); where no hook recorded one,
        the fixed order, else the order given."""
        if not self._seen:
            return self._in_fixed_order(slots)
        has = set(slots)
        out = [s for u in self._units_in_backward_order() for s in self._slots_of(u, has)]
        placed = set(out)
        return out + [s for s in slots if s not in placed]

    def new_pass(self) -> None:
        self._seen, self._complete = {}, []

    def batches(self, by_unit: bool) -> list:
        """The slots with a gradient, as [(unit, slots)]: one batch per unit in the order the
        host path would hand them on (complete units as they completed, then those only some
        of whose params got a gradient, by their first), each unit's slots in their
        gradients' order, or (`by_unit` False) one batch of every slot (None for its unit),
        in that order where a hook recorded it (nonfinite checked), else in the fixed order
        standing in for backward's (data parallel), else in update order.
        The first slot of that order found not finite is the one reported. The order is
        forgotten."""
        with_grads = self.with_grads()
        if not with_grads:
            self.new_pass()
            return []
        if not by_unit:
            ordered = self.in_backward_order(with_grads)
            self.new_pass()
            return [(None, ordered)]
        has = set(with_grads)
        order = self._units_in_backward_order()
        unseen = dict.fromkeys(s.unit for s in self._in_fixed_order(with_grads))
        order += [u for u in unseen if u not in set(order)]  # no hook saw them
        out = []
        for u in order:
            slots = self._slots_of(u, has)
            if slots:
                out.append((u, slots))
        self.new_pass()
        return out

    def completed_batches(self) -> list:
        """[(unit, slots)] of the units every device-state param of which got its gradient
        this pass, in the order they completed (a pass that raised keeps their updates on
        the host path). The order is forgotten."""
        out = [
            (u, self._slots_of(u, set(u.device_state_slots)))
            for u in self._complete
            if all(s.param.grad is not None for s in u.device_state_slots)
        ]
        self.new_pass()
        return out

    # -- the update --------------------------------------------------------------------------

    def take_edits(self, slots) -> None:
        """A param edited in place since its master last matched it: the master takes the
        edit (an fp32 param is its own master, and its edit is simply there)."""
        masters, versions = self.masters, self._versions
        if not masters:
            return  # fp32 params only: each is its own master
        for s in slots:
            p = s.param
            master = masters.get(p)
            if master is not None and p._version != versions[p]:
                master.copy_(p.detach())
                versions[p] = p._version

    def place(self, batches) -> None:
        """Give the batches' slots that lack their state one, in the order the host path makes
        them (_in_placing_order); before the batches are merged into one, whose order is the
        update's."""
        unplaced = self._unplaced([s for _, ss in batches for s in ss])
        if unplaced:
            self._place(self._in_placing_order(batches, set(unplaced)))

    def update(self, batches, grad_scale: float = 1.0, check: bool = False, step: int = 0) -> None:
        """AdamW over the batches' slots from their gradients, scaled by `grad_scale`
        (clipping): one kernel per param group and (gradient dtype, master or not), whatever
        the number of batches. The gradients are taken: p.grad is None afterwards. `check`:
        the gradients are checked on the device first (ops.mark_nonfinite_, one launch per
        dtype), and a slot whose batch or an earlier batch holds a gradient that is not
        finite writes nothing (skip_order.py), as if the batches had gone one after another
        behind one flag. Nothing is read back here: the outcome is a Queued record, settled
        later (`settle`). `step`: the step label of the events."""
        slots = [s for _, ss in batches for s in ss]
        if not slots:
            return
        self.place(batches)
        self.take_edits(slots)
        if check and self._queued:
            raise RuntimeError("trainstream internal: a device-state update was not settled before the next")
        grads = self._grads(slots)
        layout = self._layout_for(batches, slots, grads)
        skip = self._check(layout, grads) if check else None
        steps = self._advance_steps(layout)  # skipped or not: settle() takes the skipped back
        self.optimizer.update_device_state(layout.launches, steps, grads, grad_scale, skip)
        for s in slots:
            s.param.grad = None  # consumed, as the host path's gradients are
        if check:
            # Held until its event has passed (settle), which is after the kernels read them.
            self._queued.append(Queued(layout, self.backend.record(), step, grads))
        elif self.backend.is_cuda:
            # Autograd made the gradients on its own streams; the kernels read them on this one.
            stream = self.backend.compute_stream()
            for g in grads:
                g.record_stream(stream)

    def _layout_for(self, batches, slots, grads) -> _Layout:
        """The update's layout (_Layout), kept while the batches, their gradients' dtypes and
        the params' storage repeat (eager updates: backward's order, step after step)."""
        key = (tuple(slots), tuple(len(ss) for _, ss in batches), tuple(g.dtype for g in grads))
        storage = [s.param.data_ptr() for s in slots]
        layout = self._layouts.get(key)
        if layout is not None and layout.storage == storage:
            return layout
        if len(self._layouts) >= _LAYOUTS_KEPT:
            self._layouts.pop(next(iter(self._layouts)))
        layout = self._layouts[key] = _Layout(self, batches, slots, key[2], storage)
        return layout

    def _check(self, layout: _Layout, grads: list) -> torch.Tensor:
        """Queue the check of `grads` (one ops.mark_nonfinite_ launch per gradient dtype) and
        return each launch slot's skip (skip_order.skipped, laid out as the launches take
        it). The marks land in the host buffer that settle() reads once the update's event
        has passed: on a GPU through a non-blocking copy behind the kernels."""
        n = len(grads)
        if self.backend.is_cuda:
            marks = torch.zeros(n + 1, dtype=torch.int32, device=self.backend.device)
            found, flag = marks[:n], marks[n:]
        else:
            found, flag = self._marks[:n], torch.zeros(1, dtype=torch.int32)
            found.zero_()
        offset = 0
        for positions in layout.mark_groups:
            ops.mark_nonfinite_([grads[i] for i in positions], found[offset : offset + len(positions)], flag)
            offset += len(positions)
        in_order = found if layout.to_update_order is None else found.index_select(0, layout.to_update_order)
        skip = skip_order.skipped(in_order, layout.skip_ends)
        if self.backend.is_cuda:
            self._marks[:n].copy_(found, non_blocking=True)  # pinned: no host sync
        return skip

    def has_pending(self) -> bool:
        return bool(self._queued)

    def settle(self, wait: bool = False) -> list:
        """Settle, oldest first, the updates queued behind the check whose kernels have run
        (all of them if `wait`, waiting for the last). The batch holding the first gradient
        found not finite and every batch after it were skipped on the device: their step
        counts, advanced when they were queued, are taken back. Returns a Skipped per update
        that was."""
        out = []
        while self._queued:
            q = self._queued[0]
            if not q.event.query():
                if not wait:
                    break
                q.event.synchronize()  # only for an update still running (as a rule long passed)
            self._queued.pop(0)
            layout = q.layout
            marks = self._marks[: len(layout.slots)].tolist()  # one read, in the check's order
            first = skip_order.first_found(marks, layout.mark_order)
            if first is None:
                continue
            skipped = layout.slots[layout.unit_start[first] :]
            positions = layout.step_positions[layout.unit_start[first] :]
            self._step_counts[torch.tensor(positions, dtype=torch.int64)] -= 1
            if layout.one_batch:  # its units as the host path lists a window's: in update order
                skipped = sorted(skipped, key=self._slot_index.__getitem__)
            out.append(Skipped(layout.slots[first], list(dict.fromkeys(s.unit for s in skipped)), q.step))
        return out

    def nbytes(self) -> int:
        """Device bytes this state holds now: weights, gradients, moments, masters."""
        total = 0
        for s in self.slots:
            p = s.param
            total += p.numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
            state = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    total += state[key].numel() * state[key].element_size()
        return total + sum(m.numel() * 4 for m in self.masters.values())
