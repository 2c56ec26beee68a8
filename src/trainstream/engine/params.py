"""Weights on the device: the resident units' copies after each update, and weight paging.

Resident unit: the device holds its weights for good. When the host AdamW has updated the
master, the new weights go H2D on the copy-in stream and an event is recorded; the next
forward waits on the GPU for exactly that event (guard_params), nothing else.

Paged unit: between uses, each param's ``.data`` is a placeholder: its host weights in its
own dtype, seen from the device (see [Note: placeholders]), so shape, dtype and device stay
what the model expects and a read outside forward gives the weights' values. Before the
unit's forward, and again before its backward, its weights are fetched from host memory
into fresh device tensors; after use they are released.

[Note: placeholders] A read of a paged weight outside the engine's hooks can take any path
(``p``, ``p.data``, ``p.detach()``, ``named_parameters()``, a user's own hook), and torch has
no hook on a Parameter's reads; a tensor subclass cannot stand in for a Parameter's data.
So the placeholder is the value itself, at no device memory: on the CPU backend the host
tensor; on a GPU a CUDA tensor over the pinned host buffer (every pinned buffer is mapped
into the device's address space), which a kernel reads across PCIe. Reads are current after
``optimizer.synchronize()`` (the host threads write these buffers). An in-place edit through
it writes the host weights, and the version counter tells the engine to level the other
copies (_take_edit). A quantized weight has no full-precision host copy: its placeholder is
one NaN expanded to its shape (reads give NaN; a write either fails or is refused at the
weight's next use: [Note: quantized edits]); state_dict() dequantizes it.

[Note: edits] The engine's own writes to a param go through ``p.data`` (its own version
counter) or raw pointers; a user's in-place edit (``p.zero_()``, ``nn.init``, ``p.copy_``
under no_grad) moves ``p._version`` on. Before a unit's update is queued, and before a paged
unit is fetched, an edited param's values become its host weights (_take_edit); a resident
unit's pending push does not overwrite an edit made after its update was queued, it takes
the edit instead (an edit after step() wins over that step's update, as in torch). Edits
through ``p.data`` bypass the counter and are not seen. Under autocast, the weights and biases of nn.Linear layers travel in
the autocast dtype: the host AdamW writes that copy in the same pass as the fp32 master,
autocast would have rounded the fp32 weight to exactly those values (round to nearest
even both ways), so the block computes the same bits with half the PCIe bytes.

Quantized frozen weights (wrap(quantize=...)) are streamed the same way, resident unit or
paged: the fetch dequantizes their codes, in the dtype the block computes in, and the
release drops the dequantized tensor. A paged unit's codes cross PCIe first, and its fetch
runs on the copy-in stream, ahead of use.

[Note: dequantized where used] A resident unit's codes are on the device already: its fetch
is one dequantize of the unit's weights into one buffer (a native call prepared once,
ops.quant.PreparedDequantize), queued on compute's stream when the block's forward or
backward needs it, never ahead. The kernels take about a hundredth of the block's compute,
so running them behind compute costs less than ordering them across streams: no event,
no record_stream, no in-flight bytes to count, and the buffer goes back to the allocator at
release, where compute's next allocations may take it. A block holds one unit's
dequantized weights, not two (its own and the next one's fetched ahead): less peak
memory, as bitsandbytes holds one weight at a time. The last block's are released at the
end of its forward too, not kept for its backward as a paged unit's are: the head and the
loss, where a LoRA step peaks, run without them. (Under reentrant checkpointing the block
after the one recomputing stays attached: two.) Codes written on the device by work
the engine queued (quantized at wrap(), re-quantized by a load) are waited for once, on
whatever stream dequantizes next (codes_written).
"""

from __future__ import annotations

import threading

import torch

from ..ops import quant as qops
from ..quant.stored import codes_of
from ..quant.stored import take as take_codes
from ..quant.stored import taken_back as codes_taken_back
from ..quant.weight import QuantizedWeight
from ..sizes import GiB
from .device import DeviceUpdate, HostArena
from .landing import Lander
from .layout import Fetch, arena_sizes, host_buffers, set_quantization


def _autocast_dtype(device_type: str):
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class WeightPager:
    """Owns where every weight is: host buffers, resident device tensors, paged fetches."""

    def __init__(self, backend, units: list, ledger, update_on_device: bool, paged=(), quantized=None):
        """`paged`: the blocks whose weights live in host memory; `quantized`: the slots
        stored quantized, with (format, block size) each."""
        self.backend = backend
        self.units = units
        for u in units:
            u.paged = u.block in paged
        for s, (fmt, block) in (quantized or {}).items():
            set_quantization([s], fmt, block)
        self.ledger = ledger
        self._slot_of = {s.param: s for u in units for s in u.slots}
        self.update_on_device = update_on_device  # a resident param's device data is newer than its host master
        # device storage pointer -> [(first byte, end byte, slot)] of the attached fetched weights in it
        self.fetched_storages: dict = {}
        self.resident_storages: set = set()  # device storage pointers of resident weights
        self.fetched_bytes = 0  # device bytes fetched since wrap (growth that is not activations)
        # unit -> (its Unit.views, {autocast dtype: _FetchLayout}): how its fetches are laid out,
        # for its plan fields as they were (a change makes new views, and the layouts new ones)
        self._layouts: dict = {}
        self._fetches: dict = {}  # unit -> _Fetched, while unit.fetched is set
        self.arena = None  # the host transfer memory, once place() has carved it
        self._before = None  # set by place(), until placed(): see unplace()
        self.unreadable: list = []  # paged params whose placeholder is NaN, not their values
        self.nans = _NaNs(backend.device)  # behind those placeholders and the quantized weights'
        # The stream position after which quantized codes written on the device are there (an
        # event; None once it has passed): codes_written().
        self._codes_event = None
        # Resident units' state (stale, updates, h2d_event) is shared with the lander thread.
        self.lock = threading.RLock()
        self.lander = Lander(self)

    def stop(self) -> None:
        """No more updates will land: the lander thread ends (unwrap, the switch to stock)."""
        self.lander.stop()

    # -- placing, at wrap() ------------------------------------------------------------------------

    def place(self, stage: bool) -> str:
        """Host buffers for every slot; resident weights on the device, paged ones replaced
        by placeholders. One parameter at a time, so a model built in host memory never
        needs to fit on the device. `stage`: landing buffers for the gradients. Returns the
        event line for the host memory it took."""
        backend = self.backend
        # What unplace() gives back if wrap() fails later: each parameter's tensor and its
        # Python attributes (codes that quant.stored hands over are one), kept until placed().
        self._before = [(s.param, s.param.data, dict(vars(s.param))) for u in self.units for s in u.slots]
        layout = {s: host_buffers(s, u.paged, stage) for u in self.units for s in u.slots}
        # the pieces are pinned by the arena's thread while the loop quantizes and copies
        # into those before ([Note: pinning ahead]); every take below is in this list, in order
        takes = arena_sizes(self.units, stage)
        total = sum(takes)
        self.arena = HostArena(backend, total)
        with self.arena.pinning_ahead(takes):
            for unit in self.units:
                for s in unit.slots:
                    if s.quant_format is not None:
                        self._place_quantized(s, unit.paged, layout[s])
                    else:
                        self._place_plain(s, unit.paged, layout[s])
        self.codes_written()
        unreadable = (
            f"; {len(self.unreadable)} paged weights read outside forward give NaN (their pinned host memory is "
            f"mapped on another GPU): read them through state_dict() ({', '.join(self.unreadable[:3])})"
            if self.unreadable
            else ""
        )
        return (
            f"host transfer memory: {total / GiB:.2f} GiB needed, {self.arena.reserved / GiB:.2f} GiB "
            f"{'pinned' if backend.is_cuda else 'allocated'} in {len(self.arena.pieces)} pieces{unreadable}"
        )

    def _place_plain(self, s, paged: bool, buffers) -> None:
        """A weight kept as it is: its host buffers filled from it; on the device (resident)
        or replaced by its placeholder (paged)."""
        backend = self.backend
        data = s.param.data
        for kind, dtype, numel in buffers:
            if kind == "master" and s.shard is not None:  # data parallel: this rank's elements only
                lo, hi = s.shard
                s.master_shard = self.arena.take((numel,), dtype)
                s.master_shard.copy_(data.reshape(-1)[lo:hi])
                continue
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
        if paged and not s.device_state:  # a device-state slot stays on the device, paged unit or not
            s.placeholder = self._readable_placeholder(s)
            s.param.data = s.placeholder
        else:
            if data.device != backend.device:
                s.param.data = data.to(backend.device)
            self.resident_storages.add(s.param.data.untyped_storage().data_ptr())
        s.version = s.param._version

    def placed(self) -> None:
        """wrap() succeeded: the model's tensors from before place() may go."""
        self._before = None

    def unplace(self) -> None:
        """wrap() failed after place() began: every parameter back on the tensor it had
        before, with the Python attributes it had (the engine's buffers are dropped with it)."""
        for param, data, attrs in reversed(self._before or []):
            param.data = data
            for key, value in attrs.items():
                if key not in vars(param):
                    setattr(param, key, value)
            if codes_of(param) is not None:  # codes handed over by quant.stored: its module names them again
                codes_taken_back(param)
        self._before = None
        self.resident_storages.clear()
        self.fetched_storages.clear()
        self._layouts.clear()

    def _place_quantized(self, s, paged: bool, buffers) -> None:
        """Quantize a frozen weight where it is (host or device); keep the codes in host
        transfer memory (paged unit) or on the device (resident), and give the param a
        placeholder: the weight is dequantized for each use. A parameter that arrived holding
        codes (quant.stored: quantize_model, load_model) hands them over as they are."""
        held = {kind: self.arena.take((numel,), dtype) for kind, dtype, numel in buffers} if paged else None
        if codes_of(s.param) is not None:
            q = take_codes(s.param)
        elif paged and s.param.device == held["codes"].device:
            # the quantizer writes straight into the transfer memory: no second copy of the codes
            out = (held["codes"], held["absmax"])
            q = QuantizedWeight.quantize(s.param.data, s.quant_format, s.quant_block, out=out)
        else:
            q = QuantizedWeight.quantize(s.param.data, s.quant_format, s.quant_block)
        if paged and q.codes is not held["codes"]:
            held["codes"].copy_(q.codes)
            held["absmax"].copy_(q.absmax)
            q = q._with(held["codes"], held["absmax"])
        elif not paged:
            q = q.to(self.backend.device)
        s.quant = q
        s.placeholder = self.nans.placeholder(s)
        s.param.data = s.placeholder
        s.version = s.param._version  # from here a write to the placeholder is the user's

    def codes_written(self) -> None:
        """Quantized codes (or what a paged unit's copies read) were just written by work
        queued on the current stream: quantized at place(), moved by a repage, quantized
        again by a load. The copy-in stream follows it (a paged unit's dequantize), and a
        resident unit's next dequantize waits for it on whatever stream computes then (a
        user's torch.cuda.stream), which nothing else would order after it."""
        backend = self.backend
        backend.follow_compute(backend.copy_in)
        self._codes_event = backend.record()

    def _after_codes(self) -> None:
        """Before a resident unit's dequantize: the current stream waits for the codes last
        written (codes_written), until the host sees them done."""
        event = self._codes_event
        if event is not None:
            if event.query():
                self._codes_event = None
            else:
                self.backend.wait(event)

    def restore(self) -> None:
        """unwrap(): every weight back on the device in the model's dtype (a quantized one
        dequantized: its original values are gone). Updates must be synchronized first."""
        for unit in self.units:
            self.release(unit)
            for s in unit.slots:
                if (unit.paged and not s.device_state) or s.quant is not None:
                    weights = s.quant.dequantize() if s.quant is not None else s.host[s.dtype]
                    s.param.data = weights.to(self.backend.device)

    # -- resident units ----------------------------------------------------------------------

    def before_host_update(self, unit) -> None:
        """A host update of `unit` is about to be queued: a copy still reading its host weights
        must be done, and compute's position marks the reads of the old device weights its
        push must wait for."""
        if unit.paged and unit.fetch_event is not None:
            unit.fetch_event.synchronize()
        self.take_edits(unit)
        unit.update_mark = self.backend.record()

    def host_update_queued(self, unit, handles: list) -> None:
        """`unit`'s host jobs were queued; a resident unit's weights go to the device when they
        are done (the lander, or the next guard)."""
        unit.updates += handles
        if not unit.paged:
            with self.lock:
                unit.stale = True
            self.lander.expect(unit)

    def device_update_queued(self, unit, handle) -> None:
        """optimizer_mode="gpu": `unit`'s kernels were queued. A resident unit's next forward
        waits for them on the GPU; its handles are otherwise only dropped by synchronize(), so
        the list keeps to those that may still run."""
        unit.updates = [h for h in unit.updates if not h.done()]
        unit.updates.append(handle)
        if not unit.paged:
            unit.h2d_event = handle.event

    def loaded(self, units) -> None:
        """A state dict was loaded into these units' weights (host and device alike): the
        device copies are current."""
        with self.lock:
            for unit in units:
                unit.stale = False

    def values_known(self, slots) -> None:
        """The host weights of `slots` and their params agree now (a state dict was loaded
        through the params): the edits so far are taken."""
        for s in slots:
            s.version = s.param._version

    def take_edits(self, unit) -> None:
        """Before `unit`'s update is queued or its paged weights are fetched: the params the
        user edited in place become their host weights ([Note: edits])."""
        for s in unit.slots:
            if s.param._version != s.version:
                self._take_edit(s)

    def _take_edit(self, s) -> None:
        """`s`'s param was edited in place: a paged param's edit is in its host weights in
        its dtype (the placeholder views them), a resident one's in its device tensor; every
        other host copy is brought level (the fp32 master exactly, lower-precision copies
        rounded to nearest even, as the optimizer writes them)."""
        if s.quant is not None:
            return  # nothing to take: the unit's next fetch refuses the write (refuse_quantized_edits)
        s.version = s.param._version
        if not (s.host or s.master_shard is not None):
            return  # a frozen resident param has no host copy yet
        edited = s.host[s.dtype] if s.unit.paged else s.param.data
        if s.master_shard is not None:  # data parallel: this rank's elements of the master
            lo, hi = s.shard
            s.master_shard.copy_(edited.reshape(-1)[lo:hi])
            s.incoming = None  # gathered weights not pushed yet: the edit wins over them
        master = s.host.get(torch.float32)
        if master is not None and master is not edited:
            master.copy_(edited)
        for t in s.host.values():
            if t is not edited and t is not master:
                t.copy_(master if master is not None else edited)

    def land_updates(self) -> None:
        """Send every finished update of a resident unit to the device (no waiting)."""
        self.lander.raise_error()
        with self.lock:
            for unit in self.units:
                if unit.stale and all(h.done() for h in unit.updates):
                    self.push(unit)

    def push(self, unit) -> None:
        """Copy a resident unit's updated host weights to the device (caller holds the lock)."""
        for h in unit.updates:
            h.wait()
        unit.updates = []
        backend = self.backend
        # Not before compute has finished every read queued when the update was (a no-grad
        # forward between backward and step() may still be reading the old weights).
        backend.wait(unit.update_mark, backend.copy_in)
        edited = [s for s in unit.trainable if s.param._version != s.version]
        for s in edited:  # edited after the update was queued: the edit wins ([Note: edits])
            self._take_edit(s)
        with backend.on(backend.copy_in):
            for s in unit.trainable:
                if s in edited:
                    continue
                if s.shard is not None:  # data parallel: the all-gathered new weights (distributed.py)
                    src, s.incoming = s.incoming, None
                    if src is None:
                        continue  # not updated in this window: the device weights are current
                else:
                    src = s.host[s.dtype]  # the master, or the copy the optimizer wrote in the model's dtype
                # A gathered buffer is pageable: the copy has read it when copy_ returns.
                s.param.data.copy_(src, non_blocking=True)
        unit.h2d_event = backend.record(backend.copy_in)
        unit.stale = False

    def guard(self, unit) -> None:
        """Before compute reads `unit`'s weights: its in-flight update and copy, only; and
        a resident unit's quantized weights, dequantized."""
        if unit.paged:
            self.attach(unit)
            return
        self.lander.raise_error()
        with self.lock:
            if unit.stale:
                self.push(unit)
            if unit.h2d_event is not None:
                self.backend.wait(unit.h2d_event)
                unit.h2d_event = None
        if unit.streamed:
            self.attach(unit)

    def synchronize_all(self) -> None:
        """Every queued update written on the host and, for resident units, on the device."""
        for unit in self.units:
            self.synchronize(unit)

    def synchronize(self, unit) -> None:
        """Host side: `unit`'s updates written and, if resident, on the device."""
        for h in list(unit.updates):
            h.wait()
        if not unit.paged:
            self.lander.raise_error()
            with self.lock:
                if unit.stale:
                    self.push(unit)
                if unit.h2d_event is not None:
                    unit.h2d_event.synchronize()
                    unit.h2d_event = None
        unit.updates = []

    # -- moving units between the two (the adapter, between steps) --------------------------------

    def repage(self, units) -> bool:
        """Page the resident units among `units` and bring the paged ones in for good. Every
        update must be synchronized first (synchronize_all()). True if any moved."""
        for unit in units:
            if unit.paged:
                self._to_resident(unit)
            else:
                self._to_paged(unit)
        return bool(units)

    def _to_paged(self, unit) -> None:
        backend = self.backend
        self.release(unit)
        if backend.is_cuda and unit.views.quantized_slots:
            # Its dequantizes ran on whichever stream computed then (a user's stream, say): the
            # device codes are dropped below, so every stream must be past them. A repage is
            # rare (a replan, between steps).
            torch.cuda.synchronize(backend.device)
        self.take_edits(unit)  # an edit of the device weights, before the host ones become the param
        for s in unit.pageable_slots:  # device-state slots stay where they are
            if s.quant is not None:  # the codes move to host transfer memory; the param keeps its placeholder
                s.quant = s.quant._with(backend.to_host(s.quant.codes), backend.to_host(s.quant.absmax))
                continue
            if s.trainable and self.update_on_device and s.shard is None:
                # The device weights are the fp32 master or its rounding (refresh_host); under
                # data parallel the master is the shard's, and the weights its gathered rounding.
                refresh_host(s)
            if s.dtype not in s.host:  # a frozen resident param has no host copy yet
                s.host[s.dtype] = backend.to_host(s.param.data)
            self.resident_storages.discard(s.param.data.untyped_storage().data_ptr())
            s.placeholder = self._readable_placeholder(s)
            s.param.data = s.placeholder
        unit.paged, unit.stale, unit.h2d_event = True, False, None
        self._layouts.pop(unit, None)  # its codes moved: laid out again at the next fetch

    def _to_resident(self, unit) -> None:
        self.release(unit)
        self.take_edits(unit)  # an edit through the placeholder: every host copy level first
        for s in unit.pageable_slots:  # device-state slots never left
            if s.quant is not None:  # the codes to the device; still dequantized for each use
                s.quant = s.quant.to(self.backend.device)
                continue
            s.param.data = s.host[s.dtype].to(self.backend.device)  # the master, or the model-dtype copy
            self.resident_storages.add(s.param.data.untyped_storage().data_ptr())
            if s.trainable and s.shard is not None:
                # Data parallel: a resident unit keeps no full host weights (its new weights
                # come from the all-gather); a later page-out copies them from the device.
                s.host.clear()
                s.spare = None
        unit.paged, unit.fetch_dtypes = False, {}
        self._layouts.pop(unit, None)  # its codes moved: laid out again at the next fetch
        if unit.views.quantized_slots:
            self.codes_written()

    # -- paged units ---------------------------------------------------------------------------

    def _after_updates(self, unit, stream) -> None:
        """Order `stream` after `unit`'s updates: on the GPU for device updates (still
        tracked until done), on the host for host jobs."""
        pending = []
        for h in unit.updates:
            if isinstance(h, DeviceUpdate):
                self.backend.wait(h.event, stream)
                if not h.done():
                    pending.append(h)
            else:
                h.wait()
        unit.updates = pending

    def _dtype_for(self, slot, autocast_dtype):
        # bf16 only: an fp16 copy would give fp16 gradients, which the host AdamW does not read.
        if autocast_dtype == torch.bfloat16 and slot.is_linear and slot.dtype == torch.float32:
            return autocast_dtype
        return slot.dtype

    def _host_source(self, slot, dtype) -> torch.Tensor:
        src = slot.host.get(dtype)
        if src is None:
            # First use in this dtype: derive it from the fp32 weights (rounded to nearest
            # even, as autocast would). A trainable param's copy is kept current by the
            # optimizer from now on.
            for h in slot.unit.updates:  # a device update may still be writing the master
                h.wait()
            base = slot.host[torch.float32] if torch.float32 in slot.host else slot.host[slot.dtype]
            if slot.trainable and slot.copy_dtype() not in (None, dtype):
                raise RuntimeError(
                    f"trainstream: {slot.name} is already paged as {slot.copy_dtype()}; "
                    f"mixing autocast dtypes for one model is not supported"
                )
            if slot.spare is not None and dtype.itemsize == slot.spare.dtype.itemsize:
                src = slot.spare.view(dtype)
                src.copy_(base)
            else:
                src = self.backend.to_host(base.to(dtype))
            slot.host[dtype] = src
        return src

    def fetch(self, unit, *, ahead: bool = False, dtypes: dict | None = None) -> None:
        """Start bringing `unit`'s weights to the device: a paged unit's cross PCIe on the
        copy-in stream (its quantized ones dequantized there); a resident unit's quantized
        weights are dequantized on the current stream, never ahead ([Note: dequantized
        where used]). In forward the dtypes follow the autocast state; in backward they
        repeat the forward's."""
        if unit.fetch is not Fetch.RELEASED or (ahead and not unit.paged):
            return
        layout = self._layout(unit, dtypes)
        refuse_quantized_edits(layout.views.quantized_slots)
        nbytes = layout.views.fetch_nbytes
        if ahead:
            if not self.ledger.may_fetch_ahead(nbytes):
                return  # over the in-flight cap: fetched on demand when its turn comes
            self.ledger.make_room_for_weights(nbytes)
        backend = self.backend
        if unit.paged:  # the optimizer may still be writing these weights (quantized ones are frozen)
            self._after_updates(unit, backend.copy_in)
            self.take_edits(unit)
            with backend.on(backend.copy_in):
                fetched, storages = self._bring(layout)
            unit.fetch_event = backend.record(backend.copy_in)
        else:
            self._after_codes()
            fetched, storages = self._bring(layout)
            unit.fetch_event = None  # queued on compute's own stream: nothing to wait for
        unit.fetched, unit.fetch_dtypes = fetched, layout.dtypes
        self._fetches[unit] = _Fetched(layout, storages, on_compute=not unit.paged)
        self.fetched_bytes += layout.held_nbytes
        unit.fetch = Fetch.AHEAD if ahead else Fetch.FETCHED
        if ahead:
            self.ledger.fetched_ahead(nbytes)

    def _bring(self, layout) -> tuple:
        """`layout`'s weights on the device, queued on the current stream: (slot -> device
        tensor, [(tensor, storage pointer, byte spans of the weights in it)])."""
        backend = self.backend
        storages = []
        dequantized = {}
        if layout.quantized:
            flat, dequantized = self._dequantize(layout)
            storages.append((flat, flat.untyped_storage().data_ptr(), layout.spans))
        fetched = {}
        for s in layout.slots:
            dev = dequantized.get(s)
            if dev is None:
                src = self._host_source(s, layout.dtypes[s])
                dev = torch.empty(src.shape, dtype=src.dtype, device=backend.device)
                dev.copy_(src, non_blocking=True)
                storages.append((dev, dev.untyped_storage().data_ptr(), [(0, dev.numel() * dev.element_size(), s)]))
            fetched[s] = dev
        return fetched, storages

    def _layout(self, unit, dtypes: dict | None):
        """How `unit`'s fetch in `dtypes` (None: the autocast state's) is laid out: made once per
        unit and autocast dtype while its plan fields stand, so every forward under one autocast
        state fetches in the same dtypes dict (the unit's fetch_dtypes), which its backward
        hands back. Other dtypes (a forward's before a replan) get a layout of their own."""
        views = unit.views
        entry = self._layouts.get(unit)
        if entry is None or entry[0] is not views:
            entry = self._layouts[unit] = (views, {})
        layouts = entry[1]
        if dtypes is None:
            autocast = _autocast_dtype(self.backend.device.type)
            layout = layouts.get(autocast)
            if layout is None:
                dtypes = {s: self._dtype_for(s, autocast) for s in views.streamed_slots}
                layout = layouts[autocast] = _FetchLayout(views, dtypes, self.backend.device, self.DEQUANT_ALIGN)
            return layout
        for layout in layouts.values():
            if layout.dtypes is dtypes:
                return layout
        return _FetchLayout(views, dtypes, self.backend.device, self.DEQUANT_ALIGN)

    # Byte alignment of each weight in a unit's dequantized buffer: where a fresh allocation
    # would start (the kernels' vector path needs 16, the matmuls reading it prefer more).
    DEQUANT_ALIGN = 256

    def _dequantize(self, layout) -> tuple:
        """Views of one new device buffer, slot -> its weight in its layout's dtype, dequantized
        on the current stream (copy-in for a paged unit, compute for a resident one) from
        each slot's codes: one allocation and one native call per (format, block size) for
        the unit, rather than one of each per weight (a resident unit's call prepared once).
        A paged unit's codes and scales cross PCIe first. The buffer is a fresh
        allocation each call; where each weight lies in it is the layout's. Returns the buffer
        and the views."""
        device = self.backend.device
        flat = torch.empty(layout.buffer_nbytes, dtype=torch.uint8, device=device)
        typed, views = {}, {}
        for s, dtype, shape, stride, offset in layout.places:
            base = typed.get(dtype)
            if base is None:
                base = typed[dtype] = flat.view(dtype)  # whole: the buffer's size is a multiple of DEQUANT_ALIGN
            views[s] = base.as_strided(shape, stride, offset)
        for (fmt, block_size), slots, codes, absmax, prepared in layout.groups:
            if prepared is not None and prepared.run(flat):
                continue
            if codes is None:  # the codes are not on the device (a paged unit's): across PCIe first
                moved = [s.quant if s.quant.device == device else s.quant.to(device, non_blocking=True) for s in slots]
                codes, absmax = [q.codes for q in moved], [q.absmax for q in moved]
            qops.dequantize_many_trusted(fmt, codes, absmax, [views[s] for s in slots], block_size)
        return flat, views

    def attach(self, unit, *, dtypes: dict | None = None) -> None:
        """Point the unit's params at their fetched device tensors (fetching now if no
        prefetch did) and make compute wait for the copy."""
        if (
            unit.fetch is not Fetch.RELEASED
            and dtypes is not None
            and unit.fetch_dtypes is not dtypes
            and unit.fetch_dtypes != dtypes
        ):
            self.release(unit)  # fetched for a forward in another dtype (say, a no-grad eval)
        if unit.fetch is Fetch.ATTACHED:
            return
        self.fetch(unit, dtypes=dtypes)
        backend = self.backend
        backend.wait(unit.fetch_event)
        for s, dev in unit.fetched.items():
            s.param.data = dev
        # Each storage is kept for compute once (made on another stream) and named with the
        # byte spans of the weights in it (a unit's dequantized weights share one).
        record = self._fetches[unit]
        compute = None if record.on_compute else backend.compute_stream()
        for t, ptr, spans in record.storages:
            if compute is not None:
                backend.keep_until(t, compute)
            self.fetched_storages[ptr] = spans
        if unit.fetch is Fetch.AHEAD:
            self.ledger.used(record.layout.views.fetch_nbytes)
        unit.fetch = Fetch.ATTACHED

    def release(self, unit) -> None:
        """Back to placeholders; the device memory returns to the allocator once compute
        has passed the work already queued on it."""
        if unit.fetch is Fetch.RELEASED:
            return
        for s in unit.fetched:
            s.param.data = s.placeholder
        record = self._fetches.pop(unit)
        for _, ptr, _ in record.storages:
            self.fetched_storages.pop(ptr, None)
        # The memory returns to the allocator once compute passes this point (at once where
        # compute's stream made it: its next allocations are queued after these reads).
        if not record.on_compute:
            self.ledger.add(self.backend.record(), record.layout.held_nbytes)
        if unit.fetch is Fetch.AHEAD:
            self.ledger.used(record.layout.views.fetch_nbytes)
        unit.fetched, unit.fetch, unit.fetch_event = None, Fetch.RELEASED, None

    def fetched_slot(self, t: torch.Tensor, ptr: int):
        """The slot whose attached weight `t` views (`ptr`: its storage's address), or None
        when `t` is not a fetched weight. A unit's dequantized weights share one storage
        (_dequantize): the view's byte offset says whose it is."""
        spans = self.fetched_storages.get(ptr)
        if spans is None:
            return None
        if len(spans) == 1:
            return spans[0][2]
        at = t.storage_offset() * t.element_size()
        return next((s for start, end, s in spans if start <= at < end), None)

    def attached_weight(self, slot, dtypes: dict) -> torch.Tensor:
        """`slot`'s weight on the device as fetched for the forward that read it (`dtypes`),
        for its backward: attached again if it was released since (frozen_linear.py)."""
        unit = slot.unit
        if unit.fetch is not Fetch.ATTACHED or unit.fetch_dtypes is not dtypes:  # else: attached for that forward
            self.attach(unit, dtypes=dtypes)
        return unit.fetched[slot]

    def device_view(self, slot, dtypes: dict, dtype, size, stride, offset) -> torch.Tensor:
        """A saved weight for backward: the same view of the weights as fetched for the
        forward that saved it (`dtypes`)."""
        dev = self.attached_weight(slot, dtypes)
        return torch.empty(0, dtype=dtype, device=dev.device).set_(dev.untyped_storage(), offset, size, stride)

    def _readable_placeholder(self, s) -> torch.Tensor:
        """A paged param's data between uses ([Note: placeholders]): its host weights in its
        dtype, on the device it computes on; one NaN for a quantized weight."""
        host = s.host.get(s.dtype)
        if host is None or s.quant is not None:
            return self.nans.placeholder(s)
        if not self.backend.is_cuda:
            return host
        view = _mapped_view(host)
        if view.device != self.backend.device:
            # torch names a pinned buffer's device by the one current when it was pinned: a
            # view on another device would move the param. Reads of this one give NaN (the
            # events say so: place()).
            self.unreadable.append(s.name)
            return self.nans.placeholder(s)
        return view

    def check_conversion(self, module, fn) -> None:
        """`module._apply(fn)` is about to run (model.to(), .double(), .half(), .bfloat16(),
        .cuda(), .cpu(), ...): refuse it, before anything changes, if it would give a wrapped
        parameter another dtype or device. The engine's host buffers, gradient landing buffers
        and kernels are laid out for the dtypes and the device of wrap(). `fn` is tried on an
        empty tensor of each parameter's dtype and rank (no memory), which is what it returns
        for a parameter of that kind."""
        device = self.backend.device
        tried = {}
        for p in module.parameters():
            s = self._slot_of.get(p)
            if s is None:
                continue
            key = (s.dtype, p.dim())
            if key not in tried:
                tried[key] = fn(torch.empty((0,) * p.dim(), dtype=s.dtype, device=device))
            out = tried[key]
            if isinstance(out, torch.Tensor) and (out.dtype != s.dtype or out.device != device):
                raise ValueError(
                    f"trainstream: this would make {s.name} {out.dtype} on {out.device}; a wrapped model's "
                    f"parameters stay as wrap() placed them ({s.dtype} on {device}). To change the dtype or "
                    "the device: trainstream.unwrap(model), convert or move it, then wrap() it again"
                )


def refuse_quantized_edits(slots) -> None:
    """[Note: quantized edits] A weight held as codes has no values to edit between uses: its
    placeholder expands one NaN, so the only in-place writes that succeed on it write one
    element (zero_(), fill_(), eye_(), masked_fill_(), index_fill_(); every other raises),
    from which what was meant cannot be told (a pruning mask's masked_fill_ leaves the 0 that
    zero_() does). Such a write moves the param's version counter; the weight's next use
    refuses it here, naming it, rather than compute with codes the user believes changed. It
    stays refused until new values are loaded through the state dict (state.py: quantized
    again, the placeholder made NaN again), or the model is unwrapped (the codes' values)."""
    for s in slots:
        if s.param._version != s.version:
            raise ValueError(
                f"trainstream: {s.name} is held as {s.quant_format} codes, and an in-place write to it "
                "(zero_(), fill_(), nn.init, masked_fill_, ...) cannot be applied to them: between uses the "
                "weight exists only as codes (docs/semantics.md, 'Reading a quantized weight'). To give it "
                f"new values, load them: model.load_state_dict({{'<its state_dict key>': values}}, strict=False) "
                "quantizes them again; or trainstream.unwrap(model), edit, and wrap() again"
            )


def _mapped_view(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the pinned host tensor `host` (same bytes, no copy): a device reads
    it across PCIe through its mapping of pinned memory."""
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=host.dtype, device="cuda")
    flat = host.reshape(-1).view(torch.uint8)  # bytes: the interface has no bfloat16

    class _Interface:
        __slots__ = ("__cuda_array_interface__", "owner")

    interface = _Interface()
    interface.owner = host  # the view keeps the pinned buffer alive
    interface.__cuda_array_interface__ = {
        "shape": (flat.numel(),),
        "typestr": "|u1",
        "data": (flat.data_ptr(), False),
        "version": 2,
        "strides": None,
    }
    return torch.as_tensor(interface, device="cuda").view(host.dtype).view(host.shape)


def refresh_host(s) -> None:
    """optimizer_mode="gpu" updates a resident param on the device only (its host fp32
    master too, for a bf16 param): before the host weights are read again (the unit is
    paged), bring them level. Lower-precision copies are the master rounded to nearest
    even, as the optimizer writes them."""
    if s.dtype == torch.float32:
        s.master.copy_(s.param.data)
    for dtype, t in s.host.items():
        if dtype != torch.float32:
            t.copy_(s.master)


class _NaNs:
    """The NaNs behind a pager's NaN placeholders: each placeholder expands an element of its
    own (a write that succeeds on an expanded tensor, zero_() or fill_(), spoils that weight's
    NaN and no other), carved from chunks allocated one per CHUNK weights of a dtype, so
    placing a model queues one allocation and fill kernel per chunk, not one per quantized
    weight, each behind the pinning thread's host allocations (wrap() of a 7B LoRA has 196)."""

    CHUNK = 4096

    def __init__(self, device):
        self.device = device
        self._chunks: dict = {}  # dtype -> (chunk, elements taken)

    def placeholder(self, s) -> torch.Tensor:
        chunk, taken = self._chunks.get(s.dtype, (None, self.CHUNK))
        if taken == self.CHUNK:
            chunk, taken = torch.full((self.CHUNK,), float("nan"), dtype=s.dtype, device=self.device), 0
        self._chunks[s.dtype] = (chunk, taken + 1)
        return chunk[taken : taken + 1].expand(s.param.shape)


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class _FetchLayout:
    """How one unit's streamed weights are fetched in one set of dtypes (WeightPager._layout):
    made once, kept while the unit's plan fields stand (`views`, its Unit.views when made).
    `dtypes` is the dict the fetches hand on as unit.fetch_dtypes; the quantized weights are
    dequantized into one buffer of `buffer_nbytes` per fetch, each at `places`' offset (a
    fresh allocation's alignment), their codes read by (format, block size) group."""

    __slots__ = ("views", "dtypes", "slots", "quantized", "buffer_nbytes", "held_nbytes", "places", "spans", "groups")

    def __init__(self, views, dtypes: dict, device, align: int):
        self.views, self.dtypes = views, dtypes
        self.slots = views.streamed_slots
        self.quantized = tuple(s for s in self.slots if s.quant is not None)
        places, spans, total = [], [], 0
        for s in self.quantized:
            dtype = dtypes[s]
            nbytes = s.param.numel() * dtype.itemsize
            shape = tuple(s.param.shape)
            # (slot, dtype, shape, stride, offset in elements of dtype): a contiguous view
            places.append((s, dtype, shape, _contiguous_strides(shape), total // dtype.itemsize))
            spans.append((total, total + nbytes, s))  # the bytes it views (fetched_slot reads them)
            total += -(-nbytes // align) * align
        self.places, self.spans, self.buffer_nbytes = places, spans, total
        # Device bytes one fetch holds: the buffer, and each other weight's own tensor.
        self.held_nbytes = total + sum(s.param.numel() * dtypes[s].itemsize for s in self.slots if s.quant is None)
        groups: dict = {}
        for s in self.quantized:
            groups.setdefault((s.quant.format, s.quant.block_size), []).append(s)
        # ((format, block size), slots, codes, absmax, prepared): the codes and scales listed
        # once when they live on the device (a resident unit's: fixed until the unit moves,
        # which makes a new layout), and on a GPU its native call prepared; None when they
        # cross PCIe for each fetch (a paged unit's).
        byte_offset = {s: offset * dtype.itemsize for s, dtype, _, _, offset in places}
        self.groups = []
        for (fmt, block_size), slots in groups.items():
            here = all(s.quant.device == device for s in slots)
            codes = [s.quant.codes for s in slots] if here else None
            absmax = [s.quant.absmax for s in slots] if here else None
            prepared = None
            if here and device.type == "cuda":
                prepared = qops.PreparedDequantize(
                    fmt,
                    codes,
                    absmax,
                    [s.param.numel() for s in slots],
                    [dtypes[s] for s in slots],
                    [byte_offset[s] for s in slots],
                    block_size,
                )
            self.groups.append(((fmt, block_size), slots, codes, absmax, prepared))


class _Fetched:
    """A fetch of a unit's weights while it lasts: its layout, each device storage it holds
    as (tensor, storage pointer, [(first byte, end byte, slot)] of the weights in it), and
    whether compute's own stream made them (a resident unit's dequantized weights)."""

    __slots__ = ("layout", "storages", "on_compute")

    def __init__(self, layout: _FetchLayout, storages: list, on_compute: bool):
        self.layout, self.storages, self.on_compute = layout, storages, on_compute
