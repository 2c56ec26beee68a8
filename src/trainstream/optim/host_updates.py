"""OffloadAdamW(mode="cpu") on GPU parameters: the gradients leave for pinned host memory
as backward makes them, the host AdamW updates an fp32 master there, and the new weights
come back on a copy stream.

Per parameter (a `ParamRecord`):
- its post-accumulate-grad hook copies the gradient into a pinned landing buffer (`stage`)
  on the device-to-host stream, behind the stream that produced it, and drops the device
  gradient (``p.grad = None``): VRAM never holds the gradients. A second gradient before
  zero_grad() (two backward passes) is added to a host fp32 sum, as autograd would add it
  to ``p.grad``.
- step() queues each parameter's host AdamW (``ops.adamw_step``: the fp32 master in place, a
  bf16 parameter's copy written in the same pass) as soon as its gradient has landed, in
  landing order, so that the pool works while backward still computes the earlier layers'
  gradients (update_batches.py gathers small ones into one job). Each is numbered by the
  parameter's position (the forward order, as a rule): among the jobs queued, the pool
  updates first what the next forward needs first. It returns once all are queued.
- the lander thread (engine/landing.py) copies each parameter's new weights to the device
  on the copy-in stream as soon as its job is done, after compute has finished every read
  queued before step(); the forward that next reads the parameter (optim/forward_guard.py)
  makes compute wait for that copy's event, pushing it itself if the lander has not.

On the CPU backend (engine/device.py) every copy is done when it returns and every event is
done: the same bookkeeping runs on CPU parameters, which is how the tests exercise it.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..engine.device import DONE, Backend
from ..engine.landing import Lander
from .forward_guard import ForwardGuard

PARAM_DTYPES = (torch.float32, torch.bfloat16)  # the host AdamW reads fp32 and bf16 gradients

# id(param) -> (the param, the HostUpdates whose hook takes its gradients), both weakly:
# the newest optimizer built over a param, so an older one not yet collected no longer takes
# them. Keyed by id: a weak-key dict would compare tensors with ==. An entry goes with its param.
_owner_of: dict = {}


def _set_owner(param: torch.Tensor, owner) -> None:
    key = id(param)
    _owner_of[key] = (weakref.ref(param, lambda _: _owner_of.pop(key, None)), weakref.ref(owner))


def _owner(param: torch.Tensor):
    entry = _owner_of.get(id(param))
    return entry[1]() if entry is not None and entry[0]() is param else None


def _before_any_step(optimizer, args, kwargs) -> None:
    """torch's global step pre-hook, for every optimizer's step(): the optimizer stepped last
    over a param takes its gradients. One stepping params an OffloadAdamW's hooks take (an old
    OffloadAdamW kept alive by an LR scheduler, then torch's AdamW) gets them back in p.grad,
    their updates landed first, and that OffloadAdamW stops taking them; an OffloadAdamW
    stepped again takes them back."""
    mine = getattr(optimizer, "_host_updates", None)
    mine = mine if isinstance(mine, HostUpdates) else None
    if mine is None and not _owner_of:  # no OffloadAdamW takes gradients: nothing to look up
        return
    taken: dict = {}  # id(owner) -> (owner, its params this optimizer steps)
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = _owner(p)
            if owner is not None and owner is not mine:
                taken.setdefault(id(owner), (owner, []))[1].append(p)
    for owner, params in taken.values():
        owner.hand_over(params)
    if mine is not None:
        mine.claim()


class ParamRecord:
    """One parameter's buffers and the state of its gradient and update. `updates`, `stale`
    and `priority` are what the lander reads; the lock guards `stale`, `updates`, `h2d_event`
    and `push_event`, which the lander thread writes."""

    __slots__ = (
        "param",
        "priority",  # its position among the optimizer's parameters: the pool runs low numbers first
        "stage",  # pinned host landing buffer, in the param's dtype
        "stage_event",  # the last copy into `stage`
        "staged",  # `stage` holds a gradient of this window
        "sum",  # host fp32: the window's earlier gradients (several backward passes), or zeros
        "summed",  # `sum` is part of the window's gradient
        "reader",  # the host job that reads `stage` / `sum` (they are not written before it is done)
        "master",  # host fp32 weights the AdamW updates; pinned for an fp32 param (it is the push source)
        "copy",  # a bf16 param's pinned bf16 copy the AdamW writes (the push source), else None
        "version",  # param._version when the master and the param last agreed
        "updates",  # host jobs writing the master not yet pushed
        "stale",  # an update is queued and its weights are not on the device yet
        "update_mark",  # compute's position at step(): the push waits for it (reads of the old weights)
        "push_event",  # the last copy of the master (or copy) to the device
        "h2d_event",  # that copy, for compute to wait on before its next read (None once it has)
        "__weakref__",
    )

    def __init__(self, param: torch.Tensor, priority: int, backend: Backend):
        self.param = param
        self.priority = priority
        self.stage = backend.host_empty(param.shape, param.dtype)
        self.stage_event = DONE
        self.staged = self.summed = self.stale = False
        self.sum = self.reader = self.update_mark = self.push_event = self.h2d_event = None
        self.updates: list = []
        if param.dtype == torch.float32:
            self.master = backend.host_empty(param.shape, torch.float32)
            self.copy = None
        else:
            self.master = torch.empty(param.shape, dtype=torch.float32)
            self.copy = backend.host_empty(param.shape, param.dtype)
        self.master.copy_(param.detach())
        if self.copy is not None:
            self.copy.copy_(param.detach())
        self.version = param._version

    @property
    def source(self) -> torch.Tensor:
        """What the push copies to the device: the master, or the copy in the param's dtype."""
        return self.master if self.copy is None else self.copy


class HostUpdates:
    """The streamed parameters of one optimizer, on one device."""

    def __init__(self, device: torch.device):
        self.backend = Backend(device)
        self.records: dict = {}  # param -> ParamRecord, in the order added
        self.lock = threading.RLock()  # the lander pushes under it (its `pager.lock`)
        self.lander = Lander(self)
        me = weakref.ref(self)  # the guard's global hook must not keep the optimizer alive
        self.guard = ForwardGuard(lambda records: _before_reading(me, records))
        self._hooks: list = []  # the params' gradient hook handles
        # Dropped without synchronize(), the queued updates still land, and the params (which
        # outlive the optimizer) lose its hooks: the finalizer holds the records (and through
        # them the params) and the handles, never self. The lander's own finalizer only stops
        # its thread: whatever it has not pushed, this one pushes.
        # Not at interpreter exit: no one reads the weights then, and CUDA may be torn down.
        weakref.finalize(self, _let_go, self.records, self._hooks, self.backend, self.lock).atexit = False
        self._landing: list = []  # records with a copy into `stage` issued, in issue order
        # step() took this window's gradients and no zero_grad() has come since: a gradient now
        # is summed into them, as torch sums p.grad (warned once: an optimizer wrapping this
        # one whose own zero_grad() only clears p.grad, which holds nothing here, does this).
        self._stepped_since_zero = False
        self._warned_summed_over_steps = False
        self.closed = False  # close() ran: another optimizer took the params over

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def adopt(self, param: torch.Tensor) -> None:
        """A param of the optimizer. A frozen one gets no buffers (a frozen base would take
        its size twice over in pinned memory): it gets them with its first gradient."""
        if param.device != self.device:
            raise ValueError(
                f"OffloadAdamW(mode='cpu'): every parameter on a GPU must be on one device; "
                f"got {param.device} and {self.device}"
            )
        if param.requires_grad:
            self._add(param)

    def _add(self, param: torch.Tensor) -> ParamRecord:
        record = self.records[param] = ParamRecord(param, len(self.records), self.backend)
        self.guard.add(param, record)
        _set_owner(param, self)
        if param.requires_grad:
            # The hook dict lives in the param's C++ autograd metadata, which the cyclic GC
            # cannot see: holding the optimizer or the record strongly there would keep both,
            # and the model, alive for ever.
            me, rec = weakref.ref(self), weakref.ref(record)
            self._hooks.append(param.register_post_accumulate_grad_hook(lambda p: _on_grad(me, rec)))
        return record

    def close(self) -> None:
        """Every update landed, then the hooks off and the lander stopped (the optimizer was
        converted for wrap(): the engine takes the parameters over)."""
        self.synchronize()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()  # in place: the finalizer holds the list
        for p in self.records:
            if self.owns(p):
                del _owner_of[id(p)]
        self.guard.remove()
        self.lander.stop()
        # The old optimizer may be kept alive (an LR scheduler built on it): its pinned buffers
        # go now. Cleared in place: the finalizer holds this dict.
        self.records.clear()
        self._landing = []
        self.closed = True

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this optimizer takes `param`'s gradients (no newer one was built over it,
        no other one stepped it since this one did)."""
        return _owner(param) is self

    def claim(self) -> None:
        """This optimizer is stepped: it takes its params' gradients again (step() takes the
        ones already in p.grad)."""
        for p in self.records:
            if not self.owns(p):
                _set_owner(p, self)

    def hand_over(self, params: list) -> None:
        """Another optimizer steps `params`: every update of ours lands first (it reads and
        writes the weights), the gradients this window took go back to p.grad, and the hooks
        leave `params`' next gradients in p.grad."""
        self.synchronize()
        for p in params:
            _owner_of.pop(id(p), None)
            record = self.records.get(p)
            if record is None:
                continue
            record.stage_event.synchronize()
            if record.staged and record.summed:
                self._fold(record)
            taken = record.sum if record.summed else record.stage if record.staged else None
            record.staged = record.summed = False
            if taken is None:
                continue
            g = taken.to(device=p.device, dtype=p.dtype, copy=True)
            p.grad = g if p.grad is None else p.grad.add_(g)

    # -- gradients -----------------------------------------------------------------------------

    def on_grad(self, record: ParamRecord) -> None:
        """autograd finished `record`'s gradient in ``p.grad``: off to the landing buffer."""
        p = record.param
        g = p.grad
        if g is None or not self.owns(p):
            return
        if g.is_sparse:
            raise ValueError("OffloadAdamW does not support sparse gradients")
        backend = self.backend
        if record.staged:  # a second backward pass before zero_grad(): the first one joins the sum
            if self._stepped_since_zero and not self._warned_summed_over_steps:
                self._warned_summed_over_steps = True
                warnings.warn(
                    "trainstream: OffloadAdamW: a backward pass after step() without zero_grad(): its gradients "
                    "are added to the ones step() already used, as torch adds them to p.grad. If an optimizer "
                    "wraps this one, its zero_grad() must call this one's (torch's own only clears p.grad, which "
                    "holds nothing here)",
                    stacklevel=2,
                )
            self._fold(record)
        self._release(record)
        backend.follow_compute(backend.copy_out)  # behind the kernels that produced `g`
        with backend.on(backend.copy_out):
            record.stage.copy_(g, non_blocking=True)
            backend.keep_until(g, backend.copy_out)
        record.stage_event = backend.record(backend.copy_out)
        record.staged = True
        self._landing.append(record)
        p.grad = None

    def take_stray_grads(self, params) -> None:
        """Gradients of `params` that reached ``p.grad`` without the hook (made before this
        optimizer existed, or by a param frozen when it was built) are taken as the hook
        takes them."""
        for p in params:
            if p.grad is not None:
                record = self.records.get(p)
                self.on_grad(record if record is not None else self._add(p))

    def _fold(self, record: ParamRecord) -> None:
        record.stage_event.synchronize()
        self._release(record)
        if record.sum is None:
            record.sum = torch.zeros(record.param.shape, dtype=torch.float32)
        if record.summed:
            record.sum.add_(record.stage)
        else:
            record.sum.copy_(record.stage)  # bf16 -> fp32 is exact
            record.summed = True
        record.staged = False

    def release(self, param: torch.Tensor) -> None:
        """The host job reading `param`'s gradient is done (before its buffers are reused)."""
        self._release(self.records[param])

    def _release(self, record: ParamRecord) -> None:
        """The host job reading `stage` and `sum` is done: they may be written."""
        if record.reader is not None:
            record.reader.wait()
            record.reader = None

    def gradients(self, params, *, wait: bool = True) -> dict:
        """param -> the host tensor holding its gradient of this window, for every one of
        `params` (the optimizer's) that has one, in the order they land in host memory (those
        already there first, then the copies in the order backward issued them). `wait`: wait
        for the copies still landing; otherwise the caller waits for each (`wait_landed`)
        before reading it, and may start on the first while the last are still copied. The
        tensors stay valid until the next backward pass or zero_grad()."""
        if self.closed:
            raise RuntimeError(
                "OffloadAdamW.step(): this optimizer was converted by wrap() (or convert_optimizer()), which "
                "took its parameters over; step the optimizer it returned"
            )
        self.take_stray_grads(params)
        self._stepped_since_zero = True
        # A record staged twice (a second backward pass) was folded at its second copy: its
        # place is the last copy's.
        landing = list({id(r): r for r in reversed(self._landing)}.values())[::-1]
        self._landing = []
        if wait:
            for record in landing:
                record.stage_event.synchronize()
        in_flight = {id(r) for r in landing}
        out = {}
        for record in [*(r for r in self.records.values() if id(r) not in in_flight), *landing]:
            if record.staged and record.summed:
                self._fold(record)
            if record.summed:
                out[record.param] = record.sum
            elif record.staged:
                out[record.param] = record.stage
        return out

    @staticmethod
    def landed(record: ParamRecord) -> bool:
        """Whether `record`'s gradient is in host memory (its last copy there has finished)."""
        return record.stage_event.query()

    @staticmethod
    def wait_landed(record: ParamRecord) -> None:
        record.stage_event.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad(): no gradient, or (set_to_none=False) a zero one, which updates
        the param as torch's step() updates a param whose ``p.grad`` is zeros."""
        self._stepped_since_zero = False
        for record in self.records.values():
            had_grad = record.staged or record.summed
            record.staged = False
            record.summed = False
            if had_grad and not set_to_none:  # torch zeroes only the gradients that exist
                self._release(record)
                if record.sum is None:
                    record.sum = torch.zeros(record.param.shape, dtype=torch.float32)
                else:
                    record.sum.zero_()
                record.summed = True
        self._landing = []

    # -- updates -------------------------------------------------------------------------------

    def before_update(self, record: ParamRecord) -> torch.Tensor:
        """Before an update of `record` is queued: the master agrees with the param (an edit in
        place, such as ``model.load_state_dict``, is taken into it) and no copy still reads
        it. Returns the master."""
        self.lander.raise_error()
        with self.lock:
            if record.stale:  # step() twice without a forward in between: the last one lands first
                self.push(record)
            if record.push_event is not None:
                record.push_event.synchronize()
                record.push_event = None
        if record.param._version != record.version:
            self._take_edit(record)
        return record.master

    def _take_edit(self, record: ParamRecord) -> None:
        p = record.param.detach()
        record.version = record.param._version
        if record.copy is None:
            record.master.copy_(p)
            return
        # A bf16 param: its edit is taken unless it holds what the master rounds to (a
        # checkpoint of the same weights loaded again), which would lose the master's bits.
        host = p.to("cpu")
        if not torch.equal(host, record.master.to(host.dtype)):
            record.master.copy_(host)
            record.copy.copy_(host)

    def priority_of(self, record: ParamRecord) -> int:
        """The pool's priority for `record`'s update: its position, except that a param no
        forward was seen reading in this window comes before all others, since step() waits
        for it (after_step) while the rest are waited for by the forwards that read them."""
        return record.priority if self.guard.seen(record) else record.priority - len(self.records)

    def update_queued(self, record: ParamRecord, handle, mark) -> None:
        """`handle` (a host job) reads `record`'s gradient and writes its master: the weights
        go to the device when it is done (the lander, or the guard of the next forward)."""
        record.reader = handle
        with self.lock:
            record.updates.append(handle)
            record.update_mark = mark
            record.stale = True
        self.guard.pending(record)
        self.lander.expect(record)

    def after_step(self) -> None:
        """Parameters whose reads no forward waited for in the window just ended (see
        ForwardGuard.end_window) are made current for compute now."""
        unseen = self.guard.end_window()
        if unseen:
            self._before_reading(unseen)
            for record in unseen:
                self.guard.done(record)

    def push(self, record: ParamRecord) -> None:
        """Copy `record`'s updated weights to the device (the caller holds the lock)."""
        _push(record, self.backend)

    def _before_reading(self, records: list) -> None:
        """Compute is about to read these params: it waits (on the device) for their copies."""
        self.lander.raise_error()
        with self.lock:
            for record in records:
                if record.stale:
                    self.push(record)
                if record.h2d_event is not None:
                    self.backend.wait(record.h2d_event)
                    record.h2d_event = None

    def synchronize(self) -> None:
        """Every update written and on the device, as the host sees it."""
        self.lander.raise_error()
        _land_all(self.records, self.backend, self.lock)
        for record in self.records.values():
            self.guard.done(record)
        self.lander.raise_error()


def _push(record: ParamRecord, backend: Backend) -> None:
    """Copy `record`'s updated weights to the device, once its updates are done (the caller
    holds the lock)."""
    for handle in record.updates:
        handle.wait()
    record.updates = []
    record.stale = False
    if record.param._version != record.version:
        return  # edited in place since the update was queued: the edit wins (taken at the next step)
    # Not before compute has finished every read of the old weights queued before step().
    backend.wait(record.update_mark, backend.copy_in)
    with backend.on(backend.copy_in):
        record.param.data.copy_(record.source, non_blocking=True)
    record.push_event = record.h2d_event = backend.record(backend.copy_in)


def _land_all(records: dict, backend: Backend, lock) -> None:
    """Every queued update on the device, as the host sees it: run when the optimizer is
    collected (a step() not followed by synchronize() still lands: the params outlive the
    optimizer) and by synchronize(). Holds no reference to the HostUpdates."""
    with lock:
        for record in records.values():
            if record.stale:
                _push(record, backend)
            if record.push_event is not None:
                record.push_event.synchronize()
                record.push_event = None
            record.h2d_event = None


def _let_go(records: dict, hooks: list, backend: Backend, lock) -> None:
    """The optimizer was collected: its updates land, its hooks leave the params, and the
    params it took lose their dead owner's entry (while any entry is left, every torch
    optimizer's step() looks its params up in _owner_of)."""
    try:
        _land_all(records, backend, lock)
    finally:
        for handle in hooks:
            handle.remove()
        hooks.clear()
        for p in records:
            entry = _owner_of.get(id(p))
            if entry is not None and entry[0]() is p and entry[1]() is None:
                del _owner_of[id(p)]


def _before_reading(owner_ref, records: list) -> None:
    owner = owner_ref()
    if owner is not None:
        owner._before_reading(records)


def _on_grad(owner_ref, record_ref) -> None:
    owner, record = owner_ref(), record_ref()
    if owner is not None and record is not None:
        owner.on_grad(record)


# Once per process: it holds nothing (the owners are looked up in _owner_of, weakly).
register_optimizer_step_pre_hook(_before_any_step)
