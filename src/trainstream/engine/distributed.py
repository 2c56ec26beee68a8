"""Data parallel over torch.distributed: the process groups, each unit's shard layout, the
gradient reduce-scatter and the weight all-gather (docs/distributed.md).

[Note: shards] Every trainable parameter of N elements is cut into `world` chunks of
c = ceil(N / world) elements; rank r owns elements [r*c, min((r+1)*c, N)) (empty for a
rank past the end). A unit's shard segment is its slots' chunks side by side (slot i at
`offset[i]`, c_i long, zero-padded), and its bucket is `world` segments, rank-major: a
reduce-scatter of the bucket gives each rank exactly its own segment, summed, and an
all-gather of the segments rebuilds every slot. The host AdamW then runs on each slot's
master_shard: the fp32 master of elements [lo:hi) alone, the only master this rank holds,
and the moments of each parameter are only its hi-lo elements: each rank keeps 1/world of
the fp32 master and of the moments, so N ranks on a machine hold one process's worth.

[Note: what a rank keeps whole] Of a trainable parameter, a rank keeps in full only the
weights its own forward and backward read, in the model's dtype: the device tensor of a
resident unit, and the host weights of a paged unit (which its fetches, its placeholder
and state_dict() read; under bf16 autocast a paged fp32 Linear also keeps the bf16 copy
its fetch sends). An fp32 model's paged unit therefore holds its full weights in fp32 on
the host: they are the model's own weights there, not a second master. Its gradients land
whole (the reduce-scatter reads them). After an update each rank rounds its fp32 shard to
the model's dtype (to nearest even, as the update writes a bf16 copy: one process's bits)
and the all-gather carries those, one per dtype of the unit's parameters, in the order of
the dtypes' names; a resident unit's land in `incoming` buffers its push takes to the
device, a paged unit's in its host weights, whose other copies are rounded from them. What
travels depends only on the model, never on this rank's paging: the collectives stay alike
on every rank ([Note: collective order]).

[Note: collective order] Collectives are matched by their order in a group, so every rank
must issue the same collectives in the same order. Reductions go in one fixed order, each
unit once per window: the reverse of forward order at first (blocks last to first, then the
modules outside the stack), and, where units are reduced as backward hands them on (no held
window), from the second window on the order rank 0's backward handed them on in the first
(the head before the last block, as backward makes them), which every rank adopts at the
first window's end: the order each rank's own backward hands units on is not the same on
every rank in general (an unused block), so no rank goes by its own. Each unit goes once,
whether this rank has gradients for it or not (zeros, marked absent in the unit's small
all-reduce of flags). Every decision taken from a reduction (skip a non-finite window,
which slots have a gradient, the clipping norm) reads only reduced values, so it is the
same on every rank. The all-gathers of new weights run on their own thread, on a group of
their own, in the order the updates were queued, which is the reduction order. Paging and
activation placement stay local: nothing in them communicates.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import math
import queue
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .hookpoints import grad_accumulator, in_autograd, tensors_in

# Collectives in flight (reductions issued, not yet waited for): each holds one bucket, the
# size of the largest unit's gradients in fp32.
INFLIGHT_BUCKETS = 2

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def process_group(distributed, where: str = "wrap()"):
    """The ranks to train over for wrap(distributed=...), or None to train alone. None:
    data parallel when an initialized process group has more than one rank; True: it must
    exist; False: never."""
    if distributed is False:
        return None
    ready = dist.is_available() and dist.is_initialized()
    if distributed is True and not ready:
        raise ValueError(
            f"{where}: distributed=True but no torch.distributed process group is initialized: call "
            "torch.distributed.init_process_group() first (torchrun sets its environment), or pass "
            "distributed=None (data parallel only when a group exists) or False (each rank alone)"
        )
    if not ready or (distributed is None and dist.get_world_size() == 1):
        return None
    return dist.group.WORLD


def _timeout_of(group) -> datetime.timedelta:
    """The timeout the user gave the process group, for the groups made from it (gloo keeps
    it on its backend; other backends fall back to torch's default)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError):
        return dist.distributed_c10d.default_pg_timeout


def _model_signature(units) -> list:
    """What every rank's model must agree on: each parameter's name, shape, dtype and
    whether it trains, in unit order."""
    return [(s.name, tuple(s.param.shape), str(s.dtype), s.trainable) for u in units for s in u.slots]


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """[Note: shards]: rank's elements [lo, hi) of a flat parameter of `numel` elements."""
    c = max(1, math.ceil(numel / world))
    return min(numel, rank * c), min(numel, (rank + 1) * c)


def assign_shards(units, rank: int, world: int) -> None:
    """Give every trainable slot this rank's shard (Slot.shard), before the plan sizes the host
    buffers (layout.host_buffers: the master is the shard's alone)."""
    for u in units:
        for s in u.slots:
            if s.trainable:
                s.shard = shard_range(s.param.numel(), rank, world)


def segment_numel(unit, world: int) -> int:
    """Elements of one rank's segment of `unit`'s bucket ([Note: shards]): each trainable
    slot's chunk, side by side."""
    return sum(max(1, math.ceil(s.param.numel() / world)) for s in unit.trainable)


@dataclass
class SlotShard:
    slot: object
    numel: int
    chunk: int  # c: elements per rank, the last rank's padded
    lo: int  # this rank's elements: [lo, hi) of the flat parameter
    hi: int
    offset: int  # where the chunk sits in the unit's segment


class UnitShards:
    """One unit's shard layout ([Note: shards]) and the buffers its reduction lands in."""

    def __init__(self, unit, rank: int, world: int, take=None):
        """`take(shape, dtype)`: where `reduced` comes from (optimizer_mode="gpu": the device
        update's arena, pinned on a GPU, as the kernel reads it there); by default plain host
        memory."""
        self.unit = unit
        self.world = world
        self.slots = []
        offset = 0
        for s in unit.trainable:
            n = s.param.numel()
            c = max(1, math.ceil(n / world))
            lo, hi = shard_range(n, rank, world)
            self.slots.append(SlotShard(s, n, c, lo, hi, offset))
            offset += c
        self.segment = offset  # elements of one rank's segment
        # The all-gathers' layouts ([Note: what a rank keeps whole]): per dtype of the slots,
        # in the order of the dtypes' names, (dtype, [(SlotShard, offset)], segment).
        self.gathers = []
        for dtype in sorted({sh.slot.dtype for sh in self.slots}, key=str):
            members, at = [], 0
            for sh in self.slots:
                if sh.slot.dtype == dtype:
                    members.append((sh, at))
                    at += sh.chunk
            self.gathers.append((dtype, members, at))
        make = take or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self.reduced = make((self.segment,), torch.float32).zero_()  # this rank's summed shard, which the update reads
        # The last window's update jobs (reading `reduced`) and its gather (reading the master
        # the next update writes): the next reduction waits for them.
        self.readers: list = []

    def pack(self, bucket: torch.Tensor, grads: dict) -> None:
        """Lay this rank's gradients (slot -> tensor; absent: zeros) into `bucket` rank-major."""
        rows = bucket.view(self.world, self.segment)
        for sh in self.slots:
            part = rows[:, sh.offset : sh.offset + sh.chunk]
            g = grads.get(sh.slot)
            if g is None:
                part.zero_()
                continue
            flat = g.reshape(-1)
            full = sh.numel // sh.chunk  # ranks whose chunk is whole
            part[:full].copy_(flat[: full * sh.chunk].view(full, sh.chunk))
            rest = sh.numel - full * sh.chunk
            if full < self.world:
                part[full:].zero_()
                if rest:
                    part[full, :rest].copy_(flat[full * sh.chunk :])

    def grad(self, sh: SlotShard) -> torch.Tensor:
        """The reduced gradient of this rank's elements of `sh`'s parameter (1-D)."""
        return self.reduced[sh.offset : sh.offset + (sh.hi - sh.lo)]

    def unpack(self, gathered: torch.Tensor, sh: SlotShard, into: torch.Tensor, offset=None, segment=None) -> None:
        """Every rank's chunk of `sh` from an all-gathered bucket into the flat `into` (a
        gather layout's `offset` and `segment`; by default the reduction's)."""
        offset = sh.offset if offset is None else offset
        segment = self.segment if segment is None else segment
        rows = gathered.view(self.world, segment)[:, offset : offset + sh.chunk]
        into.view(-1).copy_(rows.reshape(-1)[: sh.numel])


@dataclass
class Reduced:
    """A unit's reduction, waited for: which slots some rank had a gradient for, whether
    any rank's was not finite, whether some rank sent it for a pass it dropped ([Note: a
    pass some rank drops, host path]), and this rank's summed shard (shards.reduced)."""

    shards: UnitShards
    present: list  # per slot of shards.slots: some rank had a gradient this window
    finite: bool
    dropped: bool = False


class _Reduction:
    """A reduction in flight: its bucket's whole buffer, the reduce-scatter and the flags'
    all-reduce."""

    __slots__ = ("shards", "buffer", "work", "flags", "flags_work")

    def __init__(self, shards, buffer, work, flags, flags_work):
        self.shards, self.buffer, self.work, self.flags, self.flags_work = shards, buffer, work, flags, flags_work


class GatherHandle:
    """Done when a unit's update has run on this rank's shard and every rank's new shard has
    been gathered into the weights this rank keeps whole: what a resident unit's push and a
    paged unit's fetch wait for (the role of the host job's own handle without data parallel)."""

    def __init__(self):
        self._done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"trainstream: the all-gather of a unit's new weights failed: {self.error}") from (
                self.error
            )


def _give_back(group) -> None:
    """Destroy one of the engine's groups, unless the user's process group went first (its
    destruction takes every group with it)."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


class RankGroups:
    """The ranks one wrapped model trains over: two gloo groups over the process group's
    ranks, made at wrap() (reductions on the training thread, all-gathers on the gather
    thread: [Note: collective order]). gloo reduces host tensors, which is where the
    gradients land, whatever backend the default group has. Before anything else, every
    rank is checked to wrap the same model with the same settings (check_same_model)."""

    def __init__(self, group, units: list, settings: tuple = ()):
        """`settings`: the options that decide which collectives a window issues, which
        every rank must share as it shares the model."""
        self.user = group  # the user's: BucketAverage may reduce on the device over it (NCCL)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = _timeout_of(group)
        ranks = dist.get_process_group_ranks(group)
        self.reduce = dist.new_group(ranks, backend="gloo", timeout=self.timeout)
        self.gather = dist.new_group(ranks, backend="gloo", timeout=self.timeout)
        try:
            check_same_model(self.reduce, units, self.rank, self.world, settings)
        except BaseException:
            self.destroy()
            raise
        assign_shards(units, self.rank, self.world)

    def release_gather(self) -> None:
        """Give the gather group back (the switch to stock: StockGradients averages over the
        reduction group, or on the device over the user's). Once only; a local call, not a
        collective."""
        if self.gather is not None:
            _give_back(self.gather)
            self.gather = None

    def destroy(self) -> None:
        """Give both groups back: a refused wrap(), and unwrap(). Once only (the user's process
        group may be destroyed first at exit: then there is nothing left to give back)."""
        self.release_gather()
        if self.reduce is not None:
            _give_back(self.reduce)
            self.reduce = None

    def alike(self, yes: bool) -> bool:
        """Whether `yes` is the same on every rank (a collective)."""
        flags = torch.tensor([int(yes), -int(yes)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.reduce)
        return int(flags[0]) == -int(flags[1])  # the least equals the greatest

    def from_rank_zero(self, obj):
        """Rank 0's `obj` on every rank (pickled): what each rank decides from must agree."""
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.reduce, 0), group=self.reduce)
        return box[0]


class DataParallel:
    """The communication of one wrapped model across its ranks: every unit's shard layout,
    the reductions in flight and their buckets, and the gather thread."""

    def __init__(
        self, ranks: RankGroups, units: list, order: list, grad_of, check_finite: bool, learn: bool, take=None
    ):
        """`order`: the units in forward order; `grad_of(slot)`: this rank's window gradient
        of a slot on the host, or None if it has none; `check_finite`: flag non-finite
        gradients (wrap(nonfinite=) is not "ignore"); `learn`: units are offered as backward
        hands them on (no held window), so the first window's order is adopted
        ([Note: collective order]); `take`: where each unit's reduced shard comes from
        (UnitShards), in the order of `units`."""
        self.rank, self.world = ranks.rank, ranks.world
        self.reduce_group, self.gather_group = ranks.reduce, ranks.gather
        self.shards = {u: UnitShards(u, self.rank, self.world, take) for u in units if u.trainable}
        # [Note: collective order] the reverse of forward order: the order backward makes them.
        self.order = [u for u in reversed(order) if u in self.shards]
        self._learn = learn
        self._handed: list = []  # units in the order this rank offered them this window
        self.check_finite = check_finite
        self._grad_of = grad_of
        largest = max((sh.segment for sh in self.shards.values()), default=0) * self.world
        self._free = [torch.zeros(largest, dtype=torch.float32) for _ in range(INFLIGHT_BUCKETS)]
        self._offered: set = set()  # units with gradients on this rank this window
        self._next = 0  # position in self.order of the next unit to reduce
        self._open = False  # a window whose gradients are reduced here has begun and not been completed
        self._dropped_seen = False  # some reduction of this window came back marked dropped
        self._inflight: deque = deque()
        self._done: list = []  # finished reductions not yet returned (by ready() or drain())
        self.bytes_reduced = 0  # bytes this rank sent into the reductions, in total
        self.windows = 0  # windows reduced
        self._gatherer = _Gatherer(self.gather_group)
        # The thread holds the gatherer only, never this object: a model dropped without
        # unwrap() lets it go, and the thread ends with it.
        threading.Thread(target=self._gatherer.run, name="trainstream-allgather", daemon=True).start()
        weakref.finalize(self, self._gatherer.stop)

    @property
    def bytes_gathered(self) -> int:
        return self._gatherer.bytes_sent

    # -- shards --------------------------------------------------------------------------

    def shard_ranges(self) -> dict:
        """param -> (lo, hi): this rank's elements of each trainable parameter."""
        return {sh.slot.param: (sh.lo, sh.hi) for us in self.shards.values() for sh in us.slots}

    # -- reductions (the training thread) ---------------------------------------------------

    def begin(self) -> None:
        """A pass of a window whose gradients are reduced here has begun: on every rank alike,
        where backward reaches the model's outputs or at its first gradient. From then on a
        pass that raises on this rank completes the window's reductions (discard())."""
        self._open = True

    def offer(self, unit) -> None:
        """`unit`'s gradients for this window are in host memory on this rank: reduce it as
        soon as every unit before it in the reduction order has been."""
        if unit not in self.shards:
            return
        if unit not in self._offered:
            self._handed.append(unit)
        self._offered.add(unit)
        while self._next < len(self.order) and self.order[self._next] in self._offered:
            self._issue(self.order[self._next])

    def ready(self) -> list:
        """The reductions finished so far, in order (Reduced), waiting for none."""
        while self._inflight and self._inflight[0].work.is_completed() and self._inflight[0].flags_work.is_completed():
            self._done.append(self._finish(self._inflight.popleft()))
        out, self._done = self._done, []
        return out

    def drain(self) -> list:
        """The window ends: reduce every unit not reduced yet (zeros from this rank where it
        has no gradient) and wait for all. Returns every unit's Reduced that ready() has not
        returned, in order."""
        return self._complete(dropped=False)

    def _complete(self, dropped: bool) -> list:
        """Issue every unit not reduced yet in this window, from this rank's gradients or, for
        a pass this rank `dropped`, as zeros marked dropped; wait for all. The first window's
        order is adopted at its end unless some rank dropped it: every rank reads that from
        the same reduced flags, so they agree on the broadcast too."""
        self._open = False  # a collective that fails here is not issued again by discard()
        while self._next < len(self.order):
            self._issue(self.order[self._next], dropped=dropped)
        while self._inflight:
            self._done.append(self._finish(self._inflight.popleft()))
        out, self._done = self._done, []
        if self._learn and not self._dropped_seen:
            self._adopt_rank_zero_order()
            self._learn = False
        self._offered.clear()
        self._handed = []
        self._next = 0
        self._dropped_seen = False
        self.windows += 1
        return out

    def _adopt_rank_zero_order(self) -> None:
        """The first window's end (a collective): every rank takes, as the reduction order,
        the order rank 0's backward handed the units on in that window, the units it had no
        gradient for placed where the order so far had them (order_with_unseen): the real
        backward order, the same on every rank ([Note: collective order])."""
        merged = order_with_unseen(self._handed, self.order)
        box = [[self.order.index(u) for u in merged]]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.reduce_group, 0), group=self.reduce_group)
        self.order = [self.order[i] for i in box[0]]

    def discard(self) -> list:
        """A pass that raised on this rank. Where it had begun (begin()), its reductions are
        completed as drain() would, the units not sent yet as zeros marked dropped ([Note: a
        pass some rank drops, host path]); returns the Reduced that ready() has not returned,
        in order, for the caller to apply the units every rank sent before the exception.
        Where it had not begun (or was completed already) nothing of it is in flight and
        every count is reset: nothing to complete, returns []."""
        return self._complete(dropped=True) if self._open else []

    def _issue(self, unit, dropped: bool = False) -> None:
        self._next += 1
        shards = self.shards[unit]
        if not self._free:  # every bucket in flight: the oldest reduction frees one
            self._done.append(self._finish(self._inflight.popleft()))
        buffer = self._free.pop()
        bucket = buffer[: self.world * shards.segment]
        grads = {}
        if not dropped:  # a dropped pass's gradients are never read: zeros
            for sh in shards.slots:
                g = self._grad_of(sh.slot)
                if g is not None:
                    grads[sh.slot] = g
        shards.pack(bucket, grads)
        finite = not (self.check_finite and grads) or bool(torch.isfinite(bucket).all())
        bucket.div_(self.world)  # the mean over ranks, as DDP divides before its all-reduce
        for h in shards.readers:  # the last update, which read `reduced`, and its gather
            h.wait()
        shards.readers = []
        work = _reduce_scatter(shards.reduced, bucket, op=dist.ReduceOp.SUM, group=self.reduce_group, async_op=True)
        # Per slot: this rank has its gradient; then: not finite here; this rank drops the pass.
        flags = torch.tensor(
            [1.0 if sh.slot in grads else 0.0 for sh in shards.slots]
            + [0.0 if finite else 1.0, 1.0 if dropped else 0.0]
        )
        flags_work = dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.reduce_group, async_op=True)
        self.bytes_reduced += bucket.numel() * bucket.element_size()
        self._inflight.append(_Reduction(shards, buffer, work, flags, flags_work))

    def _finish(self, r: _Reduction) -> Reduced:
        r.work.wait()
        r.flags_work.wait()
        self._free.append(r.buffer)
        *present, not_finite, dropped = r.flags.tolist()
        if dropped:
            self._dropped_seen = True
        return Reduced(r.shards, [f > 0 for f in present], not_finite == 0, dropped > 0)

    def global_sq_norm(self, reduced: list) -> float:
        """The squared L2 norm of the window's reduced gradients across every rank."""
        mine = sum(float(torch.linalg.vector_norm(r.shards.reduced, dtype=torch.float64)) ** 2 for r in reduced)
        total = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.reduce_group)
        return float(total[0])

    # -- all-gathers (the gather thread) ----------------------------------------------------

    def gather(self, unit, jobs: list, updated) -> GatherHandle:
        """After `jobs` (this rank's update of its shards of `updated`, slots of `unit`) every
        rank's new shards into the weights this rank keeps whole ([Note: what a rank keeps
        whole]). Returns at once."""
        handle = GatherHandle()
        # The next reduction of the unit waits for both: the update reads `reduced`, and the
        # gather reads the master the next update writes (this rank's next forward orders that
        # only where it runs the unit).
        self.shards[unit].readers = list(jobs) + [handle]
        self._gatherer.queue.put((self.shards[unit], list(jobs), set(updated), handle))
        return handle

    # -- whole tensors (state dicts) ----------------------------------------------------------

    def full_tensor(self, shard: torch.Tensor, param, to_rank_zero: bool = False) -> torch.Tensor | None:
        """Every rank's elements of `param`-shaped state (this rank's: `shard`, 1-D) as one
        tensor of the param's shape (a collective: every rank calls it, in the same order and
        with the same `to_rank_zero`). `to_rank_zero`: a gather to rank 0 alone; every other
        rank only sends its chunk and gets None, never holding the whole tensor."""
        sh = next(sh for us in self.shards.values() for sh in us.slots if sh.slot.param is param)
        send = torch.zeros(sh.chunk, dtype=shard.dtype)
        send[: sh.hi - sh.lo].copy_(shard.reshape(-1))
        if to_rank_zero and self.rank != 0:
            dist.gather(send, None, dst=dist.get_global_rank(self.reduce_group, 0), group=self.reduce_group)
            return None
        recv = torch.empty(self.world * sh.chunk, dtype=shard.dtype)
        if to_rank_zero:
            chunks = list(recv.chunk(self.world))  # rank r's chunk lands at r * chunk, as the all-gather puts it
            dist.gather(send, chunks, dst=dist.get_global_rank(self.reduce_group, 0), group=self.reduce_group)
        else:
            _all_gather(recv, send, group=self.reduce_group)
        return recv[: sh.numel].view(param.shape).clone()

    def stop(self) -> None:
        """No more gathers: the thread ends once those queued are done."""
        self._gatherer.stop()

    def describe(self) -> str:
        moments = sum(sh.hi - sh.lo for us in self.shards.values() for sh in us.slots)
        total = sum(sh.numel for us in self.shards.values() for sh in us.slots)
        return (
            f"data parallel: rank {self.rank} of {self.world}; this rank updates {moments} of {total} trainable "
            f"elements and holds their fp32 master and moments only (its shard of every parameter); gradients "
            f"reduce-scattered and new weights all-gathered in the model's dtype over gloo, unit by unit"
        )


# [Note: averaging buckets] Where every rank keeps the whole of some trainable parameters
# (after the switch to stock, all of them; device state, the small trainable set that stays on
# the compute device, device_state.py), their gradients are averaged as DDP averages them: in
# buckets of parameters in a fixed order, the same on every rank (the reduction order, [Note:
# collective order], each unit's parameters last to first: about the order backward makes
# them), each bucket's all-reduce launched, asynchronously, once every one of its parameters
# has had its gradient accumulated in this pass, while the rest of backward goes on; the end of
# the pass launches the buckets left and waits for them all. Collectives are matched by their
# order, and which buckets are complete early differs between ranks (a parameter one rank has
# no gradient for holds its bucket until that rank's pass ends), so buckets go strictly in
# index order: bucket k only once 0..k-1 have gone. Every rank then issues the same all-reduces
# in the same order, each bucket once per pass averaged, whenever each goes; nothing else may
# be issued on the group between a pass's first launch and its end on one rank but not on
# another (the end launches what is left before anything else there communicates). What a
# bucket carries does not depend on when it goes: early only once each of its gradients is
# final for the pass ([Note: late gradients]), at the end every gradient is; a parameter with no gradient on
# this rank sends zeros and a flag of 0. The flags travel at the bucket's end, summed with it
# (not divided): a parameter whose flags sum to 0 stays None on every rank, as torch leaves it,
# and one some rank had gets the sum of each rank's gradient / world (zeros from the others):
# per element what one all-reduce of every gradient at the end of backward gives (with more
# than 2 ranks gloo may add the terms in another order: it picks the order by where an element
# sits in the tensor reduced). The sum an all-reduce gives is the same bits on every rank, so
# every decision read from the averages (not finite, the clipping norm) is alike everywhere.
# Which passes are averaged is the caller's: after the switch every pass (the mean of the
# sums, as DDP without no_sync), device state a window's last pass only (the sums stay local
# until then, as under DDP's no_sync).
#
# [Note: late gradients] A parameter used by several reentrant checkpoint segments gets a
# gradient in each segment's inner backward, and nothing tells the first from the last: its
# bucket may go with only part of the sum (DDP refuses this unless static_graph=True). So a
# bucket that went before another gradient of one of its parameters landed is flagged on that
# rank, and the last bucket, which only the pass's end launches, carries every rank's flags,
# summed; every rank then sends each flagged bucket again, in index order, from the final
# gradients, and keeps that average. Every rank issues the same collectives, and the result is
# what one all-reduce at the end of backward gives; a pass with no late gradient costs
# nothing more than holding the last bucket (backward's last gradients) to its end.
#
# [Note: a pass some rank drops] A backward that raises leaves its pass half sent: buckets
# launched during backward differ between ranks (a rank launches a bucket once its own
# gradients are in), so forgetting what went would leave every later all-reduce of one rank
# paired with another bucket of the other (gloo aborts once sizes differ; until then the data
# is mixed silently). So the rank that drops a pass begun on it completes its collectives as
# finish() would, writing nothing, and says so in the last bucket's tail; a rank whose backward
# ended reads that sum and raises instead of writing averages that hold a dropped pass's
# gradients, so the pass is dropped on every rank alike. A pass is begun where backward reaches
# the model's outputs (or at its first gradient), which every rank running the same model does
# alike; a rank that raised before that issues nothing, and a rank that never calls forward or
# zero_grad() again leaves the others to the group's timeout.
#
# [Note: a pass some rank drops, host path] The host path's reductions (DataParallel) go unit
# by unit in one order as each rank's backward hands units on, and with eager updates each
# rank applies a unit's shard once its reduction is back, during backward. A reduction comes
# back only when every rank has sent it, so what any rank applied of a pass that raised on
# another is a prefix, in the reduction order, of what the raising rank sent before the
# exception. The rank that raised completes the pass (discard(): the units it had not sent go
# as zeros, flagged dropped in their small all-reduce of flags), applies the units of that
# prefix still coming back, as the others do, and stops at the first flagged one; the others
# stop there too and raise at the window's end. So every rank keeps the updates of the units
# every rank sent before the exception, and drops the rest, as one process keeps a raised
# pass's eager updates queued before the exception (semantics.md), except in the first window,
# whose order (the reverse of forward order, not yet backward's) can hold back a unit handed on
# before the exception. A held window (clipping, accumulation) is dropped whole on every rank,
# as one process drops it: its reductions are every rank's from its first pass on (begin()),
# so an exception in any of its passes completes them, and the others' drain pairs with that.
#
# DDP's default bucket size (bucket_cap_mb=25): large enough that a collective's fixed cost is
# spread over many bytes, small enough that the first buckets fill, and go, early in backward.
# Counted in fp32, the dtype the buckets average in.
AVERAGING_BUCKET_BYTES = 25 * 2**20


def reduces_on_device(group, device: torch.device) -> bool:
    """Whether `group` all-reduces tensors on `device` there: NCCL for a CUDA device (the
    engine's own groups are gloo, which reduces host tensors)."""
    if device.type != "cuda":
        return False
    pairs = dict(pair.split(":") for pair in dist.get_backend_config(group).split(","))
    return pairs.get("cuda") == "nccl"


def stock_averaging_bytes(ranks, device: torch.device, units) -> int:
    """The device bytes StockGradients' buckets hold at the end of backward after the switch
    to stock: every trainable element (the host path's and device state's) in fp32 where the
    user's group reduces on the device, none where they are host copies (or without data
    parallel)."""
    if ranks is None or not reduces_on_device(ranks.user, device):
        return 0
    return 4 * sum(s.param.numel() for u in units for s in u.slots if s.trainable)


def averaging_buckets(params: list, bucket_bytes: int) -> list:
    """`params` cut, in order, into runs of at most `bucket_bytes` in fp32 (a larger
    parameter alone in its own)."""
    buckets, size = [], 0
    for p in params:
        if buckets and size + 4 * p.numel() <= bucket_bytes:
            buckets[-1].append(p)
            size += 4 * p.numel()
        else:
            buckets.append([p])
            size = 4 * p.numel()
    return buckets


def numel_of(params: list) -> int:
    return sum(p.numel() for p in params)


class BucketAverage:
    """The gradients of a fixed list of parameters, which every rank keeps whole, averaged
    over the ranks in buckets ([Note: averaging buckets]): landed() as each gradient is final
    for the pass, finish() at the pass's end. On `device` over `device_group` (the user's)
    where it reduces there (NCCL), else host copies over `host_group` (gloo)."""

    def __init__(self, host_group, device_group, params: list, device: torch.device):
        """`params`: every rank's same list, in the order backward makes them (about);
        `device`: where their gradients are made (the params may not be there yet)."""
        self.world = dist.get_world_size(host_group)
        self.params = list(params)
        # The same on every rank, or the collectives of the two groups would never pair.
        self.on_device = agree(host_group, reduces_on_device(device_group, device))
        self.device = device if self.on_device else torch.device("cpu")
        self.group = device_group if self.on_device else host_group
        self.buckets = averaging_buckets(self.params, AVERAGING_BUCKET_BYTES)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.bytes_sent = 0  # what this rank sent into the all-reduces, in total
        self._new_pass()

    def _new_pass(self) -> None:
        self._missing = [len(b) for b in self.buckets]  # of each bucket, the gradients not landed this pass
        self._landed: set = set()  # ids of the params landed this pass
        self._late: set = set()  # buckets that went before a second gradient of one of theirs landed
        self._next = 0  # the next bucket to launch (strictly in order)
        self._inflight: list = []  # [bucket index, buffer, work] launched this pass
        self._open = False  # a pass averaged here has begun (begin()) and not been completed

    def begin(self) -> None:
        """A pass whose gradients are averaged here has begun (on every rank alike: the owner
        calls it where backward reaches the model's outputs, or at the first gradient)."""
        self._open = True

    def landed(self, param) -> None:
        """`param`'s gradient is final for this pass, as far as anyone can tell: launch every
        bucket now complete whose predecessors have all gone, except the last, which finish()
        launches ([Note: late gradients]). A second gradient of `param` in the same pass (a
        parameter used by several reentrant checkpoint segments) is summed into p.grad by
        autograd; its bucket reads the sum if it has not gone yet, else is sent again."""
        b = self._bucket_of[id(param)]
        if id(param) in self._landed:
            if b < self._next:
                self._late.add(b)
            return
        self._landed.add(id(param))
        self._missing[b] -= 1
        while self._next < len(self.buckets) - 1 and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int, tail: list | None = None) -> None:
        """All-reduce bucket `b` from the gradients as they are now (asynchronously); `tail`:
        flags carried at its end (the last bucket's: _complete)."""
        bucket, tail = self.buckets[b], tail or []
        numel = numel_of(bucket)
        buffer = torch.empty(numel + len(bucket) + len(tail), dtype=torch.float32, device=self.device)
        at = 0
        for p in bucket:
            part = buffer[at : at + p.numel()]
            at += p.numel()
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.detach().reshape(-1))
        buffer[:numel].div_(self.world)  # the mean over ranks, as DDP divides before its all-reduce
        flags = [0.0 if p.grad is None else 1.0 for p in bucket] + tail
        buffer[numel:].copy_(torch.tensor(flags))
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self.bytes_sent += buffer.numel() * buffer.element_size()
        self._inflight.append([b, buffer, work])

    def _complete(self, dropped: bool) -> bool:
        """Issue what is left of the pass's collectives and wait for them all: the buckets not
        launched yet, the last with every rank's late flags and a flag saying this rank drops
        the pass, then (unless some rank drops it) each bucket some rank flagged late, again.
        Every rank issues the same ones, in the same order, whether it finishes or drops the
        pass ([Note: late gradients], [Note: a pass some rank drops]). Returns whether some
        rank dropped it."""
        while self._next < len(self.buckets) - 1:
            self._launch(self._next)
            self._next += 1
        late = [1.0 if b in self._late else 0.0 for b in range(len(self.buckets))]
        self._launch(self._next, late + [1.0 if dropped else 0.0])
        self._next += 1
        last = self._inflight[-1]
        last[2].wait()
        *late, dropped_anywhere = last[1][last[1].numel() - len(self.buckets) - 1 :].tolist()
        if not dropped_anywhere:
            for entry in self._inflight[:-1]:
                if late[entry[0]]:  # what went early lacks a gradient summed in after it
                    entry[2].wait()  # the stale all-reduce is still matched on every rank
                    self._launch(entry[0])
                    entry[1:] = self._inflight.pop()[1:]
        for _, _, work in self._inflight:
            work.wait()
        return bool(dropped_anywhere)

    def finish(self) -> None:
        """The pass's end: complete its collectives and write each average where some rank had
        a gradient; RuntimeError where another rank dropped the pass (nothing is written)."""
        if not self.buckets:
            return
        if self._complete(dropped=False):
            self._new_pass()
            raise RuntimeError(
                "trainstream: the backward pass raised on another rank, so its gradients are averaged on no rank: "
                "this pass is dropped on every rank (nothing of it is applied); zero_grad() and go on as that rank does"
            )
        for b, buffer, _ in self._inflight:
            bucket = self.buckets[b]
            flags = buffer[numel_of(bucket) : numel_of(bucket) + len(bucket)].tolist()  # ranks that had each
            at = 0
            for p, some in zip(bucket, flags):
                part = buffer[at : at + p.numel()].view(p.shape)
                at += p.numel()
                if some == 0:
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(part)
        self._new_pass()

    def discard(self) -> None:
        """A pass that raised on this rank: nothing of it is written, but where it had begun
        (begin()) its collectives are completed, so that every rank's next ones pair ([Note: a
        pass some rank drops])."""
        if self.buckets and self._open:
            self._complete(dropped=True)
        self._new_pass()


def take_rank_zeros(group, params: list) -> None:
    """Rank 0's values of `params` on every rank (a collective over `group`), as DDP broadcasts
    a model's parameters when it wraps it: every rank keeps these whole and applies the same
    averaged updates to them, so they stay alike only if they start alike. One broadcast of
    their bytes through a host buffer; written through `.data` (not an edit of the param)."""
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1).view(torch.uint8).cpu() for p in params])
    dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
    at = 0
    for p in params:
        n = p.numel() * p.element_size()
        p.data.reshape(-1).view(torch.uint8).copy_(flat[at : at + n])
        at += n


class _StockHook:
    """A hook of StockGradients: holds it weakly (a hook lives in C++ autograd state, out of
    the cyclic GC's sight; see the engine's install())."""

    __slots__ = ("ref", "call")

    def __init__(self, ref, call):
        self.ref, self.call = ref, call

    def __call__(self, *args):
        me = self.ref()
        if me is not None:
            return self.call(me, *args)


class StockGradients:
    """After offload='auto' switched to stock training (torch's fused AdamW on the device):
    DDP's part. Every trainable parameter's gradient is averaged over the ranks in every
    backward pass (BucketAverage). As DDP: each parameter lands through a post hook of its
    AccumulateGrad node (after the user's own hooks on the tensor), the pass begins where
    backward reaches the model's outputs (so its end is all of backward's, not a reentrant
    checkpoint's inner one), and a pass left open by a backward that raised is dropped at the
    next forward, zero_grad() or step() (drop_open_pass). With accumulation in the loop every
    pass is averaged, which gives the mean of the sums, as DDP without no_sync does."""

    def __init__(self, host_group, device_group, params: list, model: torch.nn.Module):
        """`params`: every rank's same list, in the order backward makes them (about)."""
        device = params[0].device if params else torch.device("cpu")
        self.average = BucketAverage(host_group, device_group, params, device)
        self._queued = False  # a pass has begun: its end is queued with autograd
        me = weakref.ref(self)
        self._accumulators = [grad_accumulator(p) for p in params]
        self._handles = [
            acc.register_hook(_StockHook(me, functools.partial(StockGradients._landed, param=p)))
            for acc, p in zip(self._accumulators, params)
        ]
        self._handles.append(model.register_forward_pre_hook(_StockHook(me, StockGradients._forward_begins)))
        self._handles.append(model.register_forward_hook(_StockHook(me, StockGradients._forward_returns)))

    @property
    def buckets(self) -> list:
        return self.average.buckets

    @property
    def on_device(self) -> bool:
        return self.average.on_device

    def _forward_begins(self, module, args) -> None:
        self.drop_open_pass()

    def drop_open_pass(self) -> None:
        """A pass begun and never finished (its backward raised) is dropped: at the model's
        next forward, and at the optimizer's next zero_grad() or step() (before a backward of
        a graph kept with retain_graph=True, which begins no pass at the outputs)."""
        if self._queued and not in_autograd():
            self._queued = False
            self.average.discard()

    def _forward_returns(self, module, args, out) -> None:
        if not torch.is_grad_enabled() or in_autograd():
            return
        for t in tensors_in(out):
            if t.requires_grad and not t.is_leaf:  # a leaf's hook would outlive the pass
                t.register_hook(_StockHook(weakref.ref(self), StockGradients._begin))

    def _begin(self, grad=None) -> None:
        if not self._queued:
            self._queued = True
            self.average.begin()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _landed(self, grad_inputs, grad_outputs, param) -> None:
        self._begin()  # a backward that never reached the model's outputs begins here
        self.average.landed(param)

    def finish(self) -> None:
        """The end of backward."""
        self._queued = False
        self.average.finish()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._accumulators = []


def agree(group, yes: bool) -> bool:
    """True on every rank if `yes` is true on every rank (a collective)."""
    flag = torch.tensor([1 if yes else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag[0])


class _Gatherer:
    """The gather thread's side: all-gathers, one unit at a time in the order queued, each
    once that unit's update jobs are done."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.bytes_sent = 0

    def stop(self) -> None:
        self.queue.put(None)

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            shards, jobs, updated, handle = item
            item = None
            if self.error is not None:  # no further collectives once one failed
                handle.finish(self.error)
                continue
            try:
                for job in jobs:
                    job.wait()
                self._gather(shards, updated)
                handle.finish()
            except BaseException as e:  # surfaced where the weights are waited for
                self.error = e
                handle.finish(e)
            shards = jobs = updated = handle = None  # nothing of the model held while idle

    def _gather(self, shards: UnitShards, updated: set) -> None:
        """The new weights of the `updated` slots from every rank, in the model's dtype
        ([Note: what a rank keeps whole]): each rank sends its fp32 master shard rounded to
        that dtype (to nearest even, as the update writes a copy); a resident unit's land in
        `incoming`, a paged unit's in its host weights, and its other host copies (a bf16
        copy of an fp32 weight, for autocast) are rounded from them. The bytes travel as
        uint8: the gather moves them, any dtype alike."""
        for dtype, members, segment in shards.gathers:
            members = [(sh, at) for sh, at in members if sh.slot in updated]
            if not members:  # `updated` is alike on every rank: the reduced flags decided it
                continue
            send = torch.zeros(segment, dtype=dtype)
            for sh, at in members:
                send[at : at + (sh.hi - sh.lo)].copy_(sh.slot.master_shard)
            recv = torch.empty(self.world * segment, dtype=dtype)
            _all_gather(recv.view(torch.uint8), send.view(torch.uint8), group=self.group)
            self.bytes_sent += send.numel() * send.element_size()
            for sh, at in members:
                s = sh.slot
                full = s.host.get(s.dtype) if s.unit.paged else None
                if full is None:  # resident: the push takes it to the device (params.py), once whole
                    incoming = torch.empty(s.param.shape, dtype=dtype)
                    shards.unpack(recv, sh, incoming, at, segment)
                    s.incoming = incoming
                    continue
                shards.unpack(recv, sh, full, at, segment)
                for t in s.host.values():
                    if t is not full:
                        t.copy_(full)


def check_same_model(group, units, rank: int, world: int, settings: tuple = ()) -> None:
    """Every rank wraps the same model with the same `settings`: a digest of each parameter's
    name, shape, dtype and trainability, and one of the settings, compared across ranks (a
    ValueError on every rank if they differ)."""
    rows = _model_signature(units)
    digest = hashlib.sha256(repr(rows).encode()).digest()
    options = hashlib.sha256(repr(settings).encode()).digest()
    mine = torch.tensor(
        [
            len(rows),
            sum(math.prod(r[1]) for r in rows),
            int.from_bytes(digest[:8], "little", signed=True),
            int.from_bytes(options[:8], "little", signed=True),
        ],
        dtype=torch.int64,
    )
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(t[:3], every[0][:3]) for t in every):
        seen = ", ".join(f"rank {r}: {int(t[0])} parameters, {int(t[1])} elements" for r, t in enumerate(every))
        raise ValueError(
            "wrap(): data parallel needs the same model on every rank, but the parameters differ "
            f"(names, shapes, dtypes or which train): {seen}; this is rank {rank}"
        )
    if any(t[3] != every[0][3] for t in every):
        raise ValueError(
            f"wrap(): data parallel needs the same options on every rank, but they differ; this is rank {rank} "
            f"with {dict(settings)}"
        )


def order_with_unseen(handed: list, order: list) -> list:
    """`handed` (the units one window handed on, in backward order) with every other unit of
    `order` placed right after the unit it followed in `order` (first if it led): a unit
    unused in the window that was learned from keeps its place, rather than going after the
    embedding, where it would wait for the end of every later backward and a non-finite
    gradient in it would skip units one process updates."""
    result = list(handed)
    placed = set(handed)
    for i, unit in enumerate(order):
        if unit in placed:
            continue
        at = result.index(order[i - 1]) + 1 if i > 0 else 0
        result.insert(at, unit)
        placed.add(unit)
    return result
