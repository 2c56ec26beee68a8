"""Which blocks page their weights and activations, and whether the run fits at all.

Explicit options are followed exactly. For "auto", the planner (planner/plan.py) chooses
from the byte counts of the model and the hardware profile; before activations have been
measured it holds back a share of the device memory for them. The adapter (adapt.py)
replans from what the first steps measure. Every choice goes to the events log with its
numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field

import torch

from ..errors import DoesNotFit
from ..planner.plan import BlockBytes, PlanInputs, make_plan
from ..sizes import GiB, MiB
from .layout import set_device_state, set_quantization
from .moments import copy_limit, region_limit


@dataclass
class Placement:
    paged: list  # block indices whose weights live in host memory
    act_paged: list  # block indices whose saved activations are paged
    notes: list = field(default_factory=list)
    recompute: list = field(default_factory=list)  # blocks recomputed in backward (never also in act_paged)


def _first(fraction: float, n: int) -> list:
    return list(range(round(fraction * n)))


def _explicit(name: str, value, n: int) -> list:
    if value is True:
        return list(range(n))
    if value is False:
        return []
    if isinstance(value, float):
        return _first(value, n)
    bad = [i for i in value if i >= n]
    if bad:
        raise ValueError(
            f"wrap(): option {name!r} lists block {bad[0]}, but the stack has {n} blocks (accepted: indices 0..{n - 1})"
        )
    return list(value)


def usable_device_bytes(opts, profile, model_bytes_on_device: int) -> int:
    """Free device memory plus what this model already holds there (it is about to be
    rearranged), less vram_headroom."""
    return int((profile.vram_free_bytes + model_bytes_on_device) * (1.0 - opts.vram_headroom))


# Until the first forward pass has measured them, activations are assumed to need this
# share of the usable device memory (the online guard pages them if they need more).
UNKNOWN_ACTIVATION_SHARE = 0.5


def default_inflight_bytes(profile) -> int:
    """max_inflight_bytes=None: 1 GiB or a tenth of the device memory (a capped process's
    share), the smaller."""
    return int(min(GiB, profile.vram_total_bytes // 10))


def inflight_bytes(opts, profile) -> int:
    """max_inflight_bytes as given, else its default."""
    return opts.max_inflight_bytes if opts.max_inflight_bytes is not None else default_inflight_bytes(profile)


def dequantized_in_flight(units) -> int:
    """Device bytes of quantized weights dequantized for use: the two largest blocks' worth
    (the one computing and a paged one fetched ahead). Counted before the plan says which
    blocks are paged: where every block stays resident, one block's is held at a time
    ([Note: dequantized where used]; two under reentrant checkpointing), and this errs on
    the safe side."""
    return 2 * max([sum(s.full_nbytes for s in u.slots if s.quant_format is not None) for u in units] or [0])


def plan_inputs(
    opts,
    block_units,
    outside_units,
    unpageable,
    profile,
    usable: int,
    *,
    act_bytes: dict | None = None,
    act_cast: dict | None = None,
    act_inputs: dict | None = None,
    forward_s: dict | None = None,
    after_stack: int = 0,
    held_after_stack: int = 0,
    compute_s: float = 0.0,
    correction: int = 0,
    compute_dtype=None,
) -> PlanInputs:
    """The planner's view of this model on this machine. `act_bytes`: saved activations per
    block with its weights resident (None before the first pass: a share of the memory is
    held back for them instead), `act_cast`: of those, autocast's copies of the weights;
    `act_inputs`: each block's input bytes (what it keeps when recomputed), `forward_s`: each
    block's measured forward (a block not timed is taken as the median of those timed; none
    timed: None, see [Note: recompute before timing] in planner/plan.py);
    `after_stack`: what the head and the loss add at the end of the forward, and
    `held_after_stack` what of it backward still finds held (both measured);
    `correction`: measured peak minus predicted, from the adapter."""

    def crossing(u):
        # Under bf16 autocast an fp32 Linear's weights travel in bf16 (params.py); quantized
        # ones as codes and scales. Device-state slots never travel.
        return sum(
            s.param.numel() * 2
            if compute_dtype == torch.bfloat16 and s.is_linear and s.dtype == torch.float32 and s.quant_format is None
            else s.nbytes
            for s in u.pageable_slots
        )

    acts, casts, inputs, times = act_bytes or {}, act_cast or {}, act_inputs or {}, forward_s or {}
    fallback = max(acts.values(), default=0)  # a block not measured (no copies counted for it)
    input_fallback = max(inputs.values(), default=0)
    timed = sorted(times.values())
    time_fallback = timed[len(timed) // 2] if timed else None
    blocks = [
        BlockBytes(
            sum(s.nbytes for s in u.pageable_slots),
            crossing(u),
            sum(s.nbytes for s in u.trainable),
            acts.get(u.block, fallback),
            u.block not in unpageable,
            casts.get(u.block, 0),
            inputs.get(u.block, input_fallback),
            times.get(u.block, time_fallback),
        )
        for u in block_units
    ]
    trainable = [s for u in block_units + outside_units for s in u.trainable]
    largest_block = max([sum(s.nbytes for s in u.pageable_slots) for u in block_units] or [0])
    # Outside weights stay resident; one block's gradients are held on their way out. Memory
    # that transfers keep from reuse after the engine let go of it (max_inflight_bytes) is not
    # counted: the allocator counts it free, and frees it for good before it would fail.
    # Device state is resident wherever its unit is (its moments' dtype: fp32 under "auto",
    # the larger of the two, before the plan has chosen).
    moment_bytes = 4 if opts.moment_dtype == "auto" else opts.moment_dtype.itemsize
    fixed = (
        sum(s.nbytes for u in outside_units for s in u.pageable_slots)
        + largest_block
        + dequantized_in_flight(block_units)
        + device_state_bytes(block_units + outside_units, moment_bytes, world_size(opts.distributed))
        + correction
    )
    if act_bytes is None:
        fixed += int(UNKNOWN_ACTIVATION_SHARE * usable)

    def fixed_list(value):
        return _explicit("param_offload", value, len(block_units)) if value != "auto" else ()

    return PlanInputs(
        blocks=blocks,
        fixed_bytes=fixed,
        usable_bytes=usable,
        h2d_bytes_per_s=profile.h2d_bytes_per_s,
        d2h_bytes_per_s=profile.d2h_bytes_per_s,
        adamw_s=sum(s.param.numel() for s in trainable) / profile.host_adamw_params_per_s,
        grad_bytes=sum(s.nbytes for s in trainable),
        outside_push_bytes=sum(s.nbytes for u in outside_units for s in u.trainable),
        compute_s=compute_s,
        max_activation_slowdown=opts.max_activation_slowdown,
        prefetch_depth=opts.prefetch_depth,
        inflight_bytes=inflight_bytes(opts, profile),
        weights="auto" if opts.param_offload == "auto" else "fixed",
        activations="auto" if opts.activation_offload == "auto" else "fixed",
        fixed_paged=tuple(i for i in fixed_list(opts.param_offload) if i not in unpageable),
        fixed_act_paged=tuple(
            _explicit("activation_offload", opts.activation_offload, len(block_units))
            if opts.activation_offload != "auto"
            else ()
        ),
        # An explicit activation_offload fixes every block's activations (paged or kept);
        # recomputing is the planner's choice under "auto" only.
        recompute=opts.activation_offload == "auto",
        after_stack_bytes=after_stack,
        held_after_stack_bytes=held_after_stack,
    )


def choose(opts, block_units, outside_units, unpageable: list, profile, model_bytes_on_device: int) -> Placement:
    n = len(block_units)
    notes = []
    usable = usable_device_bytes(opts, profile, model_bytes_on_device)
    paged = _explicit("param_offload", opts.param_offload, n) if opts.param_offload != "auto" else []
    kept = [i for i in paged if i in unpageable]
    if kept:
        notes.append(f"blocks {kept} share a parameter with modules outside them (tied weights): kept resident")
        paged = [i for i in paged if i not in unpageable]
    act = _explicit("activation_offload", opts.activation_offload, n) if opts.activation_offload != "auto" else []
    if "auto" in (opts.param_offload, opts.activation_offload):
        plan = make_plan(plan_inputs(opts, block_units, outside_units, unpageable, profile, usable))
        if opts.param_offload == "auto":
            paged = plan.paged
        notes.append(
            f"plan at wrap() (activations not measured yet: {UNKNOWN_ACTIVATION_SHARE:.0%} of the usable "
            f"device memory held back for them): {plan.describe(usable)}"
        )
        if opts.activation_offload == "auto":
            notes.append(
                "activation_offload='auto': activations stay on the device until the first forward pass "
                "measures them; a block whose activations would not fit is recomputed in backward (or paged, "
                "when the measured times say paging is cheaper) as the pass goes"
            )
    return Placement(sorted(paged), sorted(act), notes)


def world_size(distributed) -> int:
    """The ranks wrap(distributed=...) trains over (1: alone)."""
    from .distributed import process_group

    group = process_group(distributed)
    return 1 if group is None else torch.distributed.get_world_size(group)


def data_parallel(distributed) -> bool:
    """Whether wrap(distributed=...) trains over a process group (distributed.py), also a group
    of one rank (distributed=True), where the engine reduces and gathers as over more."""
    from .distributed import process_group

    return process_group(distributed) is not None


def local_processes() -> int:
    """Processes sharing this machine's RAM (torchrun / Slurm set these)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(os.environ[name].split("(")[0]))
        except (KeyError, ValueError):
            continue
    return 1


def ram_share(profile) -> int:
    """This process's share of the available RAM."""
    return profile.ram_available_bytes // local_processes()


def pinned_share(profile) -> int:
    """This process's share of the pinnable memory: the machine's RAM (or cgroup) is shared by
    the processes on it; RLIMIT_MEMLOCK, where it binds, is each process's own."""
    if "RLIMIT_MEMLOCK" in profile.pinned_bound_by:
        return profile.pinned_limit_bytes
    return profile.pinned_limit_bytes // local_processes()


def host_bytes(opts, units, moment_bytes: int, device_grads: bool = False) -> dict:
    """Host memory the engine needs, by class (`device_grads`: gradients stay on the device)."""
    trainable = [s for u in units for s in u.trainable]
    n_train = sum(s.param.numel() for s in trainable)
    acc = 4 if opts.accumulation_steps > 1 else 0
    landing = 0 if device_grads else sum(s.param.numel() * s.dtype.itemsize for s in trainable)
    # Data parallel: this rank keeps the fp32 master and the moments of its shard only
    # (distributed.py), with the reduced gradients' shard beside them and the fp32 buckets of
    # the reductions in flight (each the size of the largest unit's gradients); its landing
    # buffers stay whole, and of the weights only a paged unit's, in the model's dtype.
    shards = world_size(opts.distributed)
    reducing = 0
    if shards > 1:
        from .distributed import INFLIGHT_BUCKETS

        largest = max((sum(s.param.numel() for s in u.trainable) for u in units), default=0)
        reducing = 4 * -(-n_train // shards) + INFLIGHT_BUCKETS * 4 * (largest + shards * len(trainable))
    return {
        "fp32 master weights": 4 * -(-n_train // shards),
        "gradient buffers": landing + acc * n_train + reducing,
        "moments": 2 * moment_bytes * -(-n_train // shards),
        "paged frozen weights": sum(s.nbytes for u in units if u.paged for s in u.slots if not s.trainable),
        "lower-precision copies": sum(_host_copy_bytes(s, shards > 1) for s in trainable),
    }


def _host_copy_bytes(s, sharded: bool) -> int:
    """Host bytes of a trainable slot's weights beside its fp32 master (layout.host_buffers):
    a bf16 param's copy, a paged fp32 Linear's bf16 copy for autocast; with data parallel
    (`sharded`) a paged unit's full weights in the model's dtype and none for a resident one."""
    n = s.param.numel()
    spare = 2 * n if s.unit.paged and s.is_linear and s.dtype == torch.float32 else 0
    if sharded:
        return n * s.dtype.itemsize + spare if s.unit.paged else 0
    return (2 * n if s.dtype != torch.float32 else 0) + spare


def choose_moment_dtype(opts, units, profile) -> tuple[torch.dtype, str]:
    """moment_dtype='auto': float32 unless the host cannot hold it, then bfloat16."""
    share = ram_share(profile)
    need32 = sum(host_bytes(opts, units, 4).values())
    if need32 <= share:
        return torch.float32, (
            f"moment_dtype='auto': float32 ({need32 / GiB:.2f} GiB of host memory needed, "
            f"{share / GiB:.2f} GiB available to this process)"
        )
    need16 = sum(host_bytes(opts, units, 2).values())
    return torch.bfloat16, (
        f"moment_dtype='auto': bfloat16 with stochastic rounding, because float32 moments would "
        f"need {need32 / GiB:.2f} GiB of host memory and {share / GiB:.2f} GiB is available "
        f"(bfloat16: {need16 / GiB:.2f} GiB)"
    )


# The share of the PCIe bound the AdamW kernel is costed at (the optimizer_gpu bench measures
# it). Below what it reaches when its moments are copied, since a unit whose copy would
# raise the VRAM peak is mapped instead.
DEVICE_UPDATE_EFFICIENCY = 0.8
# Beside backward the kernel holds SMs the GEMMs would use, so "auto" picks the device only
# where the host AdamW is estimated at this many times the kernel's PCIe time. The whole
# model goes one way: split between the two, the kernel's PCIe traffic and the host AdamW
# contend for the same host memory bandwidth.
DEVICE_UPDATE_MARGIN = 1.25


def device_update_bytes(opts, units, moment_bytes: int) -> tuple[int, int]:
    """Bytes optimizer_mode="gpu" moves over PCIe per step, (to the device, to the host):
    both moments each way; the host fp32 master each way where the device param is not
    the master (paged, or not fp32); a paged param's new weights written to host memory;
    and gradients read from host memory when clipping or accumulation lands them there."""
    host_grads = opts.max_grad_norm is not None or opts.accumulation_steps > 1
    h2d = d2h = 0
    for u in units:
        for s in u.trainable:
            n = s.param.numel()
            master = 4 * n if u.paged or s.dtype != torch.float32 else 0
            h2d += 2 * moment_bytes * n + master + (4 * n if host_grads else 0)
            d2h += 2 * moment_bytes * n + master
            if u.paged and (s.dtype != torch.float32 or s.is_linear):
                d2h += 2 * n  # the lower-precision copy the next fetch reads
    return h2d, d2h


def choose_optimizer_mode(opts, units, profile, moment_bytes: int, backend) -> tuple[bool, str | None]:
    """optimizer_mode: update on the device? 'auto' compares the host AdamW's measured rate
    with the CUDA kernel's PCIe time for this placement (see DEVICE_UPDATE_MARGIN)."""
    if opts.optimizer_mode == "cpu":
        return False, None
    if opts.optimizer_mode == "gpu":
        if backend.is_cuda:
            from .._native import require_cuda

            require_cuda("wrap(optimizer_mode='gpu')")  # at wrap(), not in the first backward
            return True, None
        return True, "optimizer_mode='gpu' on the CPU backend: the host AdamW stands in for the kernel"
    if not backend.is_cuda:
        return False, "optimizer_mode='auto': host AdamW (the CPU backend has no device to update on)"
    n_train = sum(s.param.numel() for u in units for s in u.trainable)
    host_s = n_train / profile.host_adamw_params_per_s
    h2d, d2h = device_update_bytes(opts, units, moment_bytes)
    device_s = max(h2d / profile.h2d_bytes_per_s, d2h / profile.d2h_bytes_per_s) / DEVICE_UPDATE_EFFICIENCY
    on_device = DEVICE_UPDATE_MARGIN * device_s < host_s
    return on_device, (
        f"optimizer_mode='auto': {'GPU AdamW' if on_device else 'host AdamW'} (estimated "
        f"{device_s * 1e3:.0f} ms per step on the GPU over PCIe, {host_s * 1e3:.0f} ms on the host)"
    )


def check_fits(
    opts,
    units,
    placement: Placement,
    backend,
    profile,
    model_bytes_on_device: int,
    moment_bytes: int,
    pinned_bytes: int,
    device_grads: bool = False,
    quantize_hint: str = "",
    pinned_needed: int | None = None,
) -> dict:
    """Host, pinned and device bytes this placement needs; MemoryError with the numbers
    when they exceed what the profile says the machine has (check_memory=True).
    `pinned_bytes`: what the host arenas pin (their pieces), of which `pinned_needed` hold
    tensors (default: all); on a GPU the rest, the pieces' unused tails, is locked host
    memory too (on the CPU backend no page of a tail is ever touched, so none is resident).
    `quantize_hint`: a quantize setting that would shrink the frozen weights, to suggest."""
    host = host_bytes(opts, units, moment_bytes, device_grads)
    unused = pinned_bytes - (pinned_bytes if pinned_needed is None else pinned_needed)
    host["unused ends of pinned pieces"] = unused if backend.is_cuda else 0
    resident = sum(s.nbytes for u in units if not u.paged for s in u.pageable_slots)
    largest_paged = max([sum(s.nbytes for s in u.pageable_slots) for u in units if u.paged] or [0])
    device = {
        "resident weights": resident,
        "paged blocks in flight (2 largest)": 2 * largest_paged,
        "dequantized weights in flight": dequantized_in_flight(units),
        DEVICE_STATE_CLASS: device_state_bytes(units, moment_bytes, world_size(opts.distributed)),
    }
    need_host, need_dev = sum(host.values()), sum(device.values())
    have_host = ram_share(profile)
    have_pinned = pinned_share(profile)
    usable = usable_device_bytes(opts, profile, model_bytes_on_device)
    budget = {
        "host": host,
        "device": device,
        "host_available": have_host,
        "device_usable": usable,
        "pinned": pinned_bytes if backend.is_cuda else 0,
        "pinned_limit": have_pinned,
    }
    if not opts.check_memory:
        return budget
    problems = []
    if need_host > have_host:
        problems.append(
            f"host RAM: needs {need_host / GiB:.2f} GiB ("
            + ", ".join(f"{k} {v / GiB:.2f}" for k, v in host.items() if v)
            + f"), available {have_host / GiB:.2f} GiB"
            + (f" ({profile.ram_bound_by})" if profile.ram_bound_by else "")
            + (f" (this process's share of {local_processes()} on the machine)" if local_processes() > 1 else "")
        )
    pinned = pinned_bytes if backend.is_cuda else 0
    if pinned > have_pinned:
        problems.append(
            f"pinned memory: needs {pinned_bytes / GiB:.2f} GiB of transfer buffers, the limit is "
            f"{have_pinned / GiB:.2f} GiB ("
            + (f"{profile.pinned_bound_by}; " if profile.pinned_bound_by else "")
            + (
                f"this process's share of {local_processes()} on the machine; "
                if have_pinned != profile.pinned_limit_bytes
                else ""
            )
            + "raise RLIMIT_MEMLOCK, ulimit -l, or the cgroup's limit)"
        )
    if need_dev > usable:
        problems.append(
            f"VRAM: needs {need_dev / GiB:.2f} GiB before activations ("
            + ", ".join(f"{k} {v / GiB:.2f}" for k, v in device.items() if v)
            + f"), usable {usable / GiB:.2f} GiB after vram_headroom={opts.vram_headroom}"
            f" ({profile.source} profile)"
        )
    if problems:
        raise DoesNotFit(
            needs={"vram": need_dev, "ram": need_host, "pinned": pinned},
            has={"vram": usable, "ram": have_host, "pinned": have_pinned},
            problems=problems,
            suggestions=[
                "moment_dtype='bfloat16' (halves the moments)",
                *([f"{quantize_hint} (frozen weights)"] if quantize_hint else []),
                "paging more blocks (param_offload=True)",
                "a smaller batch",
                "more RAM",
            ],
        )
    return budget


# Device state (device_state.py): a trainable set this small a share of the model's
# parameters (a LoRA's adapters) keeps its whole state on the compute device, where the
# per-tensor work of landing, host updates and pushes would cost more than its VRAM.
DEVICE_STATE_MAX_SHARE = 0.10
DEVICE_STATE_CLASS = "device state (trainable weights, gradients, moments, fp32 masters)"


def device_state_bytes(units, moment_bytes: int, ranks: int = 1) -> int:
    """Device bytes of the device-state slots among `units`: weights and gradient in the
    param's dtype, both moments, and an fp32 master for a param that is not fp32. Data
    parallel (`ranks` > 1) replicates all of it on every rank, and adds the fp32 buckets its
    gradients are averaged in ([Note: averaging buckets], distributed.py), held at the end of
    the window's last pass: on the device where NCCL reduces there, else host copies, counted
    here either way (an upper bound of 4 bytes per parameter)."""
    total = 0
    for u in units:
        for s in u.device_state_slots:
            n = s.param.numel()
            total += 2 * n * s.dtype.itemsize + 2 * n * moment_bytes + (4 * n if s.dtype != torch.float32 else 0)
            total += 4 * n if ranks > 1 else 0
    return total


def why_not_device_state(opts, units) -> str | None:
    """Why the trainable set keeps the host path whatever the bytes (None: it may go to
    device state): too large a share of the model, a non-contiguous param. Data parallel
    replicates device state on every rank (its gradients averaged over them), so the ranks
    do not decide it."""
    trainable = [s for u in units for s in u.slots if s.trainable]
    n_train = sum(s.param.numel() for s in trainable)
    n_all = sum(s.param.numel() for u in units for s in u.slots)
    if n_train > DEVICE_STATE_MAX_SHARE * n_all:
        return (
            f"the trainable parameters are {n_train / n_all:.1%} of the model "
            f"(device state is for at most {DEVICE_STATE_MAX_SHARE:.0%})"
        )
    bad = [s.name for s in trainable if not s.param.is_contiguous()]
    if bad:
        return f"{bad[0]} is not contiguous (the fused update reads flat tensors)"
    return None


def grads_stay_on_device(update_on_device: bool, opts) -> bool:
    """Gradients stay on the device for their update (optimizer_mode="gpu"), unless clipping
    (which needs every gradient first) or accumulation keeps them in host memory, or data
    parallel lands them there to be reduce-scattered (the kernel reads the reduced shard)."""
    return (
        update_on_device
        and opts.accumulation_steps == 1
        and opts.max_grad_norm is None
        and not data_parallel(opts.distributed)
    )


@dataclass(frozen=True)
class Plan:
    """Every decision wrap() makes before it moves a byte; the engine is built from it."""

    paged: tuple  # block indices whose weights live in host memory
    act_paged: tuple  # block indices whose saved activations are paged
    quantize: str | None  # the format of the frozen weights stored quantized ("int8", "nf4"), or None
    quantized: frozenset  # the names of those weights
    quant_block_size: int
    moment_dtype: torch.dtype
    update_on_device: bool  # optimizer_mode="gpu": the CUDA AdamW updates, over host moments
    device_grads: bool  # gradients stay on the device until their update reads them
    max_inflight_bytes: int
    region_bytes: int  # optimizer_mode="gpu": the largest moment region of several params (moments.py)
    copy_bytes: int  # the largest region copied through VRAM; larger ones are mapped
    mapped_bytes: int  # host arena for the device update's moments (and gradient sums)
    budget: dict  # bytes by resource and class, as check_fits counted them
    # The events that explain these decisions, by what they explain: the placement, the
    # moments' dtype, the optimizer mode, the quantization.
    placement_notes: tuple
    moment_notes: tuple
    mode_notes: tuple
    quant_notes: tuple
    options: object  # the validated options the plan was made from (options.Options)
    profile: object  # the HardwareProfile it was made against
    warning: str | None = None  # a lossy choice made for the user, said outside the log too
    # The names of the trainable slots whose whole state stays on the compute device
    # (device_state.py), and the events that explain the choice.
    device_state: frozenset = frozenset()
    device_state_notes: tuple = ()
    recompute: tuple = ()  # block indices recomputed in backward (never also in act_paged)

    @property
    def notes(self) -> tuple:
        return (
            *self.placement_notes,
            *self.moment_notes,
            *self.mode_notes,
            *self.quant_notes,
            *self.device_state_notes,
        )


QUANT_ORDER = ("int8", "nf4")  # quantize="auto" tries them in this order, after no quantization


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
    placement: Placement
    moment_dtype: torch.dtype
    update_on_device: bool
    budget: dict
    mapped_bytes: int
    moment_notes: list
    mode_notes: list
    device_state: frozenset = frozenset()
    device_state_notes: list = field(default_factory=list)


def _fit(opts, model, profile, backend, quantize_hint: str = "", no_device_state: str | None = None) -> _Fit:
    """Placement, moment dtype, optimizer mode and device state for the units with their
    quantization as set now; DoesNotFit when it does not fit.

    Device state is tried after the placement without it: every trainable slot keeps its
    state on the device when neither `no_device_state` (why not, said by the caller) nor
    why_not_device_state finds anything against it, its bytes fit, and the placement with
    them counted as resident pages no more blocks' weights and no more blocks' activations
    than the one without them."""
    set_device_state(model.units, ())
    base = _fit_placement(opts, model, profile, backend, quantize_hint)
    trainable = [s for u in model.units for s in u.slots if s.trainable]
    if not trainable:
        return base
    ranks = world_size(opts.distributed)
    why = no_device_state or why_not_device_state(opts, model.units)
    if why is None:
        names = frozenset(s.name for s in trainable)
        set_device_state(model.units, names)
        try:
            fit = _fit_placement(opts, model, profile, backend, quantize_hint)
        except DoesNotFit as e:
            fit, why = None, f"its {_device_state_gib(model.units, 4, ranks)} would not fit ({'; '.join(e.problems)})"
        if fit is not None:
            more = len(fit.placement.paged) - len(base.placement.paged)
            more_acts = len(fit.placement.act_paged) + len(fit.placement.recompute)
            more_acts -= len(base.placement.act_paged) + len(base.placement.recompute)
            if more > 0 or more_acts > 0:
                why = (
                    f"its VRAM would page {max(more, 0)} more blocks' weights and {max(more_acts, 0)} more "
                    "blocks' activations"
                )
            else:
                moments = str(fit.moment_dtype).replace("torch.", "")
                n_masters = sum(s.dtype != torch.float32 for s in trainable)
                masters = f" and {n_masters} fp32 masters" if n_masters else ""
                where = "VRAM" if backend.is_cuda else f"{backend.device} memory"
                fit.device_state = names
                replicated = (
                    f" on each of the {ranks} ranks: replicated, their gradients averaged over the ranks before "
                    "the update"
                    if ranks > 1
                    else ""
                )
                fit.device_state_notes = [
                    f"device state: the {len(trainable)} trainable tensors "
                    f"({sum(s.param.numel() for s in trainable):,} parameters) keep their weights, "
                    f"gradients (p.grad), {moments} moments{masters} in {where} "
                    f"({_device_state_gib(model.units, fit.moment_dtype.itemsize, ranks)}{replicated}): no "
                    "gradient hooks, no host round trip; their update runs in optimizer.step(), fused"
                ]
                return fit
        set_device_state(model.units, ())
        for u in model.block_units:  # the trial's flags back to the placement kept
            u.paged = u.block in base.placement.paged
            u.act_paged = u.block in base.placement.act_paged
            u.recompute = u.block in base.placement.recompute
    base.device_state_notes = [f"device state: not used, the trainable set keeps the host path: {why}"]
    return base


def _device_state_gib(units, moment_bytes: int, ranks: int) -> str:
    return f"{device_state_bytes(units, moment_bytes, ranks) / MiB:.1f} MiB"


def _fit_placement(opts, model, profile, backend, quantize_hint: str = "") -> _Fit:
    """_fit for the device-state flags as set now."""
    block_units, outside_units = model.block_units, model.outside_units
    placement = choose(opts, block_units, outside_units, model.unpageable, profile, model.on_device)
    for u in block_units:
        u.paged = u.block in placement.paged
        u.act_paged = u.block in placement.act_paged
        u.recompute = u.block in placement.recompute
    units = block_units + outside_units
    moment_notes = []
    moment_dtype = torch.float32 if opts.moment_dtype == "auto" else opts.moment_dtype
    if opts.moment_dtype == "auto":
        moment_dtype, note = choose_moment_dtype(opts, units, profile)
        moment_notes.append(note)
    update_on_device, mode_note = choose_optimizer_mode(opts, units, profile, moment_dtype.itemsize, backend)
    trainable = [s for u in units for s in u.trainable]
    if update_on_device:
        _check_contiguous(trainable)
    # optimizer_mode="gpu": the moments (copied to VRAM per update, moments.py) and the
    # accumulated gradient sums (which the kernel maps) are carved from one arena, pinned on
    # a GPU; on the CPU backend the arena is plain memory and the same layout runs in CI.
    from .device import HostArena
    from .layout import arena_sizes

    device_grads = grads_stay_on_device(update_on_device, opts)  # no landing buffers then
    weight_takes = arena_sizes(units, stage=not device_grads)
    moment_takes = _moment_arena_sizes(opts, units, moment_dtype, profile) if update_on_device else []
    mapped_bytes = sum(moment_takes)
    budget = check_fits(
        opts,
        units,
        placement,
        backend,
        profile,
        model.on_device,
        moment_dtype.itemsize,
        HostArena.pinned_for(weight_takes) + HostArena.pinned_for(moment_takes),
        device_grads,
        quantize_hint,
        pinned_needed=sum(weight_takes) + sum(moment_takes),
    )
    return _Fit(
        placement, moment_dtype, update_on_device, budget, mapped_bytes, moment_notes, [mode_note] if mode_note else []
    )


def _moment_arena_sizes(opts, units, moment_dtype, profile) -> list:
    """The takes of the device update's arena (engine._lay_out_moments), in its order: the
    moment regions as moments.lay_out carves them (of the shards, under data parallel), then
    the accumulation sums, which the kernel reads; or under data parallel, where gradients
    sum in their landing buffers and are reduce-scattered from there, each unit's reduced
    shard instead (distributed.UnitShards), which it reads then."""
    from .device import HostArena
    from .distributed import segment_numel
    from .moments import lay_out

    inflight = inflight_bytes(opts, profile)
    sizes = []

    def record(shape, dtype):
        sizes.append(HostArena.size_of(shape[0], dtype))
        return torch.empty(shape, dtype=dtype, device="meta")

    lay_out(units, moment_dtype, region_limit(inflight), copy_limit(inflight), record)
    if data_parallel(opts.distributed):
        ranks = world_size(opts.distributed)
        sizes += [HostArena.size_of(segment_numel(u, ranks), torch.float32) for u in units if u.trainable]
    elif opts.accumulation_steps > 1:
        sizes += [HostArena.size_of(s.param.numel(), torch.float32) for u in units for s in u.trainable]
    return sizes


def _fit_quantized(
    opts, model, profile, backend, no_device_state: str | None
) -> tuple[_Fit, str | None, list, str | None]:
    """The fit with the quantize setting applied: (fit, format, notes, warning). quantize='auto' tries
    no quantization, then int8, then NF4, and keeps the first that fits (prefer='speed': NF4
    as well when it keeps every block resident where the first choice pages some).
    `no_device_state`: why device state is not to be used (_fit)."""
    quantizable = model.quantizable
    formats = {"auto": [None, "int8", "nf4"], "none": [None], "int8": ["int8"], "nf4": ["nf4"]}[opts.quantize]
    if not quantizable:
        formats = [None]
    notes, refused = [], []
    for i, fmt in enumerate(formats):
        last = i == len(formats) - 1
        set_quantization(quantizable, fmt, opts.quant_block_size)
        smaller = QUANT_ORDER[QUANT_ORDER.index(fmt) + 1 :] if fmt else QUANT_ORDER  # formats that shrink more
        hint = " or ".join(f"quantize={f!r}" for f in smaller) if quantizable and last else ""
        try:
            fit = _fit(opts, model, profile, backend, quantize_hint=hint, no_device_state=no_device_state)
        except DoesNotFit as e:
            if not last:
                refused.append(f"{fmt or 'no quantization'} ({'; '.join(e.problems)})")
                continue
            if refused:
                raise e.with_problems(
                    [*e.problems, f"quantize='auto' tried, and it did not fit either with {'; '.join(refused)}"]
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
            nf4 = _fit(opts, model, profile, backend, no_device_state=no_device_state)
        except DoesNotFit:
            nf4 = None
        if nf4 is not None and not nf4.placement.paged:
            notes.append(
                f"quantize='auto', prefer='speed': nf4 keeps every block in VRAM ({fmt or 'no quantization'}"
                f" paged {len(fit.placement.paged)})"
            )
            fit, fmt = nf4, "nf4"
        else:
            set_quantization(quantizable, fmt, opts.quant_block_size)
            fit = _fit(opts, model, profile, backend, no_device_state=no_device_state)
    if fmt is None:
        more = " more" if model.prequantized else ""  # beside the weights that arrived quantized
        if opts.quantize in ("int8", "nf4"):
            notes.append(
                f"quantize={opts.quantize!r}: no{more} frozen weight matrix in the blocks to quantize "
                "(trainable weights are never quantized)"
            )
        elif opts.quantize == "auto":
            notes.append(
                f"quantize='auto': nothing{more} quantized"
                + ("" if quantizable else " (no frozen weight matrices in the blocks)")
            )
        return fit, None, notes, None
    warning = None
    if opts.quantize == "auto":  # a lossy choice made for the user: say it outside the log too
        why_auto = (
            "because the run does not fit otherwise; pass quantize='none' to get the DoesNotFit error instead"
            if refused
            else "because prefer='speed' and it keeps every block in VRAM"
        )
        warning = f"trainstream.wrap(): quantize='auto' stores {len(quantizable)} frozen weights as {fmt}, {why_auto}"
    before = sum(s.full_nbytes for s in quantizable)
    after = sum(s.nbytes for s in quantizable)
    why = f", because it does not fit with {'; '.join(refused)}" if refused else ""
    notes.append(
        f"quantize={opts.quantize!r}: {len(quantizable)} frozen weights as {fmt} (block "
        f"{opts.quant_block_size}), {before / GiB:.2f} -> {after / GiB:.2f} GiB{why}"
    )
    return fit, fmt, notes, warning


def _trial(model):
    """A copy of the layout's units and slots to try placements and formats on: the params
    are shared, the fields planning writes (paged, act_paged, recompute, quant_format) are its own."""
    copies = {}

    def own_containers(obj) -> None:
        # copy.copy shares the original's lists and dicts, which the engine later fills in
        # place (a unit's waiting gradients, update handles, checks, paged activations; a
        # slot's host buffers), and a trial lives until the cyclic GC frees it (unit <-> its
        # slots): a shared list held the first batch of gradients of every unit until then.
        for key, value in vars(obj).items():
            if isinstance(value, (list, dict, set)):
                setattr(obj, key, copy.copy(value))

    def unit_copy(u):
        c = copy.copy(u)
        c.__dict__.pop("trainable", None)  # a cached view of the original's slots
        own_containers(c)
        c.slots = []
        for s in u.slots:
            copies[s] = sc = copy.copy(s)
            own_containers(sc)
            sc.unit = c
            c.slots.append(sc)
        return c

    return dataclasses.replace(
        model,
        block_units=[unit_copy(u) for u in model.block_units],
        outside_units=[unit_copy(u) for u in model.outside_units],
        quantizable=[copies[s] for s in model.quantizable],
    )


def plan_run(opts, model, profile, backend, refuse_device_state: str | None = None) -> Plan:
    """Decide everything for `model` (a ModelLayout: the units and what wrap() found about
    them) on this machine; DoesNotFit when nothing fits. Formats and placements are tried on
    a copy of the units: `model` is left as it is, and the engine applies the plan.
    `refuse_device_state`: why the trainable set keeps the host path, decided by the caller
    (None: the plan decides)."""
    fit, fmt, quant_notes, warning = _fit_quantized(opts, _trial(model), profile, backend, refuse_device_state)
    inflight = inflight_bytes(opts, profile)
    return Plan(
        paged=tuple(fit.placement.paged),
        act_paged=tuple(fit.placement.act_paged),
        recompute=tuple(fit.placement.recompute),
        quantize=fmt,
        quantized=frozenset(s.name for s in model.quantizable) if fmt else frozenset(),
        quant_block_size=opts.quant_block_size,
        moment_dtype=fit.moment_dtype,
        update_on_device=fit.update_on_device,
        device_grads=grads_stay_on_device(fit.update_on_device, opts),
        max_inflight_bytes=inflight,
        region_bytes=region_limit(inflight),
        copy_bytes=copy_limit(inflight),
        mapped_bytes=fit.mapped_bytes,
        budget=fit.budget,
        placement_notes=tuple(fit.placement.notes),
        moment_notes=tuple(fit.moment_notes),
        mode_notes=tuple(fit.mode_notes),
        quant_notes=(*model.notes, *quant_notes),
        options=opts,
        profile=profile,
        warning=warning,
        device_state=fit.device_state,
        device_state_notes=tuple(fit.device_state_notes),
    )
