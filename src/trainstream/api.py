"""wrap(), unwrap() and memory_report(): the public entry points of the offload engine."""

from __future__ import annotations

import warnings

import torch

from . import options as _options
from .engine.blocks import find_blocks, named_stack
from .engine.device import Backend
from .engine.distributed import RankGroups, process_group
from .engine.engine import Engine
from .engine.layout import lay_out_model
from .engine.optimizer import StreamedAdamW
from .engine.placement import plan_run
from .engine.report import build_report
from .optim.convert import convert_optimizer
from .planner import HardwareProfile, conservative_profile, profile_hardware

_ATTR = "_trainstream_engine"


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


def _data_parallel_settings(opts) -> list:
    """Data parallel: optimizer_mode='auto' is settled as the host AdamW (each rank updates
    1/N of the elements, so the host's share shrinks with the ranks; 'gpu' runs the kernel
    over the shard). Returns the events that say so."""
    notes = []
    if opts.optimizer_mode == "auto":
        opts.values["optimizer_mode"] = "cpu"
        notes.append("data parallel: optimizer_mode='auto' runs the host AdamW (the sharded optimizer)")
    return notes


def _profile_for(opts, device) -> HardwareProfile:
    if isinstance(opts.profile, HardwareProfile):
        return opts.profile
    return profile_hardware(device) if opts.profile else conservative_profile(device)


def _convert(optimizer, model, opts) -> StreamedAdamW:
    """The optimizer wrap() returns, holding the model's trainable parameters."""
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
        where="wrap()",
    )
    in_model = set(model.parameters())
    if any(p not in in_model for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("wrap(): the optimizer holds parameters that are not in the model")
    return optimizer


def wrap(model: torch.nn.Module, optimizer=None, **options):
    """Stream optimizer state, gradients, activations and (when asked) block weights of
    `model` through host RAM. Returns ``(model, optimizer)``: the same model object, with
    hooks installed, and an AdamW-compatible optimizer (see
    :class:`trainstream.engine.optimizer.StreamedAdamW`).

    Options and their defaults are those of the specification's table; a bad name or value
    raises ValueError naming it and what is accepted, a run that cannot fit raises
    :class:`trainstream.DoesNotFit`. ``memory_report(model)`` explains every decision;
    ``unwrap(model)`` gives the plain model back.
    """
    # 1. The options, and what they name: the device, the block stack, the optimizer.
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"wrap(): model must be a torch.nn.Module, got {type(model).__name__}")
    opts = _options.parse(options)
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("wrap(): this model is already wrapped (unwrap() it first)")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            "wrap(): the model is a DistributedDataParallel; pass the module itself (model.module): wrap() trains "
            "data parallel on its own when a process group exists, and DDP's reduction would come on top of it"
        )
    group = process_group(opts.distributed)
    dp_notes = _data_parallel_settings(opts) if group is not None else []
    if optimizer is not None and "lr" in opts.given:
        raise ValueError(
            "wrap(): option 'lr' applies only when optimizer is None (set the learning rate on the optimizer you pass)"
        )
    _adopt_optimizer_settings(opts, optimizer)
    device = _target_device(model, opts.device)
    _options.check_for_device(opts, device)
    backend = Backend(device)
    stack = named_stack(model, opts.blocks) if opts.blocks is not None else find_blocks(model)
    source, optimizer = optimizer, _convert(optimizer, model, opts)
    # Frozen parameters in the optimizer are skipped, as torch skips them (SPEC.md).
    trainable = {p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
    layout = lay_out_model(model, stack, trainable, device)
    ranks = None
    if group is not None:
        # The options that decide which collectives a window issues (accumulation, clipping,
        # the non-finite flags, offload='auto''s agreement at the switch step) and the dtype of
        # the moment shards state_dict() gathers: ranks that differ would deadlock or mix dtypes.
        # Paging (param_offload, activation_offload) stays local: nothing in it communicates.
        compared = ("accumulation_steps", "max_grad_norm", "nonfinite", "offload", "moment_dtype")
        settings = tuple((k, getattr(opts, k)) for k in compared)
        ranks = RankGroups(group, layout.block_units + layout.outside_units, settings)
    try:
        profile = _profile_for(opts, device)
        if ranks is not None:  # one plan on every rank: made from rank 0's measurements
            profile = ranks.from_rank_zero(profile)

        # 2. Every decision, before a byte moves (DoesNotFit here leaves the model as it was).
        plan = plan_run(opts, layout, profile, backend)
        if ranks is not None and not ranks.alike(bool(plan.device_state)):
            # Device state decides which collectives a window issues (its gradients' averaging
            # or the host path's reduce-scatters): every rank takes it or none does. Each rank
            # places its own weights (param_offload, quantize, what is on the device already),
            # and that can tip the choice on one rank alone.
            plan = plan_run(opts, layout, profile, backend, refuse_device_state="not every rank's plan took it")
        if plan.warning:
            warnings.warn(plan.warning, stacklevel=2)
        optimizer.set_moment_dtype(plan.moment_dtype)

        # 3. The engine, built whole from the plan; 4. installed on the model. Up to here nothing
        # of the model has changed; install() undoes itself if it raises, and so does what follows.
        engine = Engine(model, optimizer, plan, backend, layout, ranks=ranks)
        for note in dp_notes:
            engine.events.add(note)
        engine.install()
        try:
            if source is not None:  # a scheduler built on it before wrap() drives the updates (SPEC.md)
                optimizer.share_param_groups(source)
            object.__setattr__(model, _ATTR, engine)
        except BaseException:
            engine.uninstall()
            raise
        engine.installed()
    except BaseException:
        if ranks is not None:  # a refused wrap() gives its groups back (DoesNotFit, a bad option)
            ranks.destroy()
        raise
    return model, optimizer


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Wait for every update, put every weight back on the device in the model's dtype,
    remove every hook and return the plain model. The wrapped optimizer can still give its
    state_dict() but no longer steps."""
    engine = _engine_of(model)
    if engine.mode != "stock":  # a switched run is already plain
        engine.unwrap()
    else:
        engine.leave_stock()
    engine.release_groups()
    object.__delattr__(model, _ATTR)
    return model


def memory_report(model: torch.nn.Module) -> dict:
    """What the engine decided and measured: ``events`` (plain-text log), ``params``
    (``paged_blocks``, ``resident_blocks``, ``quantize``), ``plan`` (with ``history``),
    ``peaks``."""
    return build_report(_engine_of(model))
