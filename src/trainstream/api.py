"""wrap(), unwrap() and memory_report(): the public entry points of the offload engine."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import options as _options
from .engine.adapt import Adapter
from .engine.blocks import find_blocks, named_stack
from .engine.device import Backend, HostArena
from .engine.engine import Engine, grads_stay_on_device
from .engine.layout import arena_bytes, build_units, quantizable_slots, set_quantization
from .engine.moments import MomentStager, copy_limit, lay_out, region_limit
from .engine.optimizer import StreamedAdamW
from .engine.placement import check_fits, choose, choose_moment_dtype, choose_optimizer_mode, default_inflight_bytes
from .engine.report import build_report
from .engine.state import StateHooks
from .engine.state import unwrap as _unwrap
from .optim.convert import convert_optimizer
from .planner import HardwareProfile, conservative_profile, profile_hardware

_ATTR = "_trainstream_engine"
GiB = 1 << 30


def _engine_of(model) -> Engine:
    engine = getattr(model, _ATTR, None)
    if engine is None:
        raise ValueError("trainstream: this model is not wrapped (call trainstream.wrap(model, optimizer) first)")
    return engine


def _target_device(model, requested) -> torch.device:
    if requested is not None:
        if requested.type == "cuda":
            from ._native import require_cuda

            require_cuda("wrap(device='cuda')")
            if requested.index is None:
                requested = torch.device("cuda", torch.cuda.current_device())
        return requested
    on = {p.device for p in model.parameters()}
    cuda = [d for d in on if d.type == "cuda"]
    if len(cuda) > 1:
        raise ValueError(
            f"wrap(): the model's parameters are on several GPUs ({sorted(map(str, cuda))}); pass device= to choose one"
        )
    if cuda:
        return cuda[0]
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _adopt_optimizer_settings(opts, optimizer) -> None:
    """An OffloadAdamW brings its own clipping and accumulation settings: clipping carries
    over (a conflicting wrap() value is an error); its accumulation, which averages over
    step() calls, does not mean what wrap()'s does, so it must be restated."""
    from .optim import OffloadAdamW

    if not isinstance(optimizer, OffloadAdamW):
        return
    if optimizer.max_grad_norm is not None:
        given = opts.max_grad_norm
        if "max_grad_norm" in opts.given and given != optimizer.max_grad_norm:
            raise ValueError(
                f"wrap(): max_grad_norm={given!r} but the optimizer clips at {optimizer.max_grad_norm}; pass one value"
            )
        opts.values["max_grad_norm"] = optimizer.max_grad_norm
    if optimizer.accumulation_steps != 1:
        raise ValueError(
            f"wrap(): the OffloadAdamW has accumulation_steps={optimizer.accumulation_steps} (the mean "
            "over step() calls); with wrap(), pass accumulation_steps=N to wrap() instead: N backward "
            "passes, summed as torch does, then one step()"
        )


def _refuse_undelivered(opts) -> None:
    """Options the specification accepts whose behaviour this release does not have yet:
    a clear error instead of a silent fallback."""
    distributed = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    if opts.distributed is True or (opts.distributed is None and distributed):
        raise NotImplementedError(
            "wrap(): data parallel is not available yet; run one process, or pass "
            "distributed=False to train each rank on its own"
        )


def _check_contiguous(slots) -> None:
    """The device update reads and writes parameters and gradients as flat arrays."""
    bad = [s.name for s in slots if not s.param.is_contiguous()]
    if bad:
        raise ValueError(
            f"wrap(): optimizer_mode='gpu' needs contiguous parameters; not contiguous: "
            f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} (make them contiguous before "
            "wrap(), or use optimizer_mode='cpu')"
        )


@dataclass
class _Fit:
    placement: object
    update_on_device: bool
    budget: dict
    mapped_bytes: int
    moment_note: str | None
    mode_note: str | None


def _fit(
    opts, block_units, outside_units, unpageable, profile, on_device, optimizer, backend, quantize_hint: str = ""
) -> _Fit:
    """Placement, moment dtype and optimizer mode for the units as they are now (their
    quantization set); MemoryError from check_fits when it does not fit."""
    placement = choose(opts, block_units, outside_units, unpageable, profile, on_device)
    for u in block_units:
        u.paged = u.block in placement.paged
        u.act_paged = u.block in placement.act_paged
    units = block_units + outside_units
    moment_note = None
    if opts.moment_dtype == "auto":
        moment_dtype, moment_note = choose_moment_dtype(opts, units, profile)
        optimizer.set_moment_dtype(moment_dtype)
    update_on_device, mode_note = choose_optimizer_mode(opts, units, profile, optimizer.moment_dtype.itemsize, backend)
    trainable = [s for u in units for s in u.trainable]
    if update_on_device:
        _check_contiguous(trainable)
    # optimizer_mode="gpu": the moments (copied to VRAM per update, moments.py) and the
    # accumulated gradient sums (which the kernel maps) are carved from one arena, pinned on
    # a GPU; on the CPU backend the arena is plain memory and the same layout runs in CI.
    sums = opts.accumulation_steps > 1
    mapped_bytes = (
        sum(
            2 * HostArena.size_of(s.param.numel(), optimizer.moment_dtype)
            + (HostArena.size_of(s.param.numel(), torch.float32) if sums else 0)
            for s in trainable
        )
        if update_on_device
        else 0
    )
    device_grads = grads_stay_on_device(update_on_device, opts)  # no landing buffers then
    budget = check_fits(
        opts,
        units,
        placement,
        backend,
        profile,
        on_device,
        optimizer.moment_dtype.itemsize,
        arena_bytes(units, stage=not device_grads) + mapped_bytes,
        device_grads,
        quantize_hint,
    )
    return _Fit(placement, update_on_device, budget, mapped_bytes, moment_note, mode_note)


QUANT_ORDER = ("int8", "nf4")  # quantize="auto" tries them in this order, after no quantization


def _what_did_not_fit(error: MemoryError) -> str:
    """The problems check_fits listed, without its preamble and advice."""
    return str(error).split(". What would help")[0].split("does not fit. ")[-1]


def _fit_quantized(
    opts, quantizable, block_units, outside_units, unpageable, profile, on_device, optimizer, backend
) -> tuple[_Fit, list]:
    """The fit with the quantize setting applied. quantize='auto' tries no quantization,
    then int8, then NF4, and keeps the first that fits (prefer='speed': NF4 as well when
    it keeps every block resident where the first choice pages some)."""
    formats = {"auto": [None, "int8", "nf4"], "none": [None], "int8": ["int8"], "nf4": ["nf4"]}[opts.quantize]
    if not quantizable:
        formats = [None]
    args = (opts, block_units, outside_units, unpageable, profile, on_device, optimizer, backend)
    notes, refused = [], []
    for i, fmt in enumerate(formats):
        last = i == len(formats) - 1
        set_quantization(quantizable, fmt, opts.quant_block_size)
        smaller = QUANT_ORDER[QUANT_ORDER.index(fmt) + 1 :] if fmt else QUANT_ORDER  # formats that shrink more
        hint = " or ".join(f"quantize={f!r}" for f in smaller) if quantizable and last else ""
        try:
            fit = _fit(*args, quantize_hint=hint)
        except MemoryError as e:
            if not last:
                refused.append(f"{fmt or 'no quantization'} ({_what_did_not_fit(e)})")
                continue
            if refused:
                raise MemoryError(
                    f"{e} (quantize='auto' tried, and it did not fit either with {'; '.join(refused)})"
                ) from None
            raise
        break
    if (
        opts.quantize == "auto"
        and opts.prefer == "speed"
        and quantizable
        and fmt != "nf4"
        and opts.param_offload == "auto"
        and fit.placement.paged
    ):
        set_quantization(quantizable, "nf4", opts.quant_block_size)
        try:
            nf4 = _fit(*args)
        except MemoryError:
            nf4 = None
        if nf4 is not None and not nf4.placement.paged:
            notes.append(
                f"quantize='auto', prefer='speed': nf4 keeps every block in VRAM ({fmt or 'no quantization'}"
                f" paged {len(fit.placement.paged)})"
            )
            fit, fmt = nf4, "nf4"
        else:
            set_quantization(quantizable, fmt, opts.quant_block_size)
            fit = _fit(*args)
    if fmt is None:
        if opts.quantize in ("int8", "nf4"):
            notes.append(
                f"quantize={opts.quantize!r}: no frozen Linear weight in the blocks to quantize "
                "(trainable weights are never quantized)"
            )
        elif opts.quantize == "auto":
            notes.append(
                "quantize='auto': nothing quantized"
                + ("" if quantizable else " (no frozen Linear weights in the blocks)")
            )
        return fit, notes
    if opts.quantize == "auto":  # a lossy choice made for the user: say it outside the log too
        why_auto = (
            "because the run does not fit otherwise; pass quantize='none' to get the MemoryError instead"
            if refused
            else "because prefer='speed' and it keeps every block in VRAM"
        )
        warnings.warn(
            f"trainstream.wrap(): quantize='auto' stores {len(quantizable)} frozen weights as {fmt}, {why_auto}",
            stacklevel=3,
        )
    before = sum(s.full_nbytes for s in quantizable)
    after = sum(s.nbytes for s in quantizable)
    why = f", because it does not fit with {'; '.join(refused)}" if refused else ""
    notes.append(
        f"quantize={opts.quantize!r}: {len(quantizable)} frozen weights as {fmt} (block "
        f"{opts.quant_block_size}), {before / GiB:.2f} -> {after / GiB:.2f} GiB{why}"
    )
    return fit, notes


def wrap(model: torch.nn.Module, optimizer=None, **options):
    """Stream optimizer state, gradients, activations and (when asked) block weights of
    `model` through host RAM. Returns ``(model, optimizer)``: the same model object, with
    hooks installed, and an AdamW-compatible optimizer (see
    :class:`trainstream.engine.optimizer.StreamedAdamW`).

    Options and their defaults are those of the specification's table; a bad name or value
    raises ValueError naming it and what is accepted. ``memory_report(model)`` explains
    every decision; ``unwrap(model)`` gives the plain model back.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"wrap(): model must be a torch.nn.Module, got {type(model).__name__}")
    opts = _options.parse(options)
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("wrap(): this model is already wrapped (unwrap() it first)")
    _refuse_undelivered(opts)
    if optimizer is not None and "lr" in opts.given:
        raise ValueError(
            "wrap(): option 'lr' applies only when optimizer is None (set the learning rate on the optimizer you pass)"
        )
    _adopt_optimizer_settings(opts, optimizer)
    device = _target_device(model, opts.device)
    backend = Backend(device)
    stack = named_stack(model, opts.blocks) if opts.blocks is not None else find_blocks(model)

    moment_dtype = torch.float32 if opts.moment_dtype == "auto" else opts.moment_dtype
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = convert_optimizer(
        optimizer,
        params,
        lr=opts.lr,
        mode="cpu",
        moment_dtype=moment_dtype,
        threads=opts.threads,
        optimizer_class=StreamedAdamW,
    )
    in_optimizer = {p for g in optimizer.param_groups for p in g["params"]}
    in_model = set(model.parameters())
    stray = [p for p in in_optimizer if p not in in_model]
    if stray:
        raise ValueError("wrap(): the optimizer holds parameters that are not in the model")

    block_units, outside_units, unpageable = build_units(model, stack.blocks, in_optimizer)
    on_device = sum(
        s.nbytes
        for u in block_units + outside_units
        for s in u.slots
        if s.param.device == device and device.type == "cuda"
    )
    if isinstance(opts.profile, HardwareProfile):
        profile = opts.profile
    else:
        profile = profile_hardware(device) if opts.profile else conservative_profile(device)
    units = block_units + outside_units
    quantizable, quant_notes = quantizable_slots(block_units, stack.blocks, unpageable)
    fit, quant_notes2 = _fit_quantized(
        opts, quantizable, block_units, outside_units, unpageable, profile, on_device, optimizer, backend
    )
    quant_notes += quant_notes2
    placement, update_on_device, budget = fit.placement, fit.update_on_device, fit.budget
    moment_note, mode_note = fit.moment_note, fit.mode_note
    trainable = [s for u in units for s in u.trainable]
    engine = Engine(model, optimizer, opts, backend, stack, block_units, outside_units)
    engine.update_on_device = update_on_device
    engine.budget = budget
    engine.profile = profile
    if opts.max_inflight_bytes is None:
        engine.max_inflight_bytes = default_inflight_bytes(profile)
    if fit.mapped_bytes:
        arena = HostArena(backend, fit.mapped_bytes)
        regions = lay_out(units, optimizer.moment_dtype, engine.max_inflight_bytes, arena.take)
        engine.moments = MomentStager(engine, regions)
        moments = {}
        for region in regions:
            moments.update(region.views(region.host))
        optimizer.pin_state(moments)
        for s in trainable if opts.accumulation_steps > 1 else ():
            s.grad_sum = arena.take(s.param.shape, torch.float32)
    engine.adapter = Adapter(engine, profile, unpageable, on_device)
    events = engine.events
    events.add(f"device {device}; {stack.describe()}")
    events.add(profile.describe())
    for note in placement.notes:
        events.add(note)
    events.add(
        f"weights: {len(placement.paged)} blocks paged {placement.paged}, "
        f"{len(block_units) - len(placement.paged)} resident; activations paged for blocks {placement.act_paged}"
    )
    if moment_note:
        events.add(moment_note)
    moments = str(optimizer.moment_dtype).replace("torch.", "")
    if update_on_device:
        events.add(
            f"optimizer: GPU AdamW over {'pinned ' if backend.is_cuda else ''}host moments ({moments}), "
            f"copied through VRAM around one kernel each, in regions of up to "
            f"{region_limit(engine.max_inflight_bytes) / 2**20:.1f} MiB (one tensor alone: "
            f"{copy_limit(engine.max_inflight_bytes) / 2**20:.1f} MiB), {len(in_optimizer)} trainable "
            "tensors; gradients "
            + (
                "stay on the device until their update"
                if engine.device_grads
                else "land in host memory (clipping or accumulation needs them there)"
            )
        )
    else:
        events.add(f"optimizer: host AdamW, moments {moments}, {len(in_optimizer)} trainable tensors")
    if mode_note:
        events.add(mode_note)
    if opts.offload == "auto":
        events.add(
            f"offload='auto': after {Adapter.SWITCH_AFTER} measured steps, switches to "
            "torch.optim.AdamW(fused=True) on the device if stock training fits"
        )
    for note in quant_notes:
        events.add(note)
    if not opts.guard_params:
        events.add("guard_params=False: step() waits for every update to reach the device before returning")

    engine.place_weights()
    engine.install()
    engine.state_hooks = StateHooks(engine)
    engine.state_hooks.install()
    optimizer._engine = engine
    object.__setattr__(model, _ATTR, engine)
    return model, optimizer


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Wait for every update, put every weight back on the device in the model's dtype,
    remove every hook and return the plain model. The wrapped optimizer can still give its
    state_dict() but no longer steps."""
    engine = _engine_of(model)
    if engine.mode != "stock":  # a switched run is already plain
        _unwrap(engine)
    object.__delattr__(model, _ATTR)
    return model


def memory_report(model: torch.nn.Module) -> dict:
    """What the engine decided and measured: ``events`` (plain-text log), ``params``
    (``paged_blocks``, ``resident_blocks``, ``quantize``), ``plan`` (with ``history``),
    ``peaks``."""
    return build_report(_engine_of(model))
