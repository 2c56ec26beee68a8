"""What the engine keeps per parameter (a Slot) and per group of parameters moved and
updated together (a Unit: one block of the stack, or one module outside it)."""

from __future__ import annotations

import enum
import functools
import sys
from dataclasses import dataclass, field

import torch

from ..quant.weight import code_layout, quantized_nbytes


class PlanEpoch:
    """Moves on at every write of a plan field (_PlanField) of any unit or slot: a cache over
    many units (the engine's "does any block need backward hooks") is current while the epoch
    it was computed at is."""

    value = 0


class _PlanField:
    """A dataclass field of Slot or Unit that decides what a unit streams or how its block runs
    (Unit.paged, act_paged, recompute; Slot.quant_format, device_state). Every write, whoever
    makes it (the pager, the activation pager, layout.set_*, the planner on its trial copies),
    drops the cached views of the unit it belongs to (Unit.views; a Slot's: of `slot.unit`) and
    moves PlanEpoch on, so no cache of them can outlive a change. A copy of a Unit sharing its
    Slot objects is not that unit: the planner's trial copies copy the slots too and re-point
    them (placement._trial). The value lives in the instance's __dict__ under `_<name>`."""

    def __init__(self, default):
        self.default = default

    def __set_name__(self, owner, name):
        self.key = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.default  # the dataclass's default for the field
        return obj.__dict__[self.key]

    def __set__(self, obj, value):
        d = obj.__dict__
        d[self.key] = value
        unit = obj if isinstance(obj, Unit) else d.get("unit")
        if unit is not None:
            unit.__dict__["_views"] = None
            unit.__dict__.pop("trainable", None)  # the cached_property: device_state decides it
        PlanEpoch.value += 1


@dataclass(eq=False)
class Slot:
    param: torch.nn.Parameter
    name: str
    dtype: torch.dtype  # the dtype the model was built with
    trainable: bool  # updated by the engine's optimizer
    is_linear: bool  # weight or bias of an nn.Linear: may page in the autocast dtype
    unit: Unit = None
    # Trainable and kept whole on the compute device (the plan's device_state, device_state.py):
    # weights, gradient (p.grad, as torch keeps it), moments and any fp32 master. No host
    # buffer, no gradient hook, never paged (a paged unit pages its other slots only).
    device_state: bool = _PlanField(False)
    # Frozen weights stored quantized (wrap(quantize=...)): the format and block size, and the
    # QuantizedWeight once made (WeightPager.place). Its codes live on the device for a resident
    # unit, in host transfer memory for a paged one; the weight itself exists only while a
    # forward or backward uses it, dequantized like a paged weight is fetched.
    quant_format: str | None = _PlanField(None)
    quant_block: int = 64
    quant: object = None
    # Host weights by dtype. Trainable: host[float32] is the master the optimizer updates,
    # and at most one lower-precision copy, which the optimizer writes in the same pass.
    # Frozen paged: the original weights, plus any compute-dtype copy made from them.
    # Data parallel (`shard` set): only the full weights a paged unit's forward reads from
    # host memory, in the model's dtype (and a compute-dtype copy made from them); none for
    # a resident unit, whose weights are on the device. The master is `master_shard` then.
    host: dict = field(default_factory=dict)
    # Data parallel ([Note: shards], distributed.py): the elements [lo, hi) of the flat param
    # this rank updates; `master_shard` is the fp32 master of those elements alone (1-D), the
    # only fp32 master this rank holds of the param; `incoming` is a resident unit's new
    # weights, all-gathered in the model's dtype, until the push takes them to the device.
    shard: tuple | None = None
    master_shard: torch.Tensor | None = None
    incoming: torch.Tensor | None = None
    placeholder: torch.Tensor | None = None  # a paged param's data while it is not on the device
    # The param's version counter (p._version) when the engine last knew its values: a user's
    # in-place edit (p.zero_(), nn.init, p.copy_ under no_grad) moves it on; the engine's own
    # writes go through p.data, which has a counter of its own, and leave it be.
    version: int = 0
    spare: torch.Tensor | None = None  # reserved host room for a compute-dtype copy (paged fp32 Linear)
    # Gradient landing (trainable only).
    stage_region: torch.Tensor | None = None  # reserved host room for the landing buffer
    stage: torch.Tensor | None = None  # the landing buffer, a view of stage_region in the gradient's dtype
    grad_sum: torch.Tensor | None = None  # fp32 sum over the micro-batches (accumulation_steps > 1)
    device_grad: torch.Tensor | None = None  # optimizer_mode="gpu": the gradient, left where autograd made it
    norm: torch.Tensor | None = None  # device-side L2 norm of this pass's gradient (clipping)
    reader = None  # the last host job that reads stage / grad_sum
    fresh: bool = False  # landed in this pass, not yet handed on
    seen_pass: int = -1  # the backward pass whose gradient arrived last
    has_grad: bool = False  # a gradient landed in this accumulation window

    @property
    def master(self) -> torch.Tensor:
        if self.shard is not None:  # host[float32] may be a paged fp32 unit's weights, not the master
            raise RuntimeError(f"trainstream internal: {self.name} is sharded: its master is master_shard")
        return self.host[torch.float32]

    def copy_dtype(self):
        """The lower-precision host copy the optimizer keeps current, if any."""
        return next((d for d in self.host if d != torch.float32), None)

    @property
    def nbytes(self) -> int:
        """Bytes the weights take where they are kept: quantized, codes plus absmax."""
        if self.quant_format is not None:
            return quantized_nbytes(self.param.numel(), self.quant_format, self.quant_block)
        return self.full_nbytes

    @property
    def full_nbytes(self) -> int:
        """Bytes of the weights in the model's dtype (a quantized one, dequantized)."""
        return self.param.numel() * self.dtype.itemsize


class Fetch(enum.Enum):
    """Where a streamed unit's weights are (params.py moves them; its owner alone)."""

    RELEASED = "released"  # placeholders: nothing of them on the device
    FETCHED = "fetched"  # copies to the device queued for a use now
    AHEAD = "ahead"  # copies queued ahead of use: counted against max_inflight_bytes until used
    ATTACHED = "attached"  # the params' .data point at the fetched tensors; compute waits for the copy


class GradWindow(enum.Enum):
    """A unit's gradients in the current accumulation window (grads.py moves them)."""

    EMPTY = "empty"  # none yet
    LANDING = "landing"  # some of this pass's are waiting on the device or on their way to the host
    LANDED = "landed"  # landed (and summed, with accumulation), the update not handed on yet
    QUEUED = "queued"  # the window's update was handed to the optimizer
    SKIPPED = "skipped"  # a gradient of the window was not finite (nonfinite="skip"): no update, gradients dropped


@dataclass(eq=False)
class Unit:
    name: str
    block: int | None  # index in the block stack; None outside it
    slots: list
    paged: bool = _PlanField(False)  # weights live in host memory and are fetched for each use
    act_paged: bool = _PlanField(False)  # saved activations go to host memory during forward
    # Forward under torch.utils.checkpoint (non-reentrant): only the block's inputs are kept,
    # its forward runs again in backward. Never set together with act_paged.
    recompute: bool = _PlanField(False)
    # Why this block is never recomputed (engine/recompute_call.py), once a call showed it.
    no_recompute: str | None = None
    # Updates of this unit's weights that may still be running: host optimizer jobs, or
    # DeviceUpdates (optimizer_mode="gpu").
    updates: list = field(default_factory=list)
    stale: bool = False  # resident: the host has newer weights than the device
    update_mark = None  # compute's position when the update was queued (resident)
    priority: int = 0  # when the next forward needs it (the host pool runs lowest first)
    h2d_event = None  # resident: the new weights' copy to the device (or their device update)
    landed: int = 0  # gradients landed in the current backward pass
    # Small gradients of this pass held on the device until the unit's last one (or the end
    # of the pass) sends them out together: (slot, gradient).
    waiting: list = field(default_factory=list)
    grad_event = None  # the last of those gradients' copies to the host
    # This pass's squared gradient norms in host memory, as (float32 tensor, slots), one per
    # batch: readable once grad_event has passed (the non-finite check, grads.py).
    checks: list = field(default_factory=list)
    window: GradWindow = GradWindow.EMPTY
    # Paged weights currently on the device: slot -> device tensor, and how they came.
    fetched: dict | None = None
    fetch_event = None
    fetch_dtypes: dict = field(default_factory=dict)  # slot -> dtype used by the last forward
    fetch: Fetch = Fetch.RELEASED  # invariant: RELEASED exactly when fetched is None
    acts: list = field(default_factory=list)  # paged activations saved this pass

    @functools.cached_property
    def trainable(self) -> list:
        """The slots the optimizer updates through the host path: gradients landed, updates
        queued per unit (fixed at wrap(); read on every gradient). Device-state slots are not
        among them (a write of Slot.device_state drops this cache: _PlanField)."""
        return [s for s in self.slots if s.trainable and not s.device_state]

    @property
    def views(self) -> UnitViews:
        """What the unit streams and holds by kind, as the plan fields say now: computed at the
        first read after any of them changed (_PlanField drops it), read on every hook. The
        unit's slots are fixed once built (build_units appends them before any read)."""
        views = self.__dict__.get("_views")
        # A copy of the unit (copy.copy: the planner's trials) carries the original's views,
        # made over the original's slots: made again for the copy's.
        if views is None or views.unit is not self or views.slots is not self.slots:
            views = self.__dict__["_views"] = UnitViews(self)
        return views

    @property
    def device_state_slots(self) -> tuple:
        """The trainable slots whose whole state stays on the compute device."""
        return self.views.device_state_slots

    @property
    def pageable_slots(self) -> tuple:
        """The slots a paged unit keeps in host memory: every one but the device-state ones."""
        return self.views.pageable_slots

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @property
    def streamed_slots(self) -> tuple:
        """Slots whose weights are brought to the device for each use and released after:
        all of a paged unit's, and the quantized ones of a resident unit (dequantized there)."""
        return self.views.streamed_slots

    @property
    def streamed(self) -> bool:
        return self.views.streamed

    @property
    def fetch_nbytes(self) -> int:
        """Device bytes one fetch holds (quantized weights count dequantized)."""
        return self.views.fetch_nbytes


class UnitViews:
    """A unit's slots by kind, for its plan fields as they were when made (Unit.views): a new
    one is made after any change, so an object identity check tells a cache built on these
    (the pager's fetch layouts) whether it is current."""

    __slots__ = (
        "unit",
        "slots",
        "device_state_slots",
        "pageable_slots",
        "quantized_slots",
        "streamed_slots",
        "streamed",
        "fetch_nbytes",
    )

    def __init__(self, unit: Unit):
        self.unit, self.slots = unit, unit.slots  # what they were made for (Unit.views checks)
        slots = unit.slots
        self.device_state_slots = tuple(s for s in slots if s.device_state)
        self.pageable_slots = tuple(s for s in slots if not s.device_state)
        self.quantized_slots = quantized = tuple(s for s in slots if s.quant_format is not None)
        self.streamed_slots = self.pageable_slots if unit.paged else quantized
        self.streamed = unit.paged or bool(quantized)
        self.fetch_nbytes = sum(s.full_nbytes for s in self.streamed_slots)


def _own_parameters(model: torch.nn.Module) -> list:
    """(name, module, [(name, parameter) registered on it]) for every module of `model` in
    module order: one walk, which build_units reads twice."""
    return [
        (mod_name, module, [(n, p) for n, p in module._parameters.items() if p is not None])
        for mod_name, module in model.named_modules()
    ]


def _owner_names(own: list) -> dict:
    """Each parameter -> (owning module, qualified name), first owner in module order."""
    owners = {}
    for mod_name, module, params in own:
        for p_name, p in params:
            owners.setdefault(p, (module, f"{mod_name}.{p_name}" if mod_name else p_name))
    return owners


def build_units(model: torch.nn.Module, blocks: list, trainable: set) -> tuple[list, list, list]:
    """Units for the blocks (in order) and for the modules outside them, plus notes for
    the events log. A block that shares a parameter with anything outside it (tied weights)
    is marked unpageable in its note and in the returned list of indices."""
    # One walk of the model and one of each block: a 7B model has tens of thousands of
    # (module, parameter) pairs, and walking a block per pair cost a quarter second.
    own = _own_parameters(model)
    owners = _owner_names(own)
    block_of = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            block_of.setdefault(p, i)
    inside = [{id(m) for m in block.modules()} for block in blocks]  # the models keep every module alive
    shared = set()
    for _, module, params in own:
        for _, p in params:
            i = block_of.get(p)
            if i is not None and id(module) not in inside[i]:
                shared.add(i)

    def slot(p):
        module, name = owners[p]
        return Slot(p, name, p.dtype, p in trainable, isinstance(module, torch.nn.Linear))

    block_units = []
    for i, block in enumerate(blocks):
        slots = [slot(p) for p in dict.fromkeys(block.parameters()) if block_of[p] == i]
        block_units.append(Unit(f"block {i}", i, slots))
    name_of = {id(m): n for n, m, _ in own}  # named_modules() names each module once, first name
    outside_units, by_owner = [], {}
    for p, (module, _) in owners.items():
        if p in block_of:
            continue
        unit = by_owner.get(id(module))
        if unit is None:
            unit = by_owner[id(module)] = Unit(name_of[id(module)] or "<root>", None, [])
            outside_units.append(unit)
        unit.slots.append(slot(p))
    for unit in block_units + outside_units:
        for s in unit.slots:
            s.unit = unit
    return block_units, outside_units, sorted(shared)


def host_buffers(s: Slot, paged: bool, stage: bool = True) -> list:
    """(kind, dtype, numel) of every host transfer buffer slot `s` needs; `stage`: a landing
    buffer for its gradient (not when gradients stay on the device, optimizer_mode="gpu")."""
    n = s.param.numel()
    need = []
    if s.device_state:  # its whole state is on the device (device_state.py)
        return need
    if s.quant_format is not None:  # frozen: a paged unit keeps the codes and scales in host memory
        if paged:
            codes, code_dtype = code_layout(n, s.quant_format)
            need += [("codes", code_dtype, codes), ("absmax", torch.float32, -(-n // s.quant_block))]
        return need
    if s.trainable and s.shard is not None:
        # Data parallel: the master of this rank's shard; the gradient lands whole (it is
        # reduce-scattered from there); the full weights only where a forward reads them from
        # host memory (a paged unit), in the model's dtype: a resident unit's are on the device.
        lo, hi = s.shard
        need += [("master", torch.float32, hi - lo)] + ([("stage", s.dtype, n)] if stage else [])
        if paged:
            need.append(("copy", s.dtype, n))
    elif s.trainable:
        need += [("master", torch.float32, n)] + ([("stage", s.dtype, n)] if stage else [])
        if s.dtype != torch.float32:
            need.append(("copy", s.dtype, n))
    elif paged:
        need.append(("copy", s.dtype, n))
    if paged and s.is_linear and s.dtype == torch.float32:
        need.append(("spare", torch.bfloat16, n))  # room for an autocast-dtype copy (2 bytes each)
    return need


def arena_sizes(units: list, stage: bool = True) -> list:
    """The bytes (HostArena.size_of) of every host buffer of `units`, in the order the pager
    takes them from its arena (params.place)."""
    from .device import HostArena

    return [
        HostArena.size_of(numel, dtype)
        for u in units
        for s in u.slots
        for _, dtype, numel in host_buffers(s, u.paged, stage)
    ]


def arena_bytes(units: list, stage: bool = True) -> int:
    """Transfer memory (pinned on a GPU machine) the engine carves its host buffers from."""
    return sum(arena_sizes(units, stage))


QUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# nn.MultiheadAttention's input projections: F.linear reads them (out_proj is an nn.Linear).
_ATTENTION_PROJECTIONS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
# transformers' fused MoE experts (MixtralExperts, Qwen2MoeExperts, Llama4TextExperts, ...):
# (experts, out, in) or (experts, in, out) tensors that each expert's rows multiply; their
# 2-D biases (gate_up_proj_bias) are added, not multiplied.
_FUSED_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def _is_matmul_weight(module: torch.nn.Module, name: str, p: torch.Tensor) -> bool:
    """Whether `module` uses its parameter `name` only as the matrix of a product, where
    QLoRA quantizes: nn.Linear's weight, GPT-2's Conv1D, nn.MultiheadAttention's input
    projections, a transformers fused-experts tensor. Anything else may be read in ways a
    lossy code would change silently: indexed (positional or relative-position-bias tables,
    embeddings), convolved, or passed through a function (Mamba's A_log, used as -exp)."""
    if isinstance(module, torch.nn.Linear):
        return name == "weight"
    if isinstance(module, torch.nn.MultiheadAttention):
        return name in _ATTENTION_PROJECTIONS
    cls = type(module)
    if not cls.__module__.startswith("transformers."):  # transformers' own classes, not remote code
        return False
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")  # a model holding one imported it
    if pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D):
        return name == "weight"
    # The experts' parameters are named as the projections they fuse and have the expert
    # dimension first; transformers' dense projections are nn.Linear submodules instead, so
    # a 3-D parameter of such a name in a transformers module is a fused expert tensor.
    return name in _FUSED_EXPERT_WEIGHTS and p.dim() == 3


# The reason's text names the allowlist: a matrix it does not know (an MoE router's raw
# weight, say) is listed here too, kept exact.
NOT_MATMUL = "not a matmul weight (nn.Linear, Conv1D, MultiheadAttention's in-projections, fused MoE experts)"


def _kept_reason(s: Slot, uses: list) -> str | None:
    """Why block weight `s` is never stored quantized, or None when it may be: it must be
    frozen, of a dtype the codes rebuild, and every module registering it (`uses`: (module,
    name) pairs) must use it only as a matrix multiplied (_is_matmul_weight). The codes are
    blockwise over the flat values, so the layout does not matter: dequantizing gives the
    same shape back."""
    if s.trainable or s.param.requires_grad:  # autograd would give it a full-size gradient
        return "trainable"
    if s.param.dim() < 2:
        return "1-D (biases, norms, scales)"
    if not uses or not all(_is_matmul_weight(m, n, s.param) for m, n in uses):
        return NOT_MATMUL
    if s.dtype not in QUANT_DTYPES:
        return f"dtype {s.dtype}"
    return None


def quantizable_slots(block_units: list, blocks: list, unpageable: list) -> tuple[list, list]:
    """The weights wrap(quantize=...) may store quantized: the frozen matrix weights of the
    blocks (see _kept_reason: as QLoRA, not biases, norms, embeddings, convolutions, anything
    the optimizer holds, or anything that still requires grad). Weights of a block that shares
    a parameter with the outside, and weights shared between blocks, are left as they are:
    other modules would read the placeholder. Weights that arrived quantized (quantize_model,
    load_model) keep their own codes and are not among them. Returns the slots and a note of
    what stays unquantized in the blocks, with its bytes, by reason."""
    in_blocks: dict = {}
    uses: dict = {}  # parameter -> every (module, name) registering it in the blocks
    for block in blocks:
        for p in dict.fromkeys(block.parameters()):
            in_blocks[p] = in_blocks.get(p, 0) + 1
        for m in block.modules():
            for n, p in m._parameters.items():
                if p is not None:
                    uses.setdefault(p, []).append((m, n))
    slots, kept = [], {}
    for unit in block_units:
        for s in unit.slots:
            if s.quant_format is not None:
                continue
            reason = _kept_reason(s, uses.get(s.param, []))
            if reason is None and (unit.block in unpageable or in_blocks.get(s.param, 0) > 1):
                reason = "shared with other modules"
            if reason is None:
                slots.append(s)
            else:
                kept.setdefault(reason, []).append(s)
    notes = [unquantized_note(kept)] if kept else []
    return slots, notes


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


def unquantized_note(kept: dict) -> str:
    """The event line for the block weights no quantize setting stores quantized."""
    parts = []
    for reason, slots in kept.items():
        names = ", ".join(s.name for s in slots[:2]) + (" ..." if len(slots) > 2 else "")
        parts.append(f"{reason}: {len(slots)} tensors, {_kib(sum(s.full_nbytes for s in slots))} ({names})")
    return "quantize: never quantized in the blocks: " + "; ".join(parts)


def _refuse_lost_codes(model: torch.nn.Module) -> None:
    """A copy of a model whose weights were stored as codes, made by copy.deepcopy, has
    parameters without them (placeholders): ValueError rather than training on NaN."""
    from ..quant.stored import lost_codes

    for name, module in model.named_modules():
        lost = lost_codes(module)
        if lost:
            raise ValueError(
                f"wrap(): {name + '.' if name else ''}{lost[0]} was stored quantized and this copy of the model lost its "
                "codes (copy.deepcopy does not carry them): copy the model before quantizing it, or quantize the copy"
            )


def adopt_stored_codes(block_units: list, outside_units: list) -> tuple[list, list]:
    """Parameters that arrive holding codes (quantize_model, load_model): their slots take
    the codes' format and block size, which no plan changes (there are no values left to
    quantize otherwise). Returns those slots and their event line. Such a parameter outside
    the block stack, or one the optimizer would train, cannot be served: ValueError."""
    from ..quant.stored import codes_of

    for u in outside_units:
        for s in u.slots:
            if codes_of(s.param) is not None:
                raise ValueError(
                    f"wrap(): {s.name} holds quantized codes but is outside the block stack wrap() uses; pass "
                    "the blocks= given to quantize_model(), or quantize only the stack wrap() finds"
                )
    stored = []
    for u in block_units:
        for s in u.slots:
            q = codes_of(s.param)
            if q is None:
                continue
            if s.trainable or s.param.requires_grad:  # autograd would give the codes a full-size gradient
                raise ValueError(
                    f"wrap(): {s.name} holds quantized codes and requires grad: quantized weights are frozen; "
                    f"call {s.name}.requires_grad_(False), or do not quantize it"
                )
            s.quant_format, s.quant_block = q.format, q.block_size
            stored.append(s)
    if not stored:
        return [], []
    formats = sorted({s.quant_format for s in stored})
    before, after = sum(s.full_nbytes for s in stored), sum(s.nbytes for s in stored)
    return stored, [
        f"quantize: {len(stored)} frozen weights arrived quantized as {'/'.join(formats)} (quantize_model or "
        f"load_model) and keep their codes, {_kib(before)} -> {_kib(after)}"
    ]


def set_quantization(slots: list, fmt: str | None, block_size: int) -> None:
    for s in slots:
        s.quant_format, s.quant_block = fmt, block_size


def set_device_state(units: list, names) -> None:
    """Mark the trainable slots named in `names` as device state, and every other slot as
    not; each unit's cached host-path `trainable` list is recomputed at its next read."""
    names = set(names)
    for u in units:
        for s in u.slots:
            s.device_state = s.trainable and s.name in names


def set_recompute(unit: Unit, on: bool) -> None:
    """Recompute `unit`'s forward in backward from its next forward on (the plan, a replan, the
    online guard); a block's activations are paged or recomputed, never both."""
    if on and unit.act_paged:
        raise RuntimeError(f"trainstream internal: {unit.name} would page and recompute its activations")
    unit.recompute = on


@dataclass(eq=False)
class ModelLayout:
    """The model as the planner and the engine see it: its units, which blocks may not be
    paged, which frozen weights may be quantized, and what of it is on the device now."""

    block_units: list
    outside_units: list
    unpageable: list  # blocks sharing a parameter with the outside (tied weights)
    quantizable: list  # slots of frozen block weights that may be stored quantized
    notes: list  # events: what could not be quantized and why
    on_device: int  # bytes of its weights already on the target GPU
    stack: object = None  # the BlockStack the block units were made from (blocks.py)
    prequantized: list = field(default_factory=list)  # slots whose parameters arrived holding codes (quant.stored)

    @property
    def units(self) -> list:
        return self.block_units + self.outside_units


def lay_out_model(model: torch.nn.Module, stack, trainable: set, device: torch.device) -> ModelLayout:
    """The units of `model`: one per block of `stack`, one per module outside it holding
    parameters; `trainable`: the parameters the optimizer updates."""
    block_units, outside_units, unpageable = build_units(model, stack.blocks, trainable)
    _refuse_lost_codes(model)
    prequantized, stored_notes = adopt_stored_codes(block_units, outside_units)
    quantizable, notes = quantizable_slots(block_units, stack.blocks, unpageable)
    on_device = sum(
        s.nbytes
        for u in block_units + outside_units
        for s in u.slots
        if s.param.device == device and device.type == "cuda"
    )
    return ModelLayout(
        block_units, outside_units, unpageable, quantizable, [*stored_notes, *notes], on_device, stack, prequantized
    )
