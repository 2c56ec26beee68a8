"""The engine wrap() installs: who holds which bytes, and the hooks that move them.

The engine is built whole from (model, optimizer, Plan, backend): it owns the hooks, and
each manager owns one kind of state and is handed only what it uses (weights: params.py,
gradients: grads.py, activations: activations.py, moments: moments.py, measurements:
measure.py and adapt.py, state dicts: state.py). Calls go one way, from the engine to the
managers; a manager answers with return values: the gradient streamer with the units
ready for their update, the adapter with a decision, which the engine applies at the end
of step().

One training step, as the hooks see it:
- the model's forward pre-hook waits for the outside modules' updates; each block's
  forward (wrapped) waits for exactly its own update or fetches its paged weights, and
  saves large activations to host memory;
- backward: each block's output gradient hook marks the block's backward start: the block
  before it is prefetched (weights and activations) and the one after it is released; each
  gradient goes to host memory as it is produced, and a unit's update is queued as soon as
  all of its gradients have landed;
- optimizer.step() queues what is left and returns; new weights travel to the device as
  each update finishes. With optimizer_mode="gpu" the updates run on the device instead
  (updates.py), and a resident unit's weights are updated in place.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref

import torch

from ..sizes import MiB
from . import pinned
from .activations import ActivationPager, PagedTensor
from .adapt import Adapter, Replan, SwitchToStock
from .device import HostArena, TransferLedger
from .device_state import DeviceState
from .distributed import BucketAverage, DataParallel, StockGradients, agree, stock_averaging_bytes, take_rank_zeros
from .frozen_linear import FrozenLinears
from .grads import GradSettings, GradStreamer
from .hookpoints import grad_accumulator, in_autograd, tensors_in
from .layout import Fetch, GradWindow, PlanEpoch, set_device_state, set_recompute
from .measure import ActivationMeter
from .moments import MomentStager, lay_out
from .nonfinite import found_before_an_exception
from .params import WeightPager
from .recompute_call import recompute_call, why_not_recompute
from .report import EventLog
from .state import StateHooks
from .switch import explicit_paging, quantized
from .updates import Updater


class SavedWeight:
    """What autograd holds instead of a saved paged weight: which param, which view."""

    __slots__ = ("slot", "dtypes", "dtype", "size", "stride", "offset")

    def __init__(self, slot, t: torch.Tensor):
        self.slot = slot
        self.dtypes = slot.unit.fetch_dtypes  # how the unit was fetched for this forward
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()


def _checkpoints_itself(forward) -> bool:
    """Does the block of this bound forward checkpoint its own forward? Hugging Face's layers
    under gradient_checkpointing_enable() do (GradientCheckpointingLayer wraps `forward`, so
    the checkpoint runs inside the engine's block forward, where no hook of it is seen yet)."""
    block = getattr(forward, "__self__", None)
    return (
        isinstance(block, torch.nn.Module)
        and getattr(block, "gradient_checkpointing", False) is True
        and block.training
    )


# The engine holds hooks, threads, streams and pinned buffers that belong to one process and
# one model: a wrapped model is not copied or pickled with it.
_NOT_COPIED = (
    "trainstream: a wrapped model cannot be copied or pickled (copy.deepcopy, torch.save(model)): save "
    "model.state_dict() and optimizer.state_dict() instead, or trainstream.unwrap(model) first"
)


class _Installed:
    """What the engine puts on the model (hooks, block forwards): calls `fn`, and refuses at
    once to be copied or pickled with the model."""

    __slots__ = ("fn", "__wrapped__")

    def __init__(self, fn, wraps=None):
        self.fn = fn
        self.__wrapped__ = wraps  # the block's own forward, for inspect.signature

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED)

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED)


def _post_accumulate(engine_ref, slot_ref, param) -> None:
    engine, slot = engine_ref(), slot_ref()
    if engine is not None and slot is not None:
        engine.on_grad(slot)


class _DeviceStateGrad(_Installed):
    """The post-accumulate-grad hook of a device-state param (install): one call per gradient
    of every adapter tensor, so it calls the engine directly, with no partial in between."""

    __slots__ = ("engine_ref", "slot_ref")

    def __init__(self, engine_ref, slot_ref):
        super().__init__(None)
        self.engine_ref, self.slot_ref = engine_ref, slot_ref

    def __call__(self, param) -> None:
        engine, slot = self.engine_ref(), self.slot_ref()
        if engine is not None and slot is not None:
            engine.on_device_state_grad(slot)


class _DeviceStateAveraged(_DeviceStateGrad):
    """The post hook of a device-state param's AccumulateGrad node under data parallel (install)."""

    __slots__ = ()

    def __call__(self, grad_inputs, grad_outputs) -> None:
        engine, slot = self.engine_ref(), self.slot_ref()
        if engine is not None and slot is not None:
            engine.on_device_state_averaged(slot)


class Engine:
    def __init__(self, model, optimizer, plan, backend, layout, ranks=None):
        """`layout`: the model's units (layout.py), as planned; `plan`: every decision;
        `ranks`: the RankGroups to train data parallel over (distributed.py), or None."""
        self.model = model
        self.optimizer = optimizer
        self.plan = plan
        self.backend = backend
        self.stack = layout.stack
        self.profile = profile = plan.profile
        self.opts = opts = plan.options
        self.block_units = layout.block_units
        self.outside_units = layout.outside_units
        self.units = self.block_units + self.outside_units
        set_device_state(self.units, plan.device_state)  # before any manager reads unit.trainable
        self.events = EventLog(opts.verbose)
        self.steps = 0
        self.mode = "offload"  # "stock" once offload="auto" has switched
        self._last_grad_norm = None
        # The model's outputs, as (forward, index), whose gradient the open pass got, and those
        # of passes that raised: a backward over those again is refused (_output_grad).
        self._forward_count = 0
        self._pass_outputs: set = set()
        self._raised_outputs: set = set()
        self.ledger = TransferLedger(plan.max_inflight_bytes)  # device memory transfers hold
        quantized = {s: (plan.quantize, plan.quant_block_size) for s in layout.quantizable if s.name in plan.quantized}
        self.weights = WeightPager(backend, self.units, self.ledger, plan.update_on_device, plan.paged, quantized)
        self.acts = ActivationPager(backend, self.ledger, self.block_units, plan.act_paged)
        for u in self.block_units:
            set_recompute(u, u.block in plan.recompute)
        self.grads = GradStreamer(
            backend,
            self.units,
            self.update_order(),
            self.ledger,
            GradSettings(
                accumulation_steps=opts.accumulation_steps,
                clip=opts.max_grad_norm is not None,
                on_device=plan.device_grads,
                threads=opts.threads,
                # Data parallel checks the reduced gradients instead, alike on every rank
                # (distributed.py, [Note: collective order]).
                nonfinite="ignore" if ranks is not None else opts.nonfinite,
            ),
            self.events,
        )
        self.meter = ActivationMeter(self.weights.resident_storages)
        self.adapter = Adapter(
            backend,
            opts,
            self.block_units,
            self.outside_units,
            self.meter,
            profile,
            layout.unpageable,
            layout.on_device,
            self.events,
            averaging=stock_averaging_bytes(ranks, backend.device, self.units),
        )
        self.adapter.slab_bytes = lambda: self.acts.slab_bytes  # a pass that pins slabs is not timed
        self.state_hooks = StateHooks(model, self.units, backend, self.weights)
        self.linears = FrozenLinears(self.weights, self._hooks_for)  # [Note: frozen linears]
        # optimizer_mode="gpu": the moments (and what else the kernel reads from host memory)
        # in one arena, pinned on a GPU.
        arena = HostArena(backend, plan.mapped_bytes) if plan.mapped_bytes else None
        self.moments = self._lay_out_moments(arena, data_parallel=ranks is not None) if arena is not None else None
        self.updates = Updater(
            backend, optimizer, self.grads, self.weights, self.moments, self.ledger, self.update_order()
        )
        self.device_state = DeviceState(
            optimizer,
            [s for u in self.update_order() for s in u.device_state_slots],
            backend,
            backward_order=self._device_state_reduction_order() if ranks is not None else None,
        )
        self._entered: set = set()  # blocks whose backward has started this pass
        # Whether backward marks each block's start (watch_backward), and the PlanEpoch it was
        # decided at: it changes only with a unit's plan fields (a replan, the online guard).
        self._marks_blocks = False
        self._marks_epoch = -1
        # unit -> its saved-tensor hooks (pack, unpack) and its backward-start hook, made once
        self._unit_hooks: dict = {}
        self._backward_hooks: dict = {}
        self._handles: list = []
        self._accumulators: list = []  # AccumulateGrad nodes hooked (autograd holds them only weakly)
        self._forwards: dict = {}  # block module -> its own forward attribute, if it had one
        self._applies: dict = {}  # module -> its own _apply attribute, if it had one (install)
        self._warned_groups: set = set()  # param groups warned about hyper-parameters changed after queuing
        self.dp = None  # data parallel: the DataParallel every unit's gradients and weights go through
        self.ranks = ranks  # data parallel: the engine's groups, given back at unwrap (release_groups)
        self._stock_grads = None  # data parallel after the switch to stock: the gradients' averaging
        self._dp_bad = None  # data parallel: the first unit of this window found not finite
        self._dp_skipped: list = []  # data parallel: the units of this window skipped for it
        self._dp_dropped = False  # data parallel: some rank's backward raised in this window
        self._dp_nonfinite = None  # data parallel: the first unit of this window some rank found not finite
        if ranks is not None:
            self.dp = DataParallel(
                ranks,
                self.units,
                self.update_order(),
                self._window_grad,
                opts.nonfinite != "ignore",
                learn=not self.grads.hold,
                take=arena.take if arena is not None else None,  # the reduced shards the kernel reads
            )
            optimizer.shard_state(self.dp.shard_ranges(), self.dp.full_tensor, self.dp.rank)
        if self.moments is not None:
            # After shard_state: whole moments the optimizer holds (converted) are cut to this
            # rank's shard before they are copied into the regions.
            optimizer.pin_state(self.moments.views())
        # Data parallel: device state is replicated on every rank and its gradients averaged
        # over the ranks at the window's last pass ([Note: averaging buckets]).
        self.ds_average = self._device_state_average(ranks)
        self._ds_by_unit = self._device_state_order_decides()
        # Backward's order of the device-state gradients is recorded where it decides what a
        # non-finite gradient skips (eager updates) or which parameter it is reported by (any
        # checked window, as the host path reports the first in that order). Read on every
        # device-state gradient. Not with data parallel: each rank's order could differ, and
        # the decisions must be alike on every rank (the fixed reduction order stands in).
        self._ds_order = (
            len(self.device_state) > 0 and self.dp is None and (self._ds_by_unit or opts.nonfinite != "ignore")
        )
        self._log_plan()

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED)

    def _device_state_reduction_order(self) -> list:
        """The device-state slots in the order their gradients are averaged, the same on every
        rank: units last to first, each unit's params last to first (about backward's order)."""
        return [s for u in reversed(self.update_order()) for s in reversed(u.device_state_slots)]

    def _device_state_average(self, ranks) -> BucketAverage | None:
        """Data parallel with device state: its gradients' averaging (None otherwise). The
        reduction group then carries nothing else during backward: the plan puts every
        trainable param in device state or none ([Note: averaging buckets]: another
        collective issued there in backward would pair differently on each rank)."""
        if ranks is None or not len(self.device_state):
            return None
        if self.dp.shards:
            raise RuntimeError("trainstream internal: device state beside host-path gradients under data parallel")
        params = [s.param for s in self._device_state_reduction_order()]
        return BucketAverage(ranks.reduce, ranks.user, params, self.backend.device)

    def _describe_device_state_average(self) -> str:
        average, n = self.ds_average, len(self.ds_average.buckets)
        where = "on the device over nccl" if average.on_device else "over gloo from host copies"
        return (
            f"data parallel: rank {self.dp.rank} of {average.world}; device state replicated on every rank (each "
            f"holds its whole weights, gradients and moments); its gradients averaged over the {average.world} "
            f"ranks before the update (their mean, as DDP), in {n} bucket{'s' if n != 1 else ''} {where}, each "
            "launched as the window's last backward pass completes it"
        )

    def _lay_out_moments(self, arena, data_parallel: bool) -> MomentStager:
        """optimizer_mode="gpu": the moments laid out in regions of `arena` (moments.py), then
        the gradient sums with accumulation, which the kernel reads; under data parallel the
        kernel reads the reduced shards instead, which DataParallel takes next (the order
        placement._moment_arena_sizes counts)."""
        regions = lay_out(
            self.units, self.optimizer.moment_dtype, self.plan.region_bytes, self.plan.copy_bytes, arena.take
        )
        if self.opts.accumulation_steps > 1 and not data_parallel:
            self.grads.use_sum_buffers(arena.take)
        return MomentStager(self.backend, self.ledger, regions)

    def _log_plan(self) -> None:
        plan, events, backend, opts = self.plan, self.events, self.backend, self.opts
        events.add(f"device {backend.device}; {self.stack.describe()}")
        events.add(self.profile.describe())
        for note in plan.placement_notes:
            events.add(note)
        events.add(
            f"weights: {len(plan.paged)} blocks paged {list(plan.paged)}, "
            f"{len(self.block_units) - len(plan.paged)} resident; activations paged for blocks {list(plan.act_paged)}"
        )
        for note in plan.moment_notes:
            events.add(note)
        moments = str(plan.moment_dtype).replace("torch.", "")
        n_trainable = sum(len(u.trainable) for u in self.units)
        if plan.update_on_device:
            events.add(
                f"optimizer: GPU AdamW over {'pinned ' if backend.is_cuda else ''}host moments ({moments}), "
                f"copied through VRAM around one kernel each, in regions of up to "
                f"{plan.region_bytes / MiB:.1f} MiB (one tensor alone: {plan.copy_bytes / MiB:.1f} MiB), "
                f"{n_trainable} trainable tensors; gradients "
                + (
                    "stay on the device until their update"
                    if plan.device_grads
                    else "land in host memory (clipping or accumulation needs them there)"
                )
            )
        else:
            on_device = sum(len(u.device_state_slots) for u in self.units)
            events.add(
                f"optimizer: host AdamW, moments {moments}, {n_trainable} trainable tensors"
                + (
                    f" (and {on_device} in device state, updated on the device when the host path would update them)"
                    if on_device
                    else ""
                )
            )
        for note in plan.mode_notes:
            events.add(note)
        if opts.offload == "auto":
            events.add(
                f"offload='auto': after {Adapter.SWITCH_AFTER} measured steps, switches to "
                "torch.optim.AdamW(fused=True) on the device if stock training fits"
            )
        for note in plan.quant_notes:
            events.add(note)
        for note in plan.device_state_notes:
            events.add(note)
        if self.dp is not None and self.dp.shards:
            events.add(self.dp.describe())
        if self.ds_average is not None:
            events.add(self._describe_device_state_average())
        if not opts.guard_params:
            events.add("guard_params=False: step() waits for every update to reach the device before returning")

    # -- what the report and the tests read ------------------------------------------------------

    @property
    def update_on_device(self) -> bool:
        return self.plan.update_on_device

    @property
    def device_grads(self) -> bool:
        return self.plan.device_grads

    @property
    def max_inflight_bytes(self) -> int:
        return self.plan.max_inflight_bytes

    @property
    def budget(self) -> dict:
        return self.plan.budget

    @property
    def history(self) -> list:
        return self.adapter.history

    @property
    def activation_bytes(self) -> dict:
        return self.meter.activation_bytes

    @property
    def activation_cast(self) -> dict:
        return self.meter.activation_cast

    @property
    def last_grad_norm(self):
        if self.mode == "stock" and self.optimizer.stock_steps:
            return self.optimizer._stock_grad_norm
        return self._last_grad_norm

    @property
    def steps_taken(self) -> int:
        """Optimizer steps since wrap(), in either mode."""
        return self.steps + self.optimizer.stock_steps

    # -- installing ----------------------------------------------------------------------------

    def install(self) -> None:
        """Put the plan into effect on the model: weights where the plan placed them, hooks
        on the model, its blocks and its parameters, the optimizer attached. All or nothing:
        if any of it raises, the model is left as it was (uninstall) and the error goes on."""
        try:
            self._install()
        except BaseException:
            self.uninstall()
            raise

    def installed(self) -> None:
        """wrap() is done: the model's tensors from before install() (kept for uninstall())
        may go."""
        self.weights.placed()

    def uninstall(self) -> None:
        """Undo install(), whole or in part (a wrap() that failed): hooks and forwards off,
        every parameter and buffer back on the tensor it had."""
        self.optimizer.detach()
        self.remove()
        self.weights.unplace()
        for module, name, buf in reversed(self._moved_buffers):
            module._buffers[name] = buf
        self._moved_buffers = []

    def _install(self) -> None:
        self._moved_buffers = []  # (module, name, the buffer before install): what uninstall() puts back
        self.events.add(self.weights.place(stage=not self.plan.device_grads))
        if self.backend.is_cuda and pinned.fallback_note():
            self.events.add(pinned.fallback_note())
        for module in self.model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.device != self.backend.device:
                    self._moved_buffers.append((module, name, buf))
                    module._buffers[name] = buf.to(self.backend.device)
        self._handles.append(self.model.register_forward_pre_hook(_Installed(lambda m, a: self.before_forward())))
        self._handles.append(self.model.register_forward_hook(_Installed(lambda m, a, out: self.after_forward(out))))
        for unit, block in zip(self.block_units, self.stack.blocks):
            self._forwards[block] = block.__dict__.get("forward")
            block.forward = self._block_forward(unit, block.forward)
        self.linears.install(self.model, self.stack.blocks, self.block_units, _Installed)
        # The hook dict is owned by the parameter's C++ autograd metadata, which Python's
        # cyclic GC cannot see: a hook holding the engine (-> model -> param) or the slot
        # (-> param) strongly would make param, engine and model immortal. So the hook
        # holds both weakly; they are alive whenever backward can run.
        me = weakref.ref(self)
        for unit in self.units:
            for slot in unit.trainable:
                self._handles.append(
                    slot.param.register_post_accumulate_grad_hook(
                        _Installed(functools.partial(_post_accumulate, me, weakref.ref(slot)))
                    )
                )
            # Every device-state param gets a hook: it begins a pass that never reaches the
            # model's outputs (a loss on a parameter alone), as the host path's does; it also
            # records the order backward completes units in (device_state.py, self._ds_order).
            if len(self.device_state):
                for slot in unit.device_state_slots:
                    self._handles.append(
                        slot.param.register_post_accumulate_grad_hook(_DeviceStateGrad(me, weakref.ref(slot)))
                    )
            # Data parallel averages what p.grad holds after every hook on the tensor, a user's
            # registered after wrap() included, as DDP does: from a post hook of the param's
            # AccumulateGrad node, which runs after them all (hookpoints.grad_accumulator).
            if self.ds_average is not None:
                for slot in unit.device_state_slots:
                    accumulator = grad_accumulator(slot.param)
                    self._accumulators.append(accumulator)
                    self._handles.append(accumulator.register_hook(_DeviceStateAveraged(me, weakref.ref(slot))))
        self.state_hooks.install()
        # model.to(), .double(), .half(), .cuda(), ... on the model or any submodule: each
        # module's _apply runs first, so each refuses there, before anything has changed.
        for module in self.model.modules():
            self._applies[module] = module.__dict__.get("_apply")
            module._apply = _Installed(functools.partial(self._converting, module, module._apply))
        self.optimizer.attach(self)
        if self.ds_average is not None:  # replicated: every rank starts from rank 0's, as under DDP
            take_rank_zeros(self.ranks.reduce, [s.param for s in self.device_state.slots])

    def _converting(self, module, apply, fn, *args, **kwargs):
        self.weights.check_conversion(module, fn)
        return apply(fn, *args, **kwargs)

    def remove(self) -> None:
        """Every hook off the model; the lander (and data parallel's gather) thread stopped."""
        self.weights.stop()
        if self.dp is not None:
            self.dp.stop()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._accumulators = []
        for block, own in self._forwards.items():
            if own is None:
                block.__dict__.pop("forward", None)  # absent if install() failed before patching it
            else:
                block.forward = own
        self._forwards = {}
        self.linears.remove()
        for module, own in self._applies.items():
            if own is None:
                module.__dict__.pop("_apply", None)
            else:
                module._apply = own
        self._applies = {}
        self.state_hooks.remove()

    def unwrap(self) -> None:
        """Every update finished, every weight back on the device in the model's dtype, every
        hook removed; the optimizer keeps its state but no longer steps."""
        self.synchronize()
        if self.dp is not None:  # the optimizer keeps whole moments from here on (a collective)
            self.optimizer.shard_state(None)
        self.remove()
        self.weights.restore()
        self.optimizer.detach()
        self.optimizer.pin_state({})  # a later load replaces the state, not the regions' bytes
        self.moments = None  # the regions (the optimizer's state still holds the moments)
        self.updates.close()

    # -- forward -------------------------------------------------------------------------------

    def _in_backward(self) -> bool:
        return self.grads.in_backward or in_autograd()

    def before_forward(self) -> None:
        self.recover()
        if self._in_backward():
            return  # a forward recomputed inside backward (checkpointing): nothing to move
        if self._queue(self.grads.poll()):
            self.weights.land_updates()
        for unit in self.block_units:
            if unit.streamed and unit.fetch is not Fetch.RELEASED:
                self.weights.release(unit)  # left over from a forward without backward
            if unit.acts:  # so too its storages (a graph still alive holds its own), before the pass
                self.acts.drop(unit)
        self.acts.new_pass()
        self.meter.new_pass()
        if torch.is_grad_enabled():
            self.adapter.new_pass()
        for unit in self.outside_units:
            self.weights.guard(unit)

    def after_forward(self, out) -> None:
        """The model's forward returned (an autocast around the call not yet left): the adapter
        reads what is allocated now and again when backward starts, at the first gradient of
        an output (see Adapter.forward_returns)."""
        if not torch.is_grad_enabled() or self._in_backward():
            return
        # Not on a leaf (a parameter or an input handed through): its hooks outlive the pass.
        outputs = [t for t in tensors_in(out) if t.requires_grad and not t.is_leaf]
        if not outputs:
            return
        self.adapter.forward_returns()
        self._forward_count += 1
        for i, t in enumerate(outputs):
            t.register_hook(functools.partial(self._output_grad, (self._forward_count, i)))

    def _output_grad(self, output, grad) -> None:
        """Backward reached the model's output: the pass starts in the outer backward, so its
        end callback runs when all of backward is done (a first gradient inside a reentrant
        checkpoint's own backward would tie it to that inner one)."""
        if output in self._raised_outputs or (self.grads.in_backward and output in self._pass_outputs):
            # A backward over a graph (kept with retain_graph=True) whose earlier backward
            # raised: that pass handed on its blocks' gradients and let their weights and paged
            # activations go, so this one cannot train on it, whether or not the pass that
            # raised was closed since (by a forward, step() or zero_grad()). An output's hook
            # runs once per backward, so one seen twice in the open pass is that case too.
            raise RuntimeError(
                "trainstream: backward() ran again over a graph whose earlier backward raised before its end; "
                "that pass's gradients are dropped (updates it queued before the error stand) and its blocks' "
                "weights and paged activations were let go: run the forward again, then backward"
            )
        if not self.grads.in_backward:
            self._begin_pass()
        self._pass_outputs.add(output)
        self.adapter.backward_starts(grad.untyped_storage().nbytes())

    def _block_forward(self, unit, forward):
        engine = self

        @functools.wraps(forward)
        def recomputable(*args, **kwargs):
            if not engine._in_backward():
                return forward(*args, **kwargs)
            # The recompute, inside the block's backward: its time is the block's forward_s
            # again, not its backward's (a checkpoint that stops early leaves through finally).
            aside = engine.adapter.aside_begins()
            try:
                engine.enter_block(unit)  # its weights back, as under a user's checkpoint
                return forward(*args, **kwargs)
            finally:
                engine.adapter.aside_ends(aside)

        def paged_forward(*args, **kwargs):
            # Nothing before the block's forward runs can start a backward: one test for what
            # runs before it (enter_block, the fault tests' entry point, tests again).
            in_backward = engine._in_backward()
            if not in_backward and engine.meter.measuring:  # before the guard, which reads them
                engine.meter.count_inputs(unit, tensors_in((args, kwargs)), engine.backend.device)
            engine.enter_block(unit)
            # A checkpoint around the block has its own saved-tensor hooks: ours would
            # override them (nothing recomputed, every activation kept), so a block whose
            # activations stay put leaves them be; its weights come back with the recompute.
            # A block whose streamed weights are all frozen Linears' saves none of them
            # ([Note: frozen linears]) and needs no hooks of ours either.
            foreign = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            grad = torch.is_grad_enabled()
            # The planner's recompute: a checkpoint of ours, never inside someone else's, nor
            # in backward (a forward recomputing there is already one). It keeps the block's
            # inputs only; its RNG state is kept, so dropout recomputes the same bits.
            recompute = unit.recompute and grad and not foreign and not in_backward and not _checkpoints_itself(forward)
            if recompute:
                refused = why_not_recompute(getattr(forward, "__self__", None) or torch.nn.Module(), args, kwargs)
                if refused is not None:
                    engine.recompute_refused(unit, refused)
                    recompute = False
            measure = not recompute and not in_backward and engine.meter.start()
            try:
                saves_weights = unit.streamed and not foreign and not engine.linears.serves(unit)
                if recompute:
                    out = recompute_call(recomputable, args, kwargs, engine.backend.device)
                elif (unit.act_paged or measure or saves_weights) and grad:
                    with torch.autograd.graph.saved_tensors_hooks(*engine._hooks_for(unit)):
                        out = forward(*args, **kwargs)
                else:
                    out = forward(*args, **kwargs)
            finally:
                engine._stop_counting(unit, measure)
                engine.exit_block(unit)
            engine.watch_backward(unit, out)
            return out

        return _Installed(paged_forward, wraps=forward)

    def enter_block(self, unit) -> None:
        if self._in_backward():
            self._enter_recompute(unit)
        else:
            self._enter_forward(unit)

    def _enter_recompute(self, unit) -> None:
        """A block recomputing its forward in backward (checkpointing). Backward is done with
        the blocks above the one after it; under reentrant checkpointing no backward hook of
        theirs released their fetched or dequantized weights."""
        for done in self.block_units[unit.block + 2 :]:
            if done.streamed and done.fetch is not Fetch.RELEASED:
                self.weights.release(done)
        self.weights.guard(unit)

    def _enter_forward(self, unit) -> None:
        grad = torch.is_grad_enabled()
        if unit.streamed and not unit.paged:
            # A resident unit's quantized weights are dequantized as its block starts, before the
            # guard reads what is allocated: the block holds them while it runs, and the guard's
            # projection must count them, as it counts a paged unit's weights, fetched ahead.
            self.weights.fetch(unit)
        if grad:
            choice = self.adapter.block_starts(unit, self.weights.fetched_bytes)
            if choice == "page":  # the online guard: this block's activations would not fit
                self.acts.page(unit, True)
            elif choice == "recompute":  # the guard again: recomputed in backward instead
                self._activations_leave(unit, recompute=True)
        if unit.acts:
            self.acts.drop(unit)
        self.weights.guard(unit)
        if grad:
            self.adapter.forward_begins(unit)
        nxt = unit.block + 1
        if nxt < len(self.block_units) and self.block_units[nxt].streamed:
            self.weights.fetch(self.block_units[nxt], ahead=True)

    def _activations_leave(self, unit, *, recompute: bool) -> None:
        """`unit`'s saved activations leave the device from its next forward on: recomputed in
        backward, or paged where recomputing it is refused (recompute_call.py)."""
        if recompute and unit.no_recompute is None:
            set_recompute(unit, True)
        else:
            set_recompute(unit, False)
            self.acts.page(unit, True)

    def recompute_refused(self, unit, reason: str) -> None:
        """A call of `unit`'s block must not run twice (`reason`): its activations are paged
        instead, from this call on, and the planner's later choices of recompute for it too."""
        first = unit.no_recompute is None
        unit.no_recompute = reason
        self._activations_leave(unit, recompute=False)
        if first:
            self.events.add(f"block {unit.block}: its activations paged instead of recomputed: {reason}")

    def exit_block(self, unit) -> None:
        if not self._in_backward():
            self._exit_forward(unit)

    def _exit_forward(self, unit) -> None:
        if torch.is_grad_enabled():
            self.adapter.block_ends(unit, self.weights.fetched_bytes)
        if not unit.streamed:
            return
        # The last block's backward comes first: a paged one keeps its weights for it (no
        # second crossing). A resident one's are dequantized again when its backward starts
        # (a hundredth of its compute), so the head and the loss, where the step peaks, run
        # without them ([Note: dequantized where used]).
        last = unit.block == len(self.block_units) - 1
        if not (last and unit.paged and torch.is_grad_enabled()):
            self.weights.release(unit)

    def _stop_counting(self, unit, counted: bool) -> None:
        self.meter.stop(unit, counted)

    def pack(self, unit, t: torch.Tensor):
        # [Note: saved outputs] A tensor kept as it is goes back to autograd detached: a saved
        # output packed as itself would hold its own grad_fn (tensor -> node -> saved tensor),
        # a cycle through C++ that no collection breaks, so a graph never taken backward (a
        # forward or backward that raised, a grad-enabled forward without backward) would
        # keep its activations, and through these hooks the engine and the model, for good.
        if t.device != self.backend.device or t.numel() == 0:
            return t.detach()
        ptr = t.untyped_storage().data_ptr()
        slot = self.weights.fetched_slot(t, ptr)
        if slot is not None:
            self.linears.saved(slot)
            return SavedWeight(slot, t)
        self.meter.count(t, unit)
        if (
            not unit.act_paged
            or ptr in self.weights.resident_storages
            or t.untyped_storage().nbytes() < self.opts.min_offload_bytes
        ):
            return t.detach()
        return self.acts.pack(t, unit)

    def _hooks_for(self, unit) -> tuple:
        """The saved-tensor hooks (pack, unpack) of `unit`'s block (made once per unit)."""
        hooks = self._unit_hooks.get(unit)
        if hooks is None:
            hooks = self._unit_hooks[unit] = (functools.partial(self.pack, unit), self.unpack)
        return hooks

    def unpack(self, packed):
        if isinstance(packed, SavedWeight):
            return self.weights.device_view(
                packed.slot, packed.dtypes, packed.dtype, packed.size, packed.stride, packed.offset
            )
        if isinstance(packed, PagedTensor):
            aside = self.adapter.aside_begins()  # a wait for the copy is PCIe time, not backward's compute
            try:
                return self.acts.unpack(packed)
            finally:
                self.adapter.aside_ends(aside)
        return packed

    # -- backward ------------------------------------------------------------------------------

    def watch_backward(self, unit, out) -> None:
        if not self._in_backward():
            self._watch(unit, out)

    def marks_blocks(self) -> bool:
        """Does backward mark each block's start (block_backward_starts)? When some block
        streams its weights, pages its activations or is recomputed (a recomputed block's
        backward is measured there too: Adapter.block_backward_starts). Decided again only
        after a plan field of some unit changed (PlanEpoch)."""
        if self._marks_epoch != PlanEpoch.value:
            self._marks_blocks = any(u.streamed or u.act_paged or u.recompute for u in self.block_units)
            self._marks_epoch = PlanEpoch.value
        return self._marks_blocks

    def _watch(self, unit, out) -> None:
        """`unit`'s forward returned `out` (not in backward): mark its backward's start."""
        if not torch.is_grad_enabled() or not self.marks_blocks():
            return
        hook = self._backward_hooks.get(unit)
        if hook is None:
            hook = self._backward_hooks[unit] = functools.partial(self._block_output_grad, unit)
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(hook)

    def _block_output_grad(self, unit, grad) -> None:
        self.block_backward_starts(unit)

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
            if done.acts:
                self.acts.drop(done)
        self.adapter.block_backward_starts(unit, self.weights.fetched_bytes)
        if unit.streamed and unit.fetch_dtypes:
            # Attached, not only fetched: a checkpointed part of the block recomputes its
            # forward during backward and reads the params directly.
            self.weights.attach(unit, dtypes=unit.fetch_dtypes)
        for rec in unit.acts:
            self.acts.fetch(rec)
        self.adapter.backward_begins(unit)
        if i > 0 and blocks[i - 1].streamed and blocks[i - 1].fetch_dtypes:
            self.weights.fetch(blocks[i - 1], ahead=True, dtypes=blocks[i - 1].fetch_dtypes)
        below = blocks[max(i - self.opts.prefetch_depth, 0) : i]
        if any(u.acts for u in below):
            # The plan holds this block's paged activations and those below it at once.
            window = self.acts.held_nbytes([unit, *below])
            for u in reversed(below):
                if u.acts:
                    self.acts.prefetch(u, window)

    def after_backward(self) -> None:
        self.adapter.sample()
        self.adapter.backward_ends(self.weights.fetched_bytes)
        for unit in self.block_units:
            if unit.streamed:
                self.weights.release(unit)
            if unit.acts:
                self.acts.drop(unit)
        self._entered.clear()
        self.acts.new_pass()

    def _begin_pass(self) -> None:
        self.grads.begin_pass()
        if self.ds_average is not None and self._last_pass():  # its gradients are averaged
            self.ds_average.begin()
        if self.dp is not None:  # the window's reductions are every rank's from its first pass on
            self.dp.begin()
        if self._ds_order:
            self.device_state.new_pass()  # the order recorded is this pass's
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def on_grad(self, slot) -> None:
        """autograd finished `slot`'s gradient (the post-accumulate-grad hook)."""
        if not self.grads.in_backward:
            self._begin_pass()
        if self._queue(self.grads.on_grad(slot)):
            self.weights.land_updates()

    def on_device_state_grad(self, slot) -> None:
        """autograd finished a device-state param's gradient. A backward that never reached
        the model's outputs begins its pass here, as on_grad begins the host path's; it also
        records backward's order (self._ds_order)."""
        if not self.grads.in_backward:
            self._begin_pass()
        if self._ds_order:
            self.device_state.on_grad(slot)

    def on_device_state_averaged(self, slot) -> None:
        """Data parallel: `slot`'s gradient is in p.grad, every hook on it run; in the window's
        last pass it goes to be averaged."""
        if self._last_pass():
            self.ds_average.landed(slot.param)

    def _last_pass(self) -> bool:
        """The pass running (or just ended) is its window's last: its gradients are final for
        the window (the passes are counted from each one's first gradient, alike on every
        rank)."""
        return self.grads.passes == self.opts.accumulation_steps

    def _end_pass(self) -> None:
        """autograd's final callback of a backward pass: the units not handed on yet go now."""
        try:
            if self.ds_average is not None and self._last_pass():  # before any other collective
                self.ds_average.finish()
            self._queue(self.grads.end_pass())
            if self.dp is not None and self._dp_window_ends_in_backward():
                self._apply_reduced(self.dp.drain())
                self._dp_end_window()
            self._device_state_pass_ends()
            self.weights.land_updates()
        except BaseException:
            queued = self.grads.describe_queued()
            self._discard_reductions()
            self.grads.drop_pass()  # no half-landed state for the next pass to count
            self.device_state.drop()  # nor device state's (recover() drops both too)
            self.events.add("the end of a backward pass raised: its gradients were dropped" + queued)
            self._raised_outputs |= self._pass_outputs
            raise
        finally:
            self._pass_outputs = set()
            self.grads.close_pass()
            self.after_backward()
            self._report_skipped()

    def recover(self) -> None:
        """A backward pass that raised left its pass open: close it (its gradients dropped).
        Data parallel: its reductions are completed first, while the window's bookkeeping
        still stands (the units they apply are queued in it, and the events list them)."""
        if self.grads.abandoned():
            self._raised_outputs |= self._pass_outputs
            self._pass_outputs = set()
            self._discard_reductions()
            self.grads.raised_pass()
            self._device_state_pass_raised()
            self.device_state.drop()  # the window's gradients go with the host path's
            self.after_backward()
        self._report_skipped()

    def _discard_reductions(self) -> None:
        """Data parallel: a pass that raised on this rank completes its collectives. The host
        path keeps the updates of the units every rank sent before the exception (with eager
        updates; a held window keeps nothing) and drops the rest, as every other rank does
        ([Note: a pass some rank drops, host path]); device state keeps nothing of it."""
        if self.dp is not None:
            reduced = self.dp.discard()
            if not self.grads.hold:
                self._apply_reduced(reduced)
            kept = [r.shards.unit.name for r in reduced if r.shards.unit.window is GradWindow.QUEUED]
            if reduced:  # the pass had begun here: what every rank keeps of it
                self.events.add(
                    "data parallel: this rank's backward pass raised; its reductions were completed on every rank, "
                    + (f"the updates of {kept} stand there too" if kept else "and no unit is updated from them")
                )
            nonfinite = self._dp_nonfinite or next((r.shards.unit for r in reduced if not r.finite), None)
            self._dp_count_nonfinite(nonfinite, self._dp_skipped or [r.shards.unit for r in reduced])
            self._dp_bad, self._dp_skipped, self._dp_dropped, self._dp_nonfinite = None, [], False, None
        if self.ds_average is not None:
            self.ds_average.discard()

    def _report_skipped(self, wait: bool = False) -> None:
        """Units whose update a non-finite gradient made the streamer skip: into the events,
        and the window into optimizer.skipped_steps (once). A skip the device decided is known
        once its update has run: those that have are taken in here, or all of them (`wait`)."""
        self.grads.settle_device_checks(wait=wait)
        self._settle_device_state(wait)
        while (found := self.grads.take_skipped(self.steps + 1)) is not None:
            first, units, first_report, step = found
            if first_report:
                self.optimizer.count_skipped_step()
            what = f"the gradient of {first.name} is not finite" if first is not None else "a gradient is not finite"
            self.events.add(
                f"step {step}: {what}: skipped the updates of {[u.name for u in units]} (nonfinite='skip'; "
                "their weights, moments and step counts are unchanged)"
            )

    def report_skipped(self) -> None:
        """Wait for every update still to say whether the device skipped it, and report those
        it did (optimizer.skipped_steps reads this)."""
        self._report_skipped(wait=True)

    # -- the optimizer's side --------------------------------------------------------------------

    def _queue(self, units, grad_scale: float = 1.0) -> bool:
        """Queue the update of each unit the gradient streamer hands on, as it hands it on;
        True if there was any. Data parallel: each unit is reduced first, and the units whose
        reduction has finished are queued."""
        if self.dp is not None:
            for unit in units:
                self.dp.offer(unit)
            if self.grads.hold:  # a held window is applied whole, at its end (_apply_reduced)
                return False
            return self._apply_reduced(self.dp.ready(), grad_scale)
        queued = False
        for unit in units:
            self.queue_update(unit, grad_scale)
            queued = True
        return queued

    # -- data parallel (distributed.py) ------------------------------------------------------

    def _window_grad(self, slot):
        """This rank's gradient of `slot` for the window, on the host (None: it has none)."""
        if not slot.has_grad:
            return None
        if slot.reader is not None:  # an accumulation job may still be adding into the sum
            slot.reader.wait()
        return self.grads.grad_of(slot)

    def _dp_window_ends_in_backward(self) -> bool:
        """The window's last pass ends here and no step() holds the updates (clipping)."""
        return self.opts.max_grad_norm is None and self.grads.passes == self.opts.accumulation_steps

    def _apply_reduced(self, reduced: list, grad_scale: float = 1.0) -> bool:
        """Queue this rank's update of each reduced unit's shard and the gather of the new
        weights after it. A unit some rank found not finite, and every one after it in the
        window, is not updated (every rank decides it from the same reduced flags); in a held
        window (clipping, accumulation), which comes here whole, none of it is, as one
        process skips a held window whole."""
        if any(r.dropped for r in reduced):
            self._dp_dropped = True
        if self._dp_nonfinite is None:
            self._dp_nonfinite = next((r.shards.unit for r in reduced if not r.finite), None)
        if self.grads.hold and self._dp_bad is None:
            bad = next((r.shards.unit for r in reduced if r.dropped or not r.finite), None)
            if bad is not None:
                self._dp_bad = bad
                self._dp_skipped = [r.shards.unit for r in reduced]
                return False
        queued = False
        for r in reduced:
            unit = r.shards.unit
            if (r.dropped or not r.finite) and self._dp_bad is None:
                self._dp_bad = unit
            if self._dp_bad is not None:
                self._dp_skipped.append(unit)
                continue
            present = [(sh, r.shards.grad(sh)) for sh, p in zip(r.shards.slots, r.present) if p]
            if not present:
                continue  # no rank had a gradient for it
            slots = [sh.slot for sh, _ in present]
            jobs = self.updates.queue_shard(unit, slots, [g for _, g in present], grad_scale)
            handle = self.dp.gather(unit, jobs, slots)
            self.weights.host_update_queued(unit, [handle])
            self.grads.queued(unit)
            queued = True
        return queued

    def _dp_end_window(self) -> None:
        """The window's reductions are all applied: a non-finite one skipped the rest of it
        (into the events and optimizer.skipped_steps) or, with nonfinite="raise", raises here,
        on every rank, once every rank has finished the window's collectives."""
        bad, skipped, dropped, nonfinite = self._dp_bad, self._dp_skipped, self._dp_dropped, self._dp_nonfinite
        self._dp_bad, self._dp_skipped, self._dp_dropped, self._dp_nonfinite = None, [], False, None
        if bad is None:
            return
        if dropped:  # [Note: a pass some rank drops, host path]
            self._dp_count_nonfinite(nonfinite, skipped)
            self.grads.drop_pass()  # the next window starts clean
            self.updates.end_window()
            what = (
                "nothing of this window is updated on any rank"
                if self.grads.hold
                else f"the units from {bad.name} on are updated on no rank (the updates of the units every rank "
                "had sent before it stand)"
            )
            raise RuntimeError(
                f"trainstream: the backward pass raised on another rank, so {what}: {[u.name for u in skipped]} "
                "dropped on every rank; zero_grad() and go on as that rank does"
            )
        if self.opts.nonfinite == "raise":
            self.grads.drop_pass()  # the next window starts clean
            self.updates.end_window()
            raise FloatingPointError(
                f"trainstream: a gradient of {bad.name} is not finite on some rank (wrap(nonfinite='raise')); "
                "this window's updates from it on are dropped on every rank"
            )
        self.optimizer.count_skipped_step()
        self.events.add(
            f"step {self.steps + 1}: a gradient of {bad.name} is not finite on some rank: skipped the updates of "
            f"{[u.name for u in skipped]} on every rank (nonfinite='skip'; their weights, moments and step "
            "counts are unchanged)"
        )

    def _dp_count_nonfinite(self, bad, skipped: list) -> None:
        """A window dropped for a pass that raised on some rank, in which some rank also found
        a gradient of `bad` not finite (None: none): the events say so and, with eager
        updates, it counts as a skipped step, as one process counts a unit it skipped before
        the exception (a held window is dropped whole uncounted, as one process drops it;
        nothing with nonfinite="ignore")."""
        if bad is None or self.opts.nonfinite == "ignore":
            return
        if self.grads.hold:
            self.events.add(
                f"a gradient of {bad.name} is not finite on some rank, in a held window a backward that raised "
                "dropped on every rank (not counted as a skipped step: nothing of the window was to be updated)"
            )
            return
        self.optimizer.count_skipped_step()
        self.events.add(
            f"step {self.steps + 1}: a gradient of {bad.name} is not finite on some rank, in a window a backward "
            f"that raised dropped: skipped the updates of {[u.name for u in skipped]} on every rank"
        )

    def _dp_step(self, pending: list, on_device: list) -> tuple[float, list]:
        """step() with data parallel. With clipping the window's units are reduced now, and
        the global norm is taken over every rank's reduced shards and the device-state
        gradients (`on_device`, averaged already). Without it the window was reduced at the
        end of its last backward pass, unless step() ends it early (fewer passes than
        accumulation_steps: the last partial batch of an epoch), which one process updates
        from: then it is reduced now. Whether the window is open is read from the passes,
        which every rank counts alike, not from `pending`, which is empty on a rank with no
        gradients (every rank must issue the same collectives). Returns the scale of the
        device-state update and the slots it updates (none: the window was skipped)."""
        if self.opts.max_grad_norm is None:
            if self.grads.passes == 0 or self._dp_window_ends_in_backward():
                return 1.0, on_device  # no window, or reduced and applied at the end of its last pass
            for unit in pending:
                self.dp.offer(unit)
            self._apply_reduced(self.dp.ready() + self.dp.drain())
            self._dp_end_window()
            return 1.0, on_device
        if self.grads.passes == 0:
            return 1.0, on_device  # no window (a pass that raised dropped it on this rank and completed it)
        for unit in pending:
            self.dp.offer(unit)
        reduced = self.dp.ready() + self.dp.drain()
        if any(r.dropped for r in reduced):  # every rank reads it alike: no norm is reduced
            self._apply_reduced(reduced)
            self.device_state.drop()
            self._dp_end_window()
        square = self.dp.global_sq_norm(reduced) + self._device_state_sq_norm(on_device)
        total = torch.tensor(math.sqrt(square), dtype=torch.float32)
        self._last_grad_norm = float(total)
        finite = math.isfinite(self._last_grad_norm) and all(r.finite for r in reduced)
        bad = None if finite or self.opts.nonfinite == "ignore" else self._dp_first_nonfinite(reduced, on_device)
        if bad is not None:
            self._dp_bad = bad
            self._dp_skipped = [r.shards.unit for r in reduced] + list(dict.fromkeys(s.unit for s in on_device))
            self.device_state.drop()
            self._dp_end_window()
            return 1.0, []
        scale = float(torch.clamp(self.opts.max_grad_norm / (total + 1e-6), max=1.0))
        self._apply_reduced(reduced, scale)
        self._dp_end_window()
        return scale, on_device

    def _device_state_sq_norm(self, slots) -> float:
        """The squared norm of the device-state gradients of `slots`, as _global_norm takes
        it. Data parallel: they are averaged already, the same on every rank, so they count
        once (the host path's shards are summed over the ranks instead)."""
        if not slots:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(self.device_state.norms(slots)), 2.0)) ** 2

    def _dp_first_nonfinite(self, reduced: list, on_device: list):
        """A clipped window whose global norm is not finite: what it is named by (a unit some
        rank found not finite, else the first device-state slot whose averaged gradient is
        not, else the first unit reduced), or None where only the norm of finite device-state
        gradients overflowed (the update goes on, scaled by zero, as one process's does)."""
        bad = next((r.shards.unit for r in reduced if not r.finite), None)
        if bad is None:
            bad = self.device_state.first_nonfinite(on_device)
        if bad is None and reduced:
            bad = reduced[0].shards.unit
        return bad

    def queue_update(self, unit, grad_scale: float = 1.0) -> None:
        self.updates.queue(unit, grad_scale)
        self.grads.queued(unit)

    def update_order(self) -> list:
        # Forward order: the next forward needs the outside modules (embeddings) and block 0 first.
        return self.outside_units + self.block_units

    def step(self) -> None:
        self.recover()
        if self.grads.in_backward:
            raise RuntimeError("trainstream: optimizer.step() called during backward")
        self._warn_changed_hyperparameters()
        if self.ds_average is not None and 0 < self.grads.passes < self.opts.accumulation_steps:
            # A window step() ends early (every rank ends it after the same passes): its sums
            # are averaged now, before anything else communicates.
            self.ds_average.finish()
        self._queue(self.grads.flush())
        pending = self.grads.take_pending()
        on_device = self.device_state.with_grads() if self._device_state_held() else []  # updated below
        scale = 1.0
        if self.dp is not None:
            scale, on_device = self._dp_step(pending, on_device)
        elif pending or on_device:
            if self.opts.max_grad_norm is not None:
                slots = [s for u in self.units for s in u.trainable if s.has_grad]
                total = self._global_norm(slots, on_device)
                self._last_grad_norm = float(total)
                if not math.isfinite(self._last_grad_norm) and self.opts.nonfinite != "ignore":
                    first = self.grads.first_nonfinite_in_window(slots)
                    self._nonfinite_window(first if first is not None else self.device_state.first_nonfinite(on_device))
                    pending = self.grads.take_pending()  # none, unless the norm alone overflowed
                clip = torch.clamp(self.opts.max_grad_norm / (total + 1e-6), max=1.0)
                scale = float(clip)
            self._queue(pending, scale)
        if self.grads.nonfinite is not None:
            self.grads.skip_window()  # a held window found not finite before its end
        self._report_skipped()
        self._step_device_state(on_device, scale)
        self.updates.end_window()
        self.grads.reset_window()
        self.steps += 1
        self.weights.land_updates()
        if not self.opts.guard_params:
            self.synchronize()
        decision = self.adapter.after_step(explicit_paging(self.opts) or quantized(self.units))
        if self.dp is not None and self.opts.offload == "auto" and self.adapter.steps == Adapter.SWITCH_AFTER:
            decision = self._dp_agree_on_switch(decision)
        self.apply(decision)

    def _dp_agree_on_switch(self, decision):
        """offload='auto' with data parallel: the switch to stock happens on every rank or on
        none (a collective; placement decisions stay each rank's own: nothing in them
        communicates)."""
        wants = isinstance(decision, SwitchToStock)
        if agree(self.dp.reduce_group, wants):
            return decision
        if wants:
            self.events.add("offload='auto': stock training fits here but not on every rank: the engine stays")
            return None
        return decision

    def _global_norm(self, slots, on_device) -> torch.Tensor:
        """The global gradient norm over the host path's window gradients (`slots`) and the
        device-state ones (`on_device`): as torch's clip_grad_norm_, the norm of the
        per-gradient norms (the host sums' norm, with accumulation, as one of them)."""
        if not on_device:
            return self.grads.global_norm(slots)
        norms = self.device_state.norms(on_device)
        if slots:
            norms.append(self.grads.global_norm(slots).to(norms[0].device))
        return torch.linalg.vector_norm(torch.stack(norms), 2.0).cpu()

    # -- device state (device_state.py): the host path's timing ---------------------------------

    def _device_state_by_unit(self) -> bool:
        return self._ds_by_unit

    def _device_state_order_decides(self) -> bool:
        """Eager updates: the host path updates each unit as backward completes it, so a
        non-finite gradient skips the unit found and every unit after it in backward's order,
        and a backward pass that raises keeps the updates of the units completed before it.
        The order is recorded (device_state.on_grad) and the update goes unit by unit; with
        data parallel the fixed reduction order stands in for it (DeviceState), and a pass that
        raises keeps nothing (its gradients were never averaged). Held windows are applied, or
        skipped, whole. Fixed at wrap(): the options and the device-state slots never change
        after it."""
        opts = self.opts
        return opts.max_grad_norm is None and opts.accumulation_steps == 1 and len(self.device_state) > 0

    def _device_state_held(self) -> bool:
        """step() applies the device-state window: with clipping (held for step(), as the host
        path's), or a window step() ends before its last pass (fewer passes than
        accumulation_steps, whose end would have applied it)."""
        passes = self.grads.passes
        return passes > 0 and (self.opts.max_grad_norm is not None or passes < self.opts.accumulation_steps)

    def _device_state_pass_ends(self) -> None:
        """The end of a backward pass (_end_pass): without clipping, the window's last pass
        queues the device-state update, where the host path's eager updates are queued.
        nonfinite="raise" checks every pass, as the host path checks each pass's gradients
        as they land (autograd's sum carries a value that is not finite on): it raises here,
        from loss.backward(), after queuing the units before the one found (eager updates),
        and _end_pass drops the window."""
        if not len(self.device_state) or self.opts.max_grad_norm is not None:
            return  # nothing on the device, or held for step()
        by_unit = self._device_state_by_unit()
        last = self._last_pass()
        if self.dp is not None and not last:
            return  # data parallel: checked once averaged, alike on every rank (a sum keeps a value not finite)
        if self.opts.nonfinite == "raise":
            batches = self.device_state.batches(by_unit)
            bad = self.device_state.first_nonfinite([s for _, ss in batches for s in ss])
            if bad is not None:
                before = batches[: next(i for i, (_, ss) in enumerate(batches) if bad in ss)] if by_unit else []
                self._update_device_state(before)
                if before:
                    self.events.add(f"device-state updates queued before it stand, for {[u.name for u, _ in before]}")
                raise FloatingPointError(
                    f"trainstream: the gradient of {bad.name} is not finite (wrap(nonfinite='raise')); "
                    "this backward pass's gradients are dropped"
                )
            if last:
                self._update_device_state(batches, merge=True)  # checked: one launch per group will do
            return
        if last:
            check = self.opts.nonfinite == "skip"
            self._update_device_state(self.device_state.batches(by_unit), check=check, merge=not check)

    def _device_state_pass_raised(self) -> None:
        """A backward pass raised (recover): with eager updates the host path kept the
        updates of the units backward had completed before the exception, so device state
        queues those units' updates now (checked as at a pass's end; with nonfinite="raise"
        only those before a gradient not finite, which the events name, as the host path's
        check at each unit's hand-on names it); the rest of the pass is dropped. A held window
        keeps nothing; a gradient of it found not finite is named the same way (not with
        clipping, whose check is the global norm at step())."""
        if not len(self.device_state):
            return
        if self.dp is not None:  # nothing of a pass that raised was averaged: it keeps nothing
            self.device_state.new_pass()
            return
        if not self._device_state_by_unit():
            if self._ds_order and self.opts.max_grad_norm is None:
                # the window's sums: a find of an earlier pass of it is still in p.grad
                bad = self.device_state.first_nonfinite()
                if bad is not None:
                    self.events.add(found_before_an_exception(bad, self.opts.nonfinite))
            self.device_state.new_pass()  # the pass's order is forgotten
            return
        batches = self.device_state.completed_batches()
        if self.opts.nonfinite == "raise":
            bad = self.device_state.first_nonfinite([s for _, ss in batches for s in ss])
            if bad is not None:
                self.events.add(found_before_an_exception(bad, "raise"))
                batches = batches[: next(i for i, (_, ss) in enumerate(batches) if bad in ss)]
        self._update_device_state(batches, check=self.opts.nonfinite == "skip")
        if batches:
            self.events.add(
                f"device-state updates of units completed before it stand, for {[u.name for u, _ in batches]}"
            )

    def _update_device_state(self, batches, grad_scale: float = 1.0, check: bool = False, merge: bool = False) -> None:
        """Queue the device-state update of `batches` (device_state.py); its hyper-parameters
        noted per unit as the host path's queued updates note them (step() warns of a change
        after). `merge`: nothing is checked, so the order of the batches decides nothing and
        they go as one (fewer launches)."""
        if not batches:
            return
        self._settle_device_state(wait=True)  # the step counts the update reads (as a rule long settled)
        for unit, slots in batches:
            self.updates.note_hyperparameters(unit.name if unit is not None else "device state", slots)
        if merge and len(batches) > 1:
            self.device_state.place(batches)  # state_dict()'s order: the units', not the merged batch's
            batches = [(None, [s for _, ss in batches for s in ss])]
        self.device_state.update(batches, grad_scale, check=check, step=self.steps + 1)

    def _settle_device_state(self, wait: bool = False) -> None:
        """Device-state updates the device skipped (a gradient not finite): into the events
        and optimizer.skipped_steps as the host path reports its skips (each update is one
        window, counted once)."""
        if not self.device_state.has_pending():
            return
        for skipped in self.device_state.settle(wait=wait):
            self.optimizer.count_skipped_step()
            self._device_state_skip_event(skipped.step, skipped.first, skipped.units)

    def _device_state_skip_event(self, step: int, first, units) -> None:
        self.events.add(
            f"step {step}: the gradient of {first.name} is not finite: skipped the updates of "
            f"{[u.name for u in units]} (nonfinite='skip'; their weights, moments and step counts are unchanged)"
        )

    def _step_device_state(self, slots, grad_scale: float) -> None:
        """step() applies a held device-state window (_device_state_held): after the host
        path's own work. With clipping the global norm was the check: a window the host path
        or the norm found not finite is skipped whole (or raised for already, by
        _nonfinite_window). A window step() ends early (accumulation) is checked on the
        device, as at its last pass."""
        if not slots:
            return
        bad = self.grads.nonfinite
        if bad is None:
            check = self.opts.nonfinite == "skip" and self.opts.max_grad_norm is None  # clipping: the norm was
            if self.opts.nonfinite == "raise" and self.opts.max_grad_norm is None:
                bad = self.device_state.first_nonfinite(slots)
                if bad is not None:
                    self.device_state.drop()
                    self.grads.drop_pass()  # the next window starts clean
                    self.updates.end_window()
                    raise FloatingPointError(
                        f"trainstream: the gradient of {bad.name} is not finite (wrap(nonfinite='raise')); "
                        "this step's gradients are dropped"
                    )
            self._update_device_state(self.device_state.batches(by_unit=False), grad_scale, check=check)
            return
        self.device_state.drop()
        if self.grads.count_skip():
            self.optimizer.count_skipped_step()
        self._device_state_skip_event(self.steps + 1, bad, list(dict.fromkeys(s.unit for s in slots)))

    def _nonfinite_window(self, first) -> None:
        """step() with clipping found the window's global norm not finite: `first` is the
        first slot whose gradient is not (None: only the norm overflowed, and the update
        goes on, scaled by zero as torch's clipping does)."""
        if first is None:
            return
        if self.opts.nonfinite == "raise":
            self.grads.drop_pass()  # the next window starts clean
            self.device_state.drop()
            self.updates.end_window()
            raise FloatingPointError(
                f"trainstream: the gradient of {first.name} is not finite (wrap(nonfinite='raise')); "
                "this step's gradients are dropped"
            )
        self.grads.skip_window(first)

    def _warn_changed_hyperparameters(self) -> None:
        """A param group's hyper-parameters changed after updates were queued with them
        during backward (an lr set between backward() and step()): those updates keep the
        old values; warned once per group."""
        for group, key, used, now, units in self.updates.changed_hyperparameters():
            if group in self._warned_groups:
                continue
            self._warned_groups.add(group)
            warnings.warn(
                f"trainstream: param group {group}'s {key} changed from {used!r} to {now!r} after the updates of "
                f"{units} were queued with it during backward; they keep the old value, the rest of the step uses "
                "the new one. Set hyper-parameters before the last backward() of a step (a scheduler stepped after "
                "optimizer.step() does). Warned once per param group.",
                stacklevel=4,
            )

    def apply(self, decision) -> None:
        """Carry out the adapter's decision (None: nothing to do), between steps."""
        if decision is None:
            return
        if isinstance(decision, SwitchToStock):
            self.unwrap()
            for unit in self.block_units:
                self.acts.page(unit, False)
                set_recompute(unit, False)
            self.optimizer.switch_to_stock(self.opts.max_grad_norm)
            self.mode = "stock"
            if self.dp is not None:  # DDP's part from here on: gradients averaged over the ranks
                self.ranks.release_gather()  # no weights are gathered from here on
                # The reduction order, alike on every rank, each unit's parameters last to first:
                # about the order backward makes them ([Note: averaging buckets]); device state's
                # (replicated, so whole on every rank already) in its own.
                params = [s.param for u in self.dp.order for s in reversed(u.trainable)]
                params += [s.param for s in self._device_state_reduction_order()]
                self._stock_grads = grads = StockGradients(self.dp.reduce_group, self.ranks.user, params, self.model)
                self.optimizer.before_stock_calls(grads.drop_open_pass)
                where = "on the device over nccl" if grads.on_device else "over gloo from host copies"
                self.events.add(
                    "data parallel in stock mode: each backward's gradients are averaged over the "
                    f"{self.dp.world} ranks before the fused AdamW steps, as DDP does: in {len(grads.buckets)} "
                    f"buckets, {where}, each launched as backward completes it"
                )
            return
        if not isinstance(decision, Replan):
            raise TypeError(f"trainstream internal: unknown decision {decision!r}")
        self.synchronize()
        moved = self.weights.repage({u for u in self.block_units if (u.block in decision.paged) != u.paged})
        for u in self.block_units:
            set_recompute(u, False)  # before paging: a block moves between the two
            self.acts.page(u, u.block in decision.act_paged)
            if u.block in decision.recompute:
                self._activations_leave(u, recompute=True)
        if moved:
            self.state_hooks.remove()
            self.state_hooks.install()
        self.adapter.applied(decision)

    def zero_grad(self) -> None:
        """Drop the gradients of the current window (torch's zero_grad); updates already
        queued by a finished window are not undone."""
        self.recover()
        if self.grads.in_backward:
            raise RuntimeError("trainstream: optimizer.zero_grad() called during backward")
        self._queue(self.grads.flush())  # a finished window's last units: their updates stand
        self._check_dropped_window()
        self._report_skipped()
        self._check_dropped_device_state()
        self.updates.end_window()
        self.grads.reset_window()

    def _check_dropped_window(self) -> None:
        """zero_grad() drops a held window before its end: a non-finite gradient in it is
        reported as step() reports it (the events name the parameter and the units, and the
        window counts in optimizer.skipped_steps, docs/semantics.md), not lost with it. With
        clipping no gradient was checked yet (the global norm at step() is the check), so the
        norm is taken here, once, over the window's gradients still pending."""
        if self.opts.nonfinite != "skip":
            return  # "raise" raised at the check already; under clipping it raises from step() only
        if self.dp is not None:
            self._dp_check_dropped_window()
            return
        if self.grads.nonfinite is not None:
            self.grads.skip_window()  # every unit not queued yet: SKIPPED, for _report_skipped
        elif self.opts.max_grad_norm is not None and self.grads.take_pending():
            slots = [s for u in self.units for s in u.trainable if s.has_grad]
            if not math.isfinite(float(self.grads.global_norm(slots))):
                first = self.grads.first_nonfinite_in_window(slots)
                if first is not None:  # None: only the norm overflowed, the gradients are finite
                    self.grads.skip_window(first)

    def _check_dropped_device_state(self) -> None:
        """zero_grad() drops a window with device-state gradients no update has taken (a held
        window: clipping, or before its last pass): one not finite counts the window as
        skipped and is reported as _check_dropped_window reports the host path's, once."""
        if self.opts.nonfinite != "skip" or self.grads.passes == 0 or self.grads.nonfinite is not None:
            return  # no window open, or the host path found (and counted) it already
        if self.dp is not None:
            return  # decided alike on every rank with the host path's (_dp_check_dropped_window)
        slots = self.device_state.with_grads()
        bad = self.device_state.first_nonfinite(slots)
        if bad is None:
            return
        if self.grads.count_skip():
            self.optimizer.count_skipped_step()
        self._device_state_skip_event(self.steps + 1, bad, list(dict.fromkeys(s.unit for s in slots)))

    def _dp_check_dropped_window(self) -> None:
        """_check_dropped_window with data parallel: a held window (clipping, or fewer passes
        than accumulation_steps) is dropped before any of it was reduced, so every rank
        checks its own window gradients and an all-reduce of the flags decides, alike on
        every rank: the window counts as skipped if some rank's gradient is not finite, as
        one process's gradient of the whole batch would not be. Whether a window is held is
        read from the passes, which every rank counts alike."""
        if self.grads.passes == 0 or self._dp_window_ends_in_backward():
            return  # no window, or it was reduced and applied at the end of its last pass
        slots = [s for u in self.units for s in u.trainable]
        grads = (self._window_grad(s) for s in slots)
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
        finite = finite and self.device_state.first_nonfinite() is None  # its window's sums, or averages
        if agree(self.dp.reduce_group, finite):
            return
        self.optimizer.count_skipped_step()
        self.events.add(
            f"step {self.steps + 1}: a gradient is not finite on some rank in the window zero_grad() dropped: counted "
            "as a skipped step on every rank (nonfinite='skip'; nothing of it was applied)"
        )

    def leave_stock(self) -> None:
        """unwrap() of a model trained stock since the switch: data parallel's gradient
        averaging hooks off (the model is plain from here on)."""
        if self._stock_grads is not None:
            self._stock_grads.remove()
            self._stock_grads = None

    def release_groups(self) -> None:
        """The user's unwrap() is done (its collectives too): data parallel's groups go back.
        The optimizer holds whole moments from here on and communicates no more."""
        if self.ranks is not None:
            self.ranks.destroy()

    def synchronize(self) -> None:
        """Every queued update written on the host and, for resident units, on the device
        (and, with the check on the device, known to have run or been skipped). A backward
        that raised is recovered first: the device-state updates of the units it completed
        are queued there, where the host path queued its own during backward."""
        self.recover()
        self.weights.synchronize_all()
        self._report_skipped(wait=True)
