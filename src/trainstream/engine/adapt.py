"""The adapter: measures what the plan could only guess, and moves blocks until it fits.

- Each pass it samples the device memory at block boundaries (the running peak), and
  reads the device's own peak counter at the step's start (its value at the end is the
  step's peak if it rose), at the stack's end and when backward reaches the stack: when
  the counter rises between the last two, the rise is what runs after the stack (the
  head's logits, the loss and their gradients) adds above the memory allocated at the
  stack's end. It sits on top of every block's activations, so the plan counts it there
  (`after_stack`); what the head still holds when backward reaches the stack (a caller's
  logits) is counted through backward (`held_after_stack`). What is left of the measured
  peak above the prediction is the correction.
- The counter only climbs, so a backward peak below the forward's cannot be read. Memory
  freed between the model's forward and backward lowers backward's part by that much
  (autocast frees its copies of resident weights whose activations are paged when it
  exits); under the forward's peak it goes unseen, and a placement that frees nothing
  gets it whole. So the plan counts the rise plus what was freed (`after_stack_bound`, from
  the last pass whose head set a new peak) when that is more. A loss computed
  outside the model's forward, or an autocast entered inside it, hides what it allocates or
  frees from the readings, so less (or nothing) is seen freed.
- The first forward passes count each block's saved activations (measure.py), and the
  passes after the first (which warms up: library handles, the allocator) time each
  block's forward and its backward (from when its weights are there; a recomputed block's
  forward again and the waits for paged activations inside its backward taken off), read
  after the step. After each of the first SETTLE_STEPS steps the planner replans
  with those figures; a new placement is returned as a Replan, which the engine applies
  at the end of that step.
- Later, the watchdog: when a step's peak passes the usable memory (longer sequences, a
  bigger batch), it pages more, never less.
- Online guard, every forward pass with activation_offload="auto" (the one decision
  taken inside a pass: block_starts answers it, the engine applies it at once): before a block runs,
  if what is allocated plus the activations the rest of the pass will save (as this
  pass's blocks have shown) would not fit, the block's activations leave the device: it is
  recomputed in backward when its measured forward takes no longer than paging its
  activations out in forward and back in for backward (the plan's phases), or when no
  forward has been timed yet (the first pass: [Note: recompute before timing] in
  planner/plan.py), and paged otherwise, or when recomputing
  would keep as much (its inputs are as large as its activations). That keeps
  the very first pass, and a pass that suddenly grows, from running out of memory. It
  projects the end of the forward as the plan does (each block's measured activations,
  what runs after the stack); the plan also keeps room for a block's gradients and its
  correction, so a placement the plan chose passes the guard.
- offload="auto": after SWITCH_AFTER steps, if the model, its gradients, torch AdamW's
  state and the measured activations fit, the run switches to torch's fused AdamW on the
  device (switch.py).

Every decision goes to the events log and, with its numbers, to plan["history"]; each step's
measured peak to a bounded timeline (memory_report's peaks["per_step"], plot_memory's line).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..planner.plan import BACKWARD_PER_FORWARD, device_bytes, make_plan, paging_cost_s, placement_terms
from ..sizes import GiB, MiB
from .measure import activations_as_placed, weight_copy_bytes
from .placement import plan_inputs, usable_device_bytes
from .switch import stock_bytes, why_not_stock


@dataclass(frozen=True)
class Replan:
    """Move blocks: these weights paged, these activations paged, these blocks recomputed in
    backward; the others not."""

    paged: list
    act_paged: list
    recompute: list = ()


@dataclass(frozen=True)
class SwitchToStock:
    """Train on with torch's fused AdamW on the device: everything fits there."""

    need: dict  # device bytes of stock training, by class


class PeakTimeline:
    """The measured device peak of every step, in at most CAPACITY points. When full, each
    pair of neighbouring points merges into the larger of the two and from then on a point
    stands for twice as many steps: a long run keeps its whole span, and no spike is lost."""

    CAPACITY = 4096  # even: a merge leaves whole pairs and the newest point

    def __init__(self):
        self.points: list = []  # [step, peak bytes]: the largest peak of its `span` steps, at its step
        self.span = 1  # steps per point
        self._open = 0  # steps the newest point stands for so far

    def add(self, step: int, peak) -> None:
        """Step `step` (1-based) peaked at `peak` bytes; None: not measured (the CPU backend)."""
        if peak is None:
            return
        if self.points and self._open < self.span:
            self._open += 1
            if peak > self.points[-1][1]:
                self.points[-1] = [step, peak]
            return
        self.points.append([step, peak])
        self._open = 1
        if len(self.points) > self.CAPACITY:
            last = self.points.pop()  # the newest point, one step: it opens the first wider point
            pairs = zip(self.points[0::2], self.points[1::2])
            self.points = [max(a, b, key=lambda p: p[1]) for a, b in pairs] + [last]
            self.span *= 2


class Adapter:
    SETTLE_STEPS = 3
    SWITCH_AFTER = 2
    TIMED_PASSES = 2
    SETTLED_MARGIN = 0.1  # a settled block's mode changes only for a plan predicted this much faster
    AFTER_STACK_SHARE = 0.4  # of the usable memory, kept by the first pass's guard for what runs after the stack

    def __init__(
        self, backend, opts, block_units, outside_units, meter, profile, unpageable, on_device, events, averaging=0
    ):
        """`averaging`: the device bytes data parallel's gradient buckets would hold after the
        switch to stock (StockGradients; 0 where they stay on the host)."""
        self.backend = backend
        self.averaging = averaging
        self.opts = opts
        self.block_units = block_units  # read: the placement as the engine applied it
        self.outside_units = outside_units
        self.meter = meter  # the saved-activation counts (measure.py)
        self.events = events
        self.history: list = []  # every decision with its numbers (memory_report's plan["history"])
        self.peak_timeline = PeakTimeline()  # each step's measured peak (memory_report's peaks["per_step"])
        self.steps = 0  # optimizer steps seen
        self.profile = profile
        self.unpageable = unpageable
        self.usable = usable_device_bytes(opts, profile, on_device)
        self.correction = 0  # measured peak minus predicted (bytes), from the last step
        self.after_stack = 0  # bytes the head and the loss add above the stack's end (largest seen)
        self.after_stack_measured = False  # a step has ended on a device that counts its peak
        self.after_stack_provisional = False  # taken from a peak set before this run (see after_step)
        self.held_after_stack = 0  # of that, still allocated when backward reaches the stack (largest seen)
        self.after_stack_bound = 0  # the last head-peak pass's rise plus what it freed before backward
        self._fwd_end = None  # allocated when this pass's model forward returned
        self._bwd_start = None  # allocated when this pass's backward started
        self.step_peak = 0  # the largest sample since the step began (every micro-batch's pass)
        self.stack_end = None  # allocated when this pass's last block ended
        self._peak_at_step_start = None  # the device's peak counter when the step's first pass began
        self._peak_at_stack_end = None
        self._head_open = False  # the stack has ended, backward has not reached it yet
        self._enter_alloc = 0
        self._enter_fetched = 0
        self._pass_act = 0  # largest growth of a block in this pass, its weight fetches taken off
        self._pass_growth = 1.0  # largest growth / measured activations of a block in this pass
        self.block_s: dict = {}  # block -> fastest forward measured (seconds)
        self._timing: dict = {}  # block -> (start, end) events or times of this pass
        self.block_backward_s: dict = {}  # block -> fastest backward measured, its asides taken off (seconds)
        # block -> [start, end, asides] of this timed pass's backward: marks, and the (start, end)
        # marks of what ran inside it that is not its backward's compute (see aside_begins)
        self._backward_timing: dict | None = None
        self._backward_open = None  # the entry of the block whose backward runs now
        self._aside = False  # an aside of the open block is being timed
        self.timed_passes = 0
        # Host bytes the activation pager holds in slabs (the engine sets it): a pass that grew
        # them pinned fresh host memory inside its forward, which its times would count.
        self.slab_bytes = lambda: 0
        self._slabs_at_pass = 0
        self.passes = 0  # training forward passes seen
        self._guarded: list = []  # blocks the guard paged in this pass (its history entry's list)
        self._guard_recomputed: list = []  # blocks the guard chose to recompute in this pass
        self.settled_modes: dict = {}  # block -> "page" / "recompute", as replans on timed forwards chose
        self.backward_bytes: dict = {}  # block -> what its backward allocated beside its activations (largest)
        self._backward_mark = None  # (unit, allocated, peak counter, fetched bytes) as its backward began
        self.compute_dtype = None  # the autocast dtype the first pass ran under
        self.weights_auto = opts.param_offload == "auto"
        self.acts_auto = opts.activation_offload == "auto"
        self.backward_per_forward = backward_per_forward(block_units)  # the estimate, until backward is timed

    # -- measuring -------------------------------------------------------------------------------

    def counters(self):
        """The allocator's counters, {"current": bytes allocated now, "peak": the device's peak
        counter}, in one read; None where they cannot be measured (the CPU backend). Each
        measuring point reads them once (a read of the allocator's statistics costs tens of
        microseconds on a GPU, and the points run at every block boundary)."""
        backend = self.backend
        return backend.allocated() if backend.is_cuda else None

    def allocated(self):
        """Device bytes allocated now; None where it cannot be measured (the CPU backend)."""
        counters = self.counters()
        return None if counters is None else counters["current"]

    def device_peak(self):
        counters = self.counters()
        return None if counters is None else counters["peak"]

    def sample(self, now=None) -> None:
        """Raise the step's peak to what is allocated (`now`, when the caller just read it)."""
        now = self.allocated() if now is None else now
        if now is not None and now > self.step_peak:
            self.step_peak = now

    def new_pass(self) -> None:
        self._close_guard()
        self.passes += 1
        timed = self.passes > 1 and self.timed_passes < self.TIMED_PASSES
        self._pass_act = 0
        self._pass_growth = 1.0
        self.stack_end = None
        self._head_open = False
        self._fwd_end = self._bwd_start = None
        if self._peak_at_step_start is None:
            self.step_peak = 0
            self._peak_at_step_start = self.device_peak()
        self.sample()
        self._timing = {} if timed else None
        self._backward_timing = {} if timed else None
        if timed:
            self._slabs_at_pass = self.slab_bytes()
        self._backward_open, self._aside = None, False
        if self.compute_dtype is None and torch.is_autocast_enabled(self.backend.device.type):
            self.compute_dtype = torch.get_autocast_dtype(self.backend.device.type)

    def block_starts(self, unit, fetched_bytes: int) -> str | None:
        """Forward (grad enabled, not a recompute) of `unit` is about to run; `fetched_bytes`:
        the weights fetched since wrap(). The guard's answer: "page" (this block's activations
        go to host memory), "recompute" (its forward runs again in backward) or None."""
        now = self.allocated()
        self.sample(now)
        self._enter_alloc = now
        self._enter_fetched = fetched_bytes
        if now is None or not self.acts_auto or unit.act_paged or unit.recompute:
            return None
        return self._guard(unit, now)

    def forward_begins(self, unit) -> None:
        """`unit`'s weights are there (the compute stream waits for their copy and update
        before this point): its forward's time starts here, recomputed in backward or not. A
        wait for weights is PCIe time, which the plan counts apart; counted as compute too, it
        would hide activation paging's PCIe time under a compute that is not there."""
        if self._timing is not None:
            self._timing[unit.block] = [self._mark(), None]

    def block_ends(self, unit, fetched_bytes: int) -> None:
        counters = self.counters()
        now = None if counters is None else counters["current"]
        self.sample(now)
        if now is not None and self._enter_alloc is not None and not unit.act_paged and not unit.recompute:
            # Weights fetched during the block (its own, the next block's ahead) are not activations.
            fetched = fetched_bytes - self._enter_fetched
            grown = now - self._enter_alloc - fetched
            self._pass_act = max(self._pass_act, grown)
            measured = activations_as_placed(self.meter, unit, unit.paged)
            if measured:
                # Autocast also holds copies of resident trainable weights that backward does not
                # keep (a Linear whose input needs no gradient): growth, but not activations.
                unsaved = 0
                if not unit.paged and torch.is_autocast_enabled(self.backend.device.type):
                    unsaved = max(weight_copy_bytes(unit.trainable) - self.meter.activation_cast.get(unit.block, 0), 0)
                self._pass_growth = max(self._pass_growth, (grown - unsaved) / measured)
        if self._timing is not None and unit.block in self._timing:
            self._timing[unit.block][1] = self._mark()
        if now is not None and unit is self.block_units[-1]:
            self.stack_end, self._peak_at_stack_end, self._head_open = now, counters["peak"], True

    def forward_returns(self) -> None:
        """The model's forward returned (autocast, if any, still holds its copies)."""
        if self._head_open:
            self._fwd_end = self.allocated()

    def backward_starts(self, grad_bytes: int) -> None:
        """The first gradient of the model's output (`grad_bytes` of it, allocated just now and
        not freed memory's doing: the logits' gradient, when the loss is computed outside the
        model): backward has begun."""
        if self._head_open and self._fwd_end is not None and self._bwd_start is None:
            self._bwd_start = self.allocated() - grad_bytes

    def planned_after_stack(self) -> int:
        """What the plan, the guard and the stock-training cost count after the stack."""
        return max(self.after_stack, self.after_stack_bound)

    def backward_reaches_stack(self) -> None:
        """Backward has come through the head and the loss to the last block."""
        counters = self.counters()
        if counters is None:
            return  # nothing measured (the CPU backend)
        now = counters["current"]
        self.sample(now)
        if self._head_open:
            self.held_after_stack = max(self.held_after_stack, now - self.stack_end)
        self._close_head(counters["peak"])

    def _close_head(self, peak) -> None:
        """If the device's peak rose since the stack's end, the new peak is what ran after the
        stack (or, read at the step's end without a backward hook, that and backward: more,
        which errs on the safe side). Otherwise it stayed below an earlier peak: nothing learnt."""
        if not self._head_open:
            return
        self._head_open = False
        if peak > self._peak_at_stack_end:
            rise = peak - self.stack_end
            self.after_stack = rise if self.after_stack_provisional else max(self.after_stack, rise)
            self.after_stack_measured, self.after_stack_provisional = True, False
            freed = 0
            if self._fwd_end is not None and self._bwd_start is not None:
                freed = max(self._fwd_end - self._bwd_start, 0)
            self.after_stack_bound = rise + freed

    def block_backward_starts(self, unit, fetched_bytes: int) -> None:
        """Backward has reached `unit` (the block after it done, its memory let go): the block
        before closes its measure and its backward's time, this one opens its own measure
        (its time opens at backward_begins, once its weights are there)."""
        counters = self.counters()  # one read: the block before's close and this one's mark
        self._close_backward_block(fetched_bytes, counters)
        self._end_backward_time()
        if counters is not None:
            self._backward_mark = (unit, counters["current"], counters["peak"], fetched_bytes)

    def backward_ends(self, fetched_bytes: int) -> None:
        """The backward pass is done: the last block's measure closes (what runs after it, the
        optimizer's step, the next pass, is not its backward)."""
        self._close_backward_block(fetched_bytes)
        self._end_backward_time()

    def backward_begins(self, unit) -> None:
        """`unit`'s weights are there for its backward (the compute stream waits for their copy
        before this point) and its paged activations' copies are queued: its backward's time
        starts here, as its forward's starts at forward_begins (a wait for weights is PCIe time,
        which the plan counts apart). It ends as backward reaches the block below, or the pass ends."""
        if self._backward_timing is not None:
            self._backward_open = self._backward_timing[unit.block] = [self._mark(), None, []]

    def aside_begins(self):
        """What runs from here to aside_ends inside the open block's backward is not its
        backward's compute: its recompute's forward (the plan counts that as the block's
        forward_s, apart) or a wait for its paged activations' copy (PCIe time). Returns the
        mark to hand to aside_ends; None when nothing is timed (or an aside is already open:
        it holds this one)."""
        if self._backward_open is None or self._aside:
            return None
        self._aside = True
        return self._mark()

    def aside_ends(self, start) -> None:
        if start is None:
            return
        self._aside = False
        if self._backward_open is not None:
            self._backward_open[2].append((start, self._mark()))

    def _end_backward_time(self) -> None:
        if self._backward_open is not None:
            self._backward_open[1] = self._mark()
            self._backward_open = None

    def _close_backward_block(self, fetched_bytes: int | None = None, counters=None) -> None:
        """If the device's peak rose during the marked block's backward, the rise above what
        was allocated as it began is that backward's: its recompute (when recomputed), its
        gradients, and the next block's weights and paged activations coming in (taken off).
        Under an earlier peak nothing is learnt, nor for a block whose own paged activations
        arrive around the mark. What is left is the plan's backward_bytes for the block (the
        weight gradients are counted there already: one block's, in the fixed part). `counters`:
        the allocator's, when the caller just read them."""
        mark, self._backward_mark = self._backward_mark, None
        if mark is None:
            return
        unit, start, peak_then, fetched_then = mark
        peak = counters["peak"] if counters is not None else self.device_peak()
        if peak is None or peak <= peak_then or unit.act_paged:
            return
        rise = peak - start
        if fetched_bytes is not None:
            rise -= fetched_bytes - fetched_then
        # A block not measured (recomputed from the first pass on) as the largest measured, as the plan counts it.
        largest = max(self.meter.activation_bytes.values(), default=0)
        if unit.recompute:  # its activations came back inside its backward
            rise -= activations_as_placed(self.meter, unit, unit.paged) or largest
        depth = self.opts.prefetch_depth
        earlier = self.block_units[max(unit.block - depth, 0) : unit.block]
        rise -= sum(activations_as_placed(self.meter, u, u.paged) or largest for u in earlier if u.act_paged)
        rise -= sum(s.nbytes for s in unit.trainable)
        if rise > self.backward_bytes.get(unit.block, 0):
            self.backward_bytes[unit.block] = rise

    def _mark(self):
        backend = self.backend
        if backend.is_cuda:
            event = torch.cuda.Event(enable_timing=True)  # the engine's own events are untimed (cheaper)
            event.record(backend.compute_stream())
            return event
        return time.perf_counter()

    def _collect_times(self) -> None:
        """Read this timed pass's marks (after the step: no host sync inside it)."""
        backward, self._backward_timing, self._backward_open = self._backward_timing, None, None
        if not self._timing:
            return
        if self.slab_bytes() > self._slabs_at_pass:
            # The pass pinned new activation slabs between its marks (the first pass that
            # pages them): that is host work the GPU waited through, seconds on a 7B, not a
            # block's compute (a forward read 296 ms where 6 ms is its own). The next pass is
            # timed instead.
            self._timing = None
            self.record("timing", "a pass that pinned new activation slabs is not timed; the next one is")
            return
        for block, (start, end) in self._timing.items():
            if end is not None:
                s = _elapsed(start, end)
                self.block_s[block] = min(s, self.block_s.get(block, s))
        for block, (start, end, asides) in (backward or {}).items():
            if end is not None:
                s = max(_elapsed(start, end) - sum(_elapsed(a, z) for a, z in asides), 0.0)
                self.block_backward_s[block] = min(s, self.block_backward_s.get(block, s))
        self._timing = None
        self.timed_passes += 1

    def forward_s(self, block: int) -> float | None:
        """One forward of `block`: as timed, else the median of the blocks timed (None: none)."""
        if block in self.block_s:
            return self.block_s[block]
        if not self.block_s:
            return None
        return _median(self.block_s.values())

    def backward_ratio(self) -> float:
        """Backward's compute per forward's: the median timed block backward over the median
        timed forward (a block's recompute and its waits taken off: backward_begins, aside_begins),
        else the estimate from the trainable share (backward_per_forward), until both are timed."""
        if self.block_backward_s and self.block_s:
            forward = _median(self.block_s.values())
            if forward > 0:
                return _median(self.block_backward_s.values()) / forward
        return self.backward_per_forward

    def compute_s(self) -> float:
        """Forward + backward of the stack: each block's forward as the median timed, and
        backward_ratio() forwards for its backward."""
        if not self.block_s:
            return 0.0
        return (1.0 + self.backward_ratio()) * _median(self.block_s.values()) * len(self.block_units)

    # -- the online guard --------------------------------------------------------------------------

    def _guard(self, unit, now: int) -> str | None:
        """Take `unit`'s activations off the device ("page" or "recompute", see _off_device)?
        When what is allocated `now`, the activations the rest of the pass will save and what
        runs after the stack would pass the usable memory."""
        meter = self.meter
        measured = meter.activation_bytes
        per_block = max(self._pass_act, max(measured.values(), default=0))
        if per_block == 0:
            return False
        # The activations the rest of the pass will save: each block's measured bytes as placed
        # now, grown as much as this pass's blocks have grown over theirs (a longer sequence
        # than measured); a block not measured yet, as the largest seen. A block whose
        # activations are paged or recomputed still holds autocast's copies of its resident
        # weights; a recomputed one, its inputs too.
        later = self.block_units[unit.block :]
        rest_units = [u for u in later if not u.act_paged and not u.recompute]
        kept = sum(int(activations_as_placed(meter, u, u.paged) * self._pass_growth) or per_block for u in rest_units)
        off = sum(meter.activation_cast.get(u.block, 0) for u in later if (u.act_paged or u.recompute) and not u.paged)
        off += sum(int(meter.activation_inputs.get(u.block, 0) * self._pass_growth) for u in later if u.recompute)
        rest = kept + off
        if self.after_stack_measured:
            after_stack = self.planned_after_stack()
        else:
            # Before a step has shown what runs after the stack (the head's logits, the loss and
            # their gradients, which can be a large part of the step's peak), a share of the
            # usable memory is kept for it, and a block's gradients.
            after_stack = int(self.AFTER_STACK_SHARE * self.usable) + max(u.nbytes for u in self.block_units)
        projected = now + rest + after_stack
        if projected <= self.usable:
            return None
        choice, why = self._off_device(unit, per_block)
        if choice == "recompute":
            # A recomputed block keeps its inputs to its backward, a paged one keeps nothing:
            # where those inputs do not fit beside what the rest of the pass keeps off the
            # device and what runs after the stack, and nothing would (paged), it is paged
            # (blocks recomputed one after the other each keep theirs: 35 x 32 MiB under the
            # 1.9B GPT's 4 GiB cap, past it in the head's backward).
            floor = now + off + after_stack + (meter.activation_cast.get(unit.block, 0) if not unit.paged else 0)
            inputs = int(meter.activation_inputs.get(unit.block, 0) * self._pass_growth)
            if floor + inputs > self.usable >= floor:
                choice = "page"
                why = (
                    f"its inputs ({inputs / GiB:.3f} GiB), kept until its backward if recomputed, would not fit "
                    "beside what runs after the stack; paged, it keeps none"
                )
        guarded = self._guard_recomputed if choice == "recompute" else self._guarded
        guarded.append(unit.block)
        if len(guarded) == 1:  # one entry per pass and choice; the blocks after this one join its list
            what = "recomputed in backward" if choice == "recompute" else "activations paged during the pass"
            self.record(
                "guard",
                f"block {unit.block}: {what} (allocated "
                f"{now / GiB:.2f} GiB + {len(rest_units)} blocks' activations {rest / GiB:.2f} GiB + "
                f"{after_stack / GiB:.2f} GiB after the stack would pass {self.usable / GiB:.2f} GiB "
                f"usable; {why})",
                allocated=now,
                projected=projected,
                blocks=guarded,
                choice=choice,
            )
        return choice

    def _off_device(self, unit, per_block: int) -> tuple[str, str]:
        """The guard's choice for a block whose activations leave the device, "recompute" or
        "page", and why: the cheaper of its forward again (in backward) and its activations' way
        out in forward plus their way back in for backward, as the plan's phases count them
        (paging_cost_s); with no forward timed yet, recompute ([Note: recompute before timing]
        in planner/plan.py)."""
        acts = activations_as_placed(self.meter, unit, unit.paged) or per_block
        inputs = self.meter.activation_inputs.get(unit.block)
        if inputs is not None and inputs >= acts - self.meter.activation_cast.get(unit.block, 0):
            return "page", f"recomputing would keep as much: its inputs are {inputs / GiB:.3f} GiB"
        forward = self.forward_s(unit.block)
        if forward is None:
            return "recompute", (
                "no forward timed yet: recomputing needs no pinned host memory, paging pins it for every block"
            )
        h2d, d2h = self.profile.h2d_bytes_per_s, self.profile.d2h_bytes_per_s
        paging = paging_cost_s(acts, h2d, d2h)
        numbers = (
            f"forward {forward * 1e3:.2f} ms, paging {acts / GiB:.3f} GiB {acts / d2h * 1e3:.2f} ms out in "
            f"forward + {acts / h2d * 1e3:.2f} ms in for backward"
        )
        if forward <= paging:
            return "recompute", f"recomputing is cheaper: {numbers}"
        return "page", f"paging is cheaper: {numbers}"

    def _close_guard(self) -> None:
        """End of a pass: say how many blocks the guard paged or recomputed in it, when more than one."""
        if len(self._guarded) > 1:
            self.events.add(
                f"the guard paged the activations of {len(self._guarded)} blocks in that pass: {_ranges(self._guarded)}"
            )
        if len(self._guard_recomputed) > 1:
            self.events.add(
                f"the guard chose to recompute {len(self._guard_recomputed)} blocks in that pass: "
                f"{_ranges(self._guard_recomputed)}"
            )
        self._guarded = []
        self._guard_recomputed = []

    # -- after each step -----------------------------------------------------------------------------

    def _inputs(self, correction: int, settled: bool = True):
        """The planner's inputs from what was measured; `settled`: with the modes replans on
        timed forwards chose ([Note: settled modes] in planner/plan.py)."""
        inputs = plan_inputs(
            self.opts,
            self.block_units,
            self.outside_units,
            self.unpageable,
            self.profile,
            self.usable,
            act_bytes=self.meter.activation_bytes or None,
            act_cast=self.meter.activation_cast,
            act_inputs=self.meter.activation_inputs,
            forward_s=self.block_s,
            after_stack=self.planned_after_stack(),
            held_after_stack=self.held_after_stack,
            compute_s=self.compute_s(),
            correction=correction,
            compute_dtype=self.compute_dtype,
        )
        if settled:
            inputs.settled = dict(self.settled_modes)
        inputs.backward_per_forward = self.backward_ratio()
        fallback = max(self.backward_bytes.values(), default=0)  # a block whose backward set no peak
        for x, u in zip(inputs.blocks, self.block_units):
            x.backward_bytes = self.backward_bytes.get(u.block, fallback)
            x.recomputable = u.no_recompute is None
        return inputs

    def _plan(self, correction=None):
        """The plan for the next steps. Blocks keep the modes replans on timed forwards chose
        ([Note: settled modes] in planner/plan.py), unless that costs the fit, or the plan
        free to choose again is faster by more than SETTLED_MARGIN: the times a choice is
        measured under move a little with it (its waits, its copies), and never undo it.
        `correction`: bytes added to every prediction (default: the adapter's, never below 0)."""
        correction = self.correction if correction is None else correction
        held = make_plan(self._inputs(correction))
        if not self.settled_modes:
            return held
        free = make_plan(self._inputs(correction, settled=False))
        if not held.fits or (free.fits and free.step_s < (1.0 - self.SETTLED_MARGIN) * held.step_s):
            return free
        return held

    def current(self) -> tuple:
        units = self.block_units
        return [u.block for u in units if u.paged], [u.block for u in units if u.act_paged]

    def recomputed(self) -> list:
        return [u.block for u in self.block_units if u.recompute]

    def after_step(self, stock_allowed: str | None):
        """A step was taken: measure, and decide. Returns a Replan, a SwitchToStock or None.
        `stock_allowed`: None if the run may switch to stock training, else why not."""
        self.steps += 1
        self._close_guard()
        backward_timed = bool(self.block_backward_s)
        self._collect_times()
        if self.block_backward_s and not backward_timed:
            self._say_backward_timed()
        self.sample()
        observed = None
        whole = False  # observed is this step's peak, not a lower bound of it (see below)
        peak = self.device_peak()
        step_start, self._peak_at_step_start = self._peak_at_step_start, None
        if peak is not None and step_start is not None:  # a device that counts its peak; a forward ran
            self._close_head(peak)
            if not self.after_stack_measured:
                # The peak never rose after the stack's end: a higher one was set before (the
                # model on the device before wrap()). Taking it as the head's errs on the safe
                # side, until a step measures the head (the value is replaced then, not maxed).
                self.after_stack = max(peak - (self.stack_end if self.stack_end is not None else self.step_peak), 0)
                self.after_stack_measured = self.after_stack_provisional = True
            if peak > step_start:
                observed = peak  # the counter rose during this step: its value is this step's peak
                whole = True
            else:
                # This step stayed below an earlier peak: its own, as sampled, and as the head adds
                # at the stack's end (not a provisional figure: that is the earlier peak, not this
                # step's).
                observed = self.step_peak
                if self.stack_end is not None and not self.after_stack_provisional:
                    observed = max(observed, self.stack_end + self.after_stack)
                    whole = True  # else sampled at boundaries only: the head's peak is missing
        self.peak_timeline.add(self.steps, observed)
        if self.steps == self.SWITCH_AFTER and self.opts.offload == "auto":
            switch = self._stock_decision(stock_allowed, observed)
            if switch is not None:
                return switch
        if not (self.weights_auto or self.acts_auto) or not self.meter.activation_bytes:
            return None
        paged, act_paged = self.current()
        recompute = self.recomputed()
        predicted = device_bytes(self._inputs(0), set(paged), set(act_paged), set(recompute))
        if observed is not None:
            # Only ever added: a plan that predicts more than was measured stays as it is
            # (moving blocks in on a smaller correction can run out of memory).
            self.correction = max(observed - predicted, 0)
        settling = self.steps <= self.SETTLE_STEPS
        if not settling and (observed is None or observed <= self.usable):
            return None
        plan = self._plan()
        if not plan.fits and whole and observed < predicted:
            # Nothing is predicted to fit, and the prediction of the current placement was
            # measured too high: plan again with what it overstated taken off every
            # prediction (the 7B LoRA under 8 GiB: predicted 8.56 GiB where 7.22 was measured,
            # and about as much over every placement, so none "fit", and paging every activation,
            # predicted smallest, stepped in 0.87 s where recomputing 12 of them steps in 0.69 s).
            # Only here: where some placement fits as predicted, predictions keep their margin.
            calibrated = self._plan(self.correction + observed - predicted)
            if calibrated.fits:
                self.record(
                    "warning",
                    f"no placement is predicted to fit; with the current one's measured peak "
                    f"({_gib(observed)}) in place of its prediction ({predicted / GiB:.2f} GiB) one does",
                    observed=observed,
                    predicted=predicted,
                )
                plan = calibrated
        if not plan.fits and whole and observed <= self.usable:
            # A measured fit outranks a predicted misfit: "paging as much as possible" would
            # leave a placement known to fit for one only predicted smaller. Only a whole
            # measure counts: a peak sampled at block boundaries under an earlier, higher
            # counter (a model on the device before wrap()) misses the head's. The watchdog
            # still acts on a measured peak past the usable memory.
            self.record(
                "warning",
                f"no placement is predicted to fit (the smallest: {plan.device_bytes / GiB:.2f} of "
                f"{self.usable / GiB:.2f} GiB usable), but the current one measured {_gib(observed)}: kept",
                observed=observed,
                predicted=predicted,
            )
            return None
        new_paged = plan.paged if self.weights_auto else paged
        new_acts = plan.act_paged if self.acts_auto else act_paged
        new_rec = plan.recompute if self.acts_auto else recompute
        if not settling:  # the watchdog only pages more (a block off the device stays off it)
            new_paged = sorted(set(new_paged) | set(paged))
            off = set(new_acts) | set(new_rec)
            new_acts = sorted(set(new_acts) | {b for b in act_paged if b not in off})
            new_rec = sorted(set(new_rec) | {b for b in recompute if b not in off})
        if self.acts_auto and self.block_s:  # a choice on timed forwards: kept from now on
            self.settled_modes.update({b: "page" for b in new_acts})
            self.settled_modes.update({b: "recompute" for b in new_rec})
        if (new_paged, new_acts, new_rec) == (paged, act_paged, recompute):
            return None
        why = "settling" if settling else "watchdog: the step's peak passed the usable memory"
        self.record(
            "replan",
            f"{why}: measured peak {_gib(observed)}, predicted {predicted / GiB:.2f} GiB for "
            f"the current placement; new plan: {plan.describe(self.usable)}",
            observed=observed,
            predicted=predicted,
            correction=self.correction,
            paged=new_paged,
            act_paged=new_acts,
            recompute=new_rec,
            predicted_step_s=plan.step_s,
            fits=plan.fits,
        )
        if new_rec != recompute or (self.block_s and new_acts != act_paged):
            self._explain_leaving(plan, new_paged, new_acts, new_rec)
        if not plan.fits:
            self.record("warning", "no placement is predicted to fit; paging as much as possible")
        elif not plan.within_limit and (plan.act_paged or plan.recompute):
            self.record(
                "warning",
                f"activation paging and recompute needed to fit add {plan.act_slowdown:.0%} to the step, more "
                f"than max_activation_slowdown={self.opts.max_activation_slowdown}",
            )
        return Replan(new_paged, new_acts, new_rec)

    def _say_backward_timed(self) -> None:
        """The first timed backward: the ratio the plan splits the compute by from now on."""
        if not self.block_s:
            return
        forward, backward = _median(self.block_s.values()), _median(self.block_backward_s.values())
        self.record(
            "timing",
            f"backward timed: {self.backward_ratio():.2f} forwards per block (median {backward * 1e3:.2f} ms "
            f"against a forward's {forward * 1e3:.2f} ms; {self.backward_per_forward:.2f} estimated from the "
            "trainable share before)",
            forward_s=forward,
            backward_s=backward,
            backward_per_forward=self.backward_ratio(),
            estimated=self.backward_per_forward,
        )

    def _explain_leaving(self, plan, paged: list, acts: list, recompute: list) -> None:
        """Say which blocks' activations a replan takes off the device and how, each block with
        the costs weighed: its forward once more in backward against its activations' way out
        in forward and back in backward; and the step the plan predicts against paging every
        one of them and recomputing every one (history: the same per block)."""
        if not self.block_s:
            if recompute:
                self.events.add(
                    f"recompute: blocks {_ranges(recompute)} recomputed in backward (no forward timed yet: "
                    "recomputing needs no pinned host memory; the next replans weigh measured times)"
                )
            else:
                self.events.add("recompute: no block is recomputed from the next step on")
            return
        if not acts and not recompute:
            self.events.add(
                "recompute: no block is recomputed from the next step on; every block keeps its activations"
            )
            return
        inp = self._inputs(self.correction, settled=False)
        b, units = inp.blocks, self.block_units
        per_block, groups = {}, []
        for i in sorted(acts + recompute):
            x = b[i]
            mode = "recomputed" if i in recompute else "paged"
            numbers = dict(
                forward_s=x.forward_s or 0.0,
                out_s=x.act_bytes / inp.d2h_bytes_per_s,
                in_s=x.act_bytes / inp.h2d_bytes_per_s,
                act_bytes=x.act_bytes,
            )
            per_block[i] = dict(mode=mode, **numbers)
            text = (
                f"{mode}{'' if x.recomputable else ' (' + units[i].no_recompute + ')'}: forward "
                f"{numbers['forward_s'] * 1e3:.2f} ms again, against {x.act_bytes / MiB:.1f} MiB of activations "
                f"{numbers['out_s'] * 1e3:.2f} ms out in forward + {numbers['in_s'] * 1e3:.2f} ms in for backward"
            )
            if groups and groups[-1][1] == text and groups[-1][0][-1] == i - 1:
                groups[-1][0].append(i)
            else:
                groups.append(([i], text))
        leaving = sorted(acts + recompute)
        able = [i for i in leaving if b[i].recomputable]
        others = [i for i in leaving if not b[i].recomputable]

        def alternative(act_paged, recomputed) -> tuple:
            step = placement_terms(inp, paged, act_paged, recomputed)["step"]
            return step, device_bytes(inp, set(paged), set(act_paged), set(recomputed)) <= self.usable

        all_paged, all_recomputed = alternative(leaving, []), alternative(others, able)

        def said(alt) -> str:
            return f"{alt[0] * 1e3:.1f} ms{'' if alt[1] else ' (does not fit)'}"

        if recompute:
            head = f"recompute: blocks {_ranges(recompute)} recomputed in backward"
            head += f", blocks {_ranges(acts)} paged" if acts else ""
        else:
            head = "recompute: no block is recomputed from the next step on"
            head += f"; blocks {_ranges(acts)} paged" if acts else ""
        t = plan.terms
        message = (
            f"{head}. Per block: "
            + "; ".join(f"{_ranges(g)} {text}" for g, text in groups)
            + f". Predicted step {plan.step_s * 1e3:.1f} ms (forward {t['forward'] * 1e3:.1f} then backward "
            f"{t['backward'] * 1e3:.1f}); all {len(leaving)} paged: {said(all_paged)}; all recomputed"
            f"{' that may be' if others else ''}: {said(all_recomputed)}"
        )
        self.record(
            "recompute",
            message,
            per_block=per_block,
            predicted_step_s=plan.step_s,
            all_paged_step_s=all_paged[0],
            all_recomputed_step_s=all_recomputed[0],
        )

    def _stock_decision(self, reason: str | None, observed) -> SwitchToStock | None:
        """offload='auto': switch to stock training if it fits; say why not otherwise."""
        if reason is None:
            reason = why_not_stock(self.meter, self.block_units)
        if reason is None:
            units = self.block_units + self.outside_units
            need = stock_bytes(units, self.meter, self.planned_after_stack(), self.averaging)
            total = sum(need.values())
            detail = ", ".join(f"{k} {v / GiB:.2f}" for k, v in need.items())
            if total > self.usable:
                reason = (
                    f"stock training would need {total / GiB:.2f} GiB ({detail}), {self.usable / GiB:.2f} GiB is usable"
                )
        if reason is not None:
            self.record("offload", f"offload='auto': staying in offload mode: {reason}")
            return None
        self.record(
            "switch",
            f"offload='auto': switching to torch.optim.AdamW(fused=True) on {self.backend.device}: "
            f"stock training needs {total / GiB:.2f} GiB ({detail}) of {self.usable / GiB:.2f} GiB usable",
            need=need,
            usable=self.usable,
            observed=observed,
        )
        return SwitchToStock(need)

    def applied(self, replan: Replan) -> None:
        self.record(
            "applied",
            f"weights paged for blocks {replan.paged}, activations for blocks {replan.act_paged}, "
            f"recomputed blocks {list(replan.recompute)}",
            paged=list(replan.paged),
            act_paged=list(replan.act_paged),
            recompute=list(replan.recompute),
        )

    def record(self, kind: str, message: str, **numbers) -> None:
        self.events.add(message)
        self.history.append(dict(step=self.steps, kind=kind, message=message, **numbers))


def backward_per_forward(units) -> float:
    """Backward's compute per forward's for these blocks: every matrix's input gradient (as much
    as its forward) and, for a trainable matrix, its weight gradient (as much again), weighed by
    the matrices' sizes. A LoRA on a frozen base is about 1, a full fine-tune 2; what has no
    weights (attention's scores, the norms) is taken to go as its neighbours do."""
    total = trainable = 0
    for u in units:
        for s in u.slots:
            if s.param.dim() >= 2:
                total += s.param.numel()
                trainable += s.param.numel() if s.param.requires_grad else 0
    return 1.0 + trainable / total if total else BACKWARD_PER_FORWARD


def _elapsed(start, end) -> float:
    """Seconds between two of Adapter._mark's marks (perf_counter times, or CUDA events)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _median(values) -> float:
    times = sorted(values)
    return times[len(times) // 2]


def _gib(n) -> str:
    return "unknown" if n is None else f"{n / GiB:.2f} GiB"


def _ranges(blocks: list) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10"."""
    runs = []
    for b in blocks:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    return ", ".join(str(a) if a == z else f"{a}-{z}" for a, z in runs)
