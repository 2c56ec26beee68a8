"""The engine wrap() installs: who holds which bytes, and the hooks that move them.

One training step, as the hooks see it:
- the model's forward pre-hook waits for the outside modules' updates; each block's
  forward (wrapped) waits for exactly its own update or fetches its paged weights, and
  saves large activations to host memory;
- backward: each block's output gradient hook marks the block's backward start: the block
  before it is prefetched (weights and activations) and the one after it is released; each
  gradient goes to host memory as it is produced, and a unit's update is queued as soon as
  all of its gradients have landed (grads.py);
- optimizer.step() queues what is left and returns; new weights travel to the device as
  each update finishes (params.py). With optimizer_mode="gpu" the updates run on the
  device instead (_queue_on_device), and a resident unit's weights are updated in place.
"""

from __future__ import annotations

import functools

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..quant.weight import QuantizedWeight
from .activations import ActivationPager, PagedTensor
from .device import Backend, DeviceUpdate, HostArena, TransferLedger
from .grads import GradStreamer
from .layout import arena_bytes, host_buffers
from .params import WeightPager
from .placement import cast_bytes
from .report import EventLog

GiB = 1 << 30


class SavedWeight:
    """What autograd holds instead of a saved paged weight: which param, which view."""

    __slots__ = ("slot", "dtypes", "dtype", "size", "stride", "offset")

    def __init__(self, slot, t: torch.Tensor):
        self.slot = slot
        self.dtypes = slot.unit.fetch_dtypes  # how the unit was fetched for this forward
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()


_VIEWS = {
    "TBackward0",
    "TransposeBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "AliasBackward0",
}


def _is_weight_copy(t: torch.Tensor, unit) -> bool:
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


def grads_stay_on_device(update_on_device: bool, opts) -> bool:
    """Gradients stay on the device for their update (optimizer_mode="gpu"), unless clipping
    (which needs every gradient first) or accumulation keeps them in host memory."""
    return update_on_device and opts.accumulation_steps == 1 and opts.max_grad_norm is None


def _device_update_roles(s, paged: bool) -> tuple:
    """optimizer_mode="gpu": where the update writes `s`'s new weights, and its host fp32
    master (None: the fp32 device param is the master, see WeightPager.refresh_host)."""
    if not paged:
        return s.param.data, (None if s.dtype == torch.float32 else s.master)
    copy = s.copy_dtype()
    return (s.host[copy] if copy is not None else s.master), s.master


def _tensors_in(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors_in(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors_in(o)


class Engine:
    MEASURED_PASSES = 2
    # optimizer_mode="gpu": the kernel's grid beside backward. On the H200 (402M MLP) 16
    # blocks gave the shortest step: with fewer, PCIe was not kept busy; with more, the
    # kernel took SMs the backward GEMMs needed (uncapped, the step was a third longer).
    # The 1.9B GPT, whose updates outlast backward, was also slower with 64 blocks or
    # uncapped (about 450 and 470 ms a step against 410).
    DEVICE_UPDATE_BLOCKS = 16

    def __init__(self, model, optimizer, opts, backend: Backend, stack, block_units, outside_units):
        self.model = model
        self.optimizer = optimizer
        self.opts = opts
        self.backend = backend
        self.stack = stack
        self.block_units = block_units
        self.outside_units = outside_units
        self.units = block_units + outside_units
        self.events = EventLog(opts.verbose)
        self.history: list = []
        self.budget: dict = {}
        self.profile = None  # the HardwareProfile the placement used
        self.steps = 0
        self.mode = "offload"  # "stock" once offload="auto" has switched (switch.py)
        self.adapter = None  # set by wrap(): measures, replans, moves blocks (adapt.py)
        self.last_grad_norm = None
        self.clip_on_device = opts.max_grad_norm is not None and opts.accumulation_steps == 1
        # optimizer_mode="gpu" (wrap() decides "auto"): AdamW on the device over host moments.
        self.update_on_device = False
        # wrap() replaces the default with placement.default_inflight_bytes(profile).
        self.max_inflight_bytes = opts.max_inflight_bytes if opts.max_inflight_bytes is not None else GiB
        self.inflight = TransferLedger()  # device memory transfers still hold (see max_inflight_bytes)
        self.moments = None  # optimizer_mode="gpu": the MomentStager (wrap() sets it)
        self.weights = WeightPager(self)
        self.acts = ActivationPager(self)
        self.grads = GradStreamer(self)
        self.resident_storages: set = set()
        self._entered: set = set()  # blocks whose backward has started this pass
        # Saved-activation bytes per block, measured over the first MEASURED_PASSES forward
        # passes with autograd on (the planner sizes activation paging from them), as they are
        # with the block's weights resident: under bf16 autocast they include autocast's copies
        # of its trainable weights (activation_cast), which a paged block does not make.
        self.activation_bytes: dict = {}
        self.activation_cast: dict = {}
        self._measured_passes = 0
        self._measuring = False  # this forward pass counts activations
        self._counting: dict | None = None  # storage pointer -> (weak ref, bytes), in the block running now
        self._counted = 0
        self._counted_cast = 0  # of _counted: autocast's copies of the block's weights
        self._handles: list = []
        self._forwards: dict = {}  # block module -> its own forward attribute, if it had one

    @property
    def device_grads(self) -> bool:
        return grads_stay_on_device(self.update_on_device, self.opts)

    # -- installing ----------------------------------------------------------------------------

    def place_weights(self) -> None:
        """Host buffers for every slot; resident weights on the device, paged ones replaced
        by placeholders. One parameter at a time, so a model built in host memory never
        needs to fit on the device."""
        backend = self.backend
        stage = not self.device_grads
        layout = {s: host_buffers(s, u.paged, stage) for u in self.units for s in u.slots}
        total = arena_bytes(self.units, stage)
        self.arena = HostArena(backend, total)
        for unit in self.units:
            for s in unit.slots:
                data = s.param.data
                if s.quant_format is not None:
                    self._place_quantized(s, unit.paged, layout[s])
                    continue
                for kind, dtype, _ in layout[s]:
                    buf = self.arena.take(data.shape, dtype)
                    if kind == "master":
                        buf.copy_(data)
                        s.host[torch.float32] = buf
                    elif kind == "copy":
                        buf.copy_(data)
                        s.host[s.dtype] = buf
                    elif kind == "stage":
                        s.stage_region = buf
                    else:
                        s.spare = buf
                if unit.paged:
                    s.placeholder = torch.full((1,), float("nan"), dtype=s.dtype, device=backend.device).expand(
                        data.shape
                    )
                    s.param.data = s.placeholder
                else:
                    if data.device != backend.device:
                        s.param.data = data.to(backend.device)
                    self.resident_storages.add(s.param.data.untyped_storage().data_ptr())
        # Quantized codes made on the device were written on the compute stream; the copy-in
        # stream dequantizes them.
        backend.follow_compute(backend.copy_in)
        self.events.add(
            f"host transfer memory: {total / GiB:.2f} GiB needed, {self.arena.reserved / GiB:.2f} GiB "
            f"{'pinned' if backend.is_cuda else 'allocated'} in {len(self.arena.pieces)} pieces"
        )
        for module in self.model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.device != backend.device:
                    module._buffers[name] = buf.to(backend.device)

    def _place_quantized(self, s, paged: bool, buffers) -> None:
        """Quantize a frozen weight where it is (host or device); keep the codes in host
        transfer memory (paged unit) or on the device (resident), and give the param a
        placeholder: the weight is dequantized for each use (params.py)."""
        backend = self.backend
        q = QuantizedWeight.quantize(s.param.data, s.quant_format, s.quant_block)
        if paged:
            held = {kind: self.arena.take((numel,), dtype) for kind, dtype, numel in buffers}
            held["codes"].copy_(q.codes)
            held["absmax"].copy_(q.absmax)
            q = q._with(held["codes"], held["absmax"])
        else:
            q = q.to(backend.device)
        s.quant = q
        s.placeholder = torch.full((1,), float("nan"), dtype=s.dtype, device=backend.device).expand(s.param.shape)
        s.param.data = s.placeholder

    def install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(lambda m, a: self.before_forward()))
        self._handles.append(self.model.register_forward_hook(lambda m, a, out: self.after_forward(out)))
        for unit, block in zip(self.block_units, self.stack.blocks):
            self._forwards[block] = block.__dict__.get("forward")
            block.forward = self._block_forward(unit, block.forward)
        self.grads.install()

    def remove(self) -> None:
        self.weights.lander.stop()
        for h in self._handles:
            h.remove()
        self._handles = []
        for block, own in self._forwards.items():
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._forwards = {}
        self.grads.remove()

    # -- forward -------------------------------------------------------------------------------

    def before_forward(self) -> None:
        self.grads.recover()
        if self.grads.in_backward or self._in_autograd():
            return  # a forward recomputed inside backward (checkpointing): nothing to move
        self.adapter.apply_pending()
        self.grads.poll()
        for unit in self.block_units:
            if unit.streamed and unit.fetched is not None:
                self.weights.release(unit)  # left over from a forward without backward
        self.acts.new_pass()
        if torch.is_grad_enabled() and self._measured_passes < self.MEASURED_PASSES:
            self._measured_passes += 1
            self._measuring = True
        else:
            self._measuring = False
        if torch.is_grad_enabled():
            self.adapter.new_pass()
        for unit in self.outside_units:
            self.weights.guard(unit)

    def after_forward(self, out) -> None:
        """The model's forward returned (an autocast around the call not yet left): the adapter
        reads what is allocated now and again when backward starts, at the first gradient of
        an output (see Adapter.forward_returns)."""
        if not torch.is_grad_enabled() or self.grads.in_backward or self._in_autograd():
            return
        # Not on a leaf (a parameter or an input handed through): its hooks outlive the pass.
        outputs = [t for t in _tensors_in(out) if t.requires_grad and not t.is_leaf]
        if not outputs:
            return
        self.adapter.forward_returns()
        for t in outputs:
            t.register_hook(self._output_grad)

    def _output_grad(self, grad) -> None:
        self.grads.begin_pass()
        self.adapter.backward_starts(grad.untyped_storage().nbytes())

    def _block_forward(self, unit, forward):
        engine = self

        @functools.wraps(forward)
        def paged_forward(*args, **kwargs):
            engine.enter_block(unit)
            measure = engine._start_counting()
            try:
                # A checkpoint around the block has its own saved-tensor hooks: ours would
                # override them (nothing recomputed, every activation kept), so a block whose
                # activations stay put leaves them be; its weights come back with the recompute.
                foreign = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
                if (unit.act_paged or measure or (unit.streamed and not foreign)) and torch.is_grad_enabled():
                    with torch.autograd.graph.saved_tensors_hooks(functools.partial(engine.pack, unit), engine.unpack):
                        out = forward(*args, **kwargs)
                else:
                    out = forward(*args, **kwargs)
            finally:
                engine._stop_counting(unit, measure)
                engine.exit_block(unit)
            engine.watch_backward(unit, out)
            return out

        return paged_forward

    @staticmethod
    def _in_autograd() -> bool:
        """A forward running inside backward (a checkpointed block recomputing), even before
        any gradient of this pass has landed."""
        return torch._C._current_graph_task_id() != -1

    def enter_block(self, unit) -> None:
        if self.grads.in_backward or self._in_autograd():
            # A block recomputing its forward in backward (checkpointing). Backward is done with
            # the blocks above the one after it; under reentrant checkpointing no backward hook
            # of theirs released their fetched or dequantized weights.
            for done in self.block_units[unit.block + 2 :]:
                if done.streamed and done.fetched is not None:
                    self.weights.release(done)
            self.weights.guard(unit)
            return
        if torch.is_grad_enabled():
            self.adapter.block_starts(unit)  # may page this block's activations (the online guard)
        self.acts.drop(unit)
        self.weights.guard(unit)
        nxt = unit.block + 1
        if nxt < len(self.block_units) and self.block_units[nxt].streamed:
            self.weights.fetch(self.block_units[nxt], ahead=True)

    def exit_block(self, unit) -> None:
        if self.grads.in_backward or self._in_autograd():
            return
        if torch.is_grad_enabled():
            self.adapter.block_ends(unit)
        if not unit.streamed:
            return
        last = unit.block == len(self.block_units) - 1
        if not (last and torch.is_grad_enabled()):  # the last block's backward comes first: keep it
            self.weights.release(unit)

    def _start_counting(self) -> bool:
        """Count this block's saved activations? Only in the first passes, and never under
        someone else's saved-tensor hooks (a checkpoint's), which ours would override."""
        if (
            not self._measuring
            or not torch.is_grad_enabled()
            or self.grads.in_backward
            or self._in_autograd()
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        ):
            return False
        self._counting = {}
        self._counted = 0
        self._counted_cast = 0
        return True

    def _stop_counting(self, unit, measured: bool) -> None:
        if measured:
            total, cast = self._counted, self._counted_cast
            if unit.paged:
                # Its weights came in bf16: autocast made no copies, which resident it would.
                cast = cast_bytes(unit)
                total += cast
            if total >= self.activation_bytes.get(unit.block, 0):
                self.activation_bytes[unit.block] = total
                self.activation_cast[unit.block] = cast
            self._counting = None

    def pack(self, unit, t: torch.Tensor):
        if t.device != self.backend.device or t.numel() == 0:
            return t
        ptr = t.untyped_storage().data_ptr()
        slot = self.weights.fetched_storages.get(ptr)
        if slot is not None:
            return SavedWeight(slot, t)
        if self._counting is not None and ptr not in self.resident_storages:
            seen = self._counting.get(ptr)
            if seen is None or seen[0].expired():  # a paged storage's address may be reused in the block
                self._counting[ptr] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
                self._counted += t.untyped_storage().nbytes()
                if _is_weight_copy(t, unit):
                    self._counted_cast += t.untyped_storage().nbytes()
        if (
            not unit.act_paged
            or ptr in self.resident_storages
            or t.untyped_storage().nbytes() < self.opts.min_offload_bytes
        ):
            return t
        return self.acts.pack(t, unit)

    def unpack(self, packed):
        if isinstance(packed, SavedWeight):
            return self.weights.device_view(
                packed.slot, packed.dtypes, packed.dtype, packed.size, packed.stride, packed.offset
            )
        if isinstance(packed, PagedTensor):
            return self.acts.unpack(packed)
        return packed

    # -- backward ------------------------------------------------------------------------------

    def watch_backward(self, unit, out) -> None:
        if not torch.is_grad_enabled() or self.grads.in_backward or self._in_autograd():
            return
        if not any(u.streamed or u.act_paged for u in self.block_units):
            return
        for t in _tensors_in(out):
            if t.requires_grad:
                t.register_hook(lambda grad, unit=unit: self.block_backward_starts(unit))

    def block_backward_starts(self, unit) -> None:
        """Backward has reached `unit`'s output: the block after it is done, this one is
        next, and the one before it can start coming in."""
        i = unit.block
        if i in self._entered:
            return
        if not self._entered:
            self.adapter.backward_reaches_stack()
        self._entered.add(i)
        self.adapter.sample()
        blocks = self.block_units
        if i + 1 < len(blocks):
            done = blocks[i + 1]
            if done.streamed:
                self.weights.release(done)
            self.acts.drop(done)
        if unit.streamed and unit.fetch_dtypes:
            # Attached, not only fetched: a checkpointed part of the block recomputes its
            # forward during backward and reads the params directly.
            self.weights.attach(unit, dtypes=unit.fetch_dtypes)
        for rec in unit.acts:
            self.acts.fetch(rec)
        if i > 0 and blocks[i - 1].streamed and blocks[i - 1].fetch_dtypes:
            self.weights.fetch(blocks[i - 1], ahead=True, dtypes=blocks[i - 1].fetch_dtypes)
        for j in range(i - 1, max(i - 1 - self.opts.prefetch_depth, -1), -1):
            self.acts.prefetch(blocks[j])

    def after_backward(self) -> None:
        self.adapter.sample()
        for unit in self.block_units:
            if unit.streamed:
                self.weights.release(unit)
            self.acts.drop(unit)
        self._entered.clear()
        self.acts.new_pass()

    # -- the optimizer's side --------------------------------------------------------------------

    def queue_update(self, unit, grad_scale: float = 1.0) -> None:
        slots = [s for s in unit.trainable if s.has_grad]
        if slots:
            # Numbered by when the next forward needs the unit: blocks update in backward
            # order, but block 0 (and the embeddings before it) are needed first.
            unit.priority = self.update_order().index(unit)
            if self.update_on_device:
                self._queue_on_device(unit, slots, grad_scale)
            else:
                self._queue_on_host(unit, slots, grad_scale)
        unit.queued = True

    def _queue_on_host(self, unit, slots, grad_scale: float) -> None:
        if unit.paged and unit.fetch_event is not None:
            unit.fetch_event.synchronize()  # a copy from the host weights may still be reading them
        unit.update_mark = self.backend.record()
        for handle, ss in self.optimizer.queue(
            slots, [self.grads.grad_of(s) for s in slots], grad_scale, unit.priority
        ):
            unit.updates.append(handle)
            for s in ss:
                s.reader = handle
        if not unit.paged:
            self.weights.expect_update(unit)

    def _queue_on_device(self, unit, slots, grad_scale: float) -> None:
        """optimizer_mode="gpu": the AdamW kernel on the update stream, once compute has
        produced the gradients and queued every read of the old weights. One kernel per
        moment region (moments.py), each queued between its region's copy in and its copy
        home: a region then holds VRAM for one copy each way and its own kernel, and the
        next region's copy in overlaps this one's copy home under max_inflight_bytes. (With
        one kernel per unit, a 1.9B GPT block's regions all waited in VRAM for the last to
        arrive, and the cap let only one block's copies run at a time: both PCIe directions
        idled in turn, 0.47 s a step in a profile, against 0.38 with the cap lifted.) A
        resident unit's weights are updated in place on the device (fp32 ones are their own
        master there); a paged unit's in host memory, where its next fetch reads them."""
        backend = self.backend
        stream = backend.update
        backend.follow_compute(stream)
        if unit.paged and unit.fetch_event is not None:
            backend.wait(unit.fetch_event, stream)  # a copy from the host weights may still be reading them
        for s in slots:  # a host job still adding into the gradient sum (accumulation): the kernel
            if s.reader is not None and not isinstance(s.reader, DeviceUpdate):  # is outside its pool
                s.reader.wait()
        kernel_done = home = None
        try:
            for group in self.moments.by_region(slots):
                targets, masters = zip(*(_device_update_roles(s, unit.paged) for s in group))
                grads = [self.grads.grad_of(s) for s in group]
                staged = self.moments.stage_in([s.param for s in group], stream)
                with backend.on(stream):
                    self.optimizer.queue_on_device(
                        backend.device,
                        group,
                        grads,
                        list(targets),
                        list(masters),
                        staged.moments,
                        grad_scale,
                        self.DEVICE_UPDATE_BLOCKS,
                    )
                    for g in grads:
                        if g.device == backend.device:
                            backend.keep_until(g, stream)
                kernel_done = backend.record(stream)
                home = self.moments.send_home(staged, kernel_done) or home
                self.inflight.add(
                    kernel_done, sum(g.numel() * g.element_size() for g in grads if g.device == backend.device)
                )
                # Let go of the region's buffer and gradients now: the allocator frees them once
                # their streams pass this kernel and copy, as the ledger just recorded (held to
                # the unit's end, they would also take room the next region's copy needs).
                for s in group:
                    s.device_grad = None
                staged = grads = None
        finally:
            # Even if a later region's copy failed (out of memory), the kernels already queued
            # are tracked: host readers of their moments and the next forward wait for them.
            if kernel_done is not None:
                self._track_device_update(unit, slots, DeviceUpdate(kernel_done, home))

    def _track_device_update(self, unit, slots, handle) -> None:
        # A resident unit's handles are otherwise only dropped by synchronize(): keep the
        # list to the updates that may still run (one event per step would pile up).
        unit.updates = [h for h in unit.updates if not h.done()]
        unit.updates.append(handle)
        for s in slots:
            s.reader = handle
        if not unit.paged:
            unit.h2d_event = handle.event  # the next forward's guard waits for it on the GPU

    def update_order(self) -> list:
        # Forward order: the next forward needs the outside modules (embeddings) and block 0 first.
        return self.outside_units + self.block_units

    def step(self) -> None:
        self.grads.recover()
        if self.grads.in_backward:
            raise RuntimeError("trainstream: optimizer.step() called during backward")
        self.grads.flush()
        pending = [u for u in self.update_order() if not u.queued and any(s.has_grad for s in u.trainable)]
        if pending:
            scale = 1.0
            if self.opts.max_grad_norm is not None:
                slots = [s for u in self.units for s in u.trainable if s.has_grad]
                total = self.grads.global_norm(slots)
                clip = torch.clamp(self.opts.max_grad_norm / (total + 1e-6), max=1.0)
                scale = float(clip)
                self.last_grad_norm = float(total)
            for unit in pending:
                self.queue_update(unit, scale)
        self.grads.reset_window()
        self.steps += 1
        self.weights.land_updates()
        if not self.opts.guard_params:
            self.synchronize()
        self.adapter.after_step()

    def zero_grad(self) -> None:
        """Drop the gradients of the current window (torch's zero_grad); updates already
        queued by a finished window are not undone."""
        self.grads.recover()
        if self.grads.in_backward:
            raise RuntimeError("trainstream: optimizer.zero_grad() called during backward")
        self.grads.flush()
        self.grads.reset_window()

    def synchronize(self) -> None:
        """Every queued update written on the host and, for resident units, on the device."""
        for unit in self.units:
            self.weights.synchronize(unit)
