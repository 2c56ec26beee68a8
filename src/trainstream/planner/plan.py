"""The plan: which blocks page their weights, and for each block whether its saved activations
stay on the device, are paged to host memory, or are recomputed in backward.

A pure function of byte counts and rates, so it is tested table by table without a GPU.

Device bytes of a placement: the fixed part (modules outside the stack, one block's
gradients on their way out, the adaptation's measured correction), every resident block's
weights, the weights in flight (two paged blocks'), and the saved activations at their
peak. That is the larger of two moments:
- the end of the forward pass: every block's activations that are not paged, with what
  runs after the stack on top (the head's logits, the loss: `after_stack_bytes`, measured);
- each block's backward: its own activations (kept, or fetched back when paged) and the
  paged activations of the `prefetch_depth` blocks before it (fetched ahead as it starts,
  whether it is kept, paged or recomputed), above the not-paged activations of the blocks
  before it (backward reaches them later) and what the head still holds then
  (`held_after_stack_bytes`: the logits, while the caller keeps them).
Adding the two would count the head's peak and the fetched activations as held at once;
they never are.
Each moment a block's backward runs also holds what that backward allocates beside its
activations (`backward_bytes`: the gradients of its activations, an attention's score
gradients; measured per block as the device's peak rises during it), above what it and the
blocks before it keep; a block recomputed or paged has its activations back then, whole.
Under bf16 autocast a resident block also holds autocast's bf16 copies of its trainable
weights (`cast_bytes`, part of its measured activations): autocast keeps them until the
forward ends, saved for backward or not. A paged block's weights arrive in bf16 and are not
copied. So paging a block's weights frees its weights and the copies; paging its
activations frees the rest of them.

Step time of a placement: the forward phase and the backward phase one after the other,
each the largest of three times that overlap one another within it (its compute, its
host-to-device bytes over the measured bandwidth, its device-to-host bytes likewise), or the
host AdamW when that is longer. [Note: step phases] The phases do not overlap each other:
paged activations go out while the forward makes them and come back while backward reads
them, so a forward that pages more than its compute hides waits for its copies, and backward
cannot start their way back before it starts (the 7B LoRA on the H200: 18.8 GB out and in
behind 0.1 s of forward and 0.15 s of backward stepped at 0.875 s, the two directions' sum,
where one max over the step predicted 0.47 s and hid paging under compute). Backward is taken
as `backward_per_forward` forwards, as the adapter's compute_s counts it: the median timed
block backward over the median timed forward (each block's backward timed from when its
weights are there to when backward reaches the block below, its recompute's forward and its
waits for paged activations taken off: Adapter.backward_begins, aside_begins), and until
backward is timed, an estimate: one for the input gradients, and the trainable share of the
block's matrices for the weight gradients (a frozen base's LoRA: about 1, where the H200 ran
a 7B LoRA's backward at 1.29 forwards; a full fine-tune: 2). A paged block crosses once in each phase, in the
dtype it computes in; a resident block's trainable weights cross once, in backward (the
update's push). Saved activations of a paged block cross out in forward and in in backward.
Gradients cross out in backward.
[Note: copies in the pipeline] Within a phase, paged activations' copies overlap compute only
as far as the engine lets them run apart, so each phase's compute also counts its waits,
walked block by block (copy_waits): in forward, a block's copy starts with the block, after the
copies queued before it, and the block cannot end while the copies still queued hold more than
the in-flight limit (max_inflight_bytes: the pack hook waits); in backward, a block fetches its
own activations, the weights of the block below and the activations of the `prefetch_depth`
blocks below it as it starts, on the link paged weights share, and computes once its own are
in (the last block keeps its weights from its forward). Adding the link totals alone assumed the copies spread evenly over the
phase: the 14B LoRA on the H100 under a 24 GiB cap, 22 blocks paged in runs of up to ten
between 18 recomputed, was predicted at 635 ms and stepped at 905 ms. The search therefore
also tries the paged blocks spread among the recomputed ones (_spread), where a paged block's
copies hide under its neighbours' compute.
A recomputed block (torch.utils.checkpoint around its forward) keeps only its inputs
(`input_bytes`) from its forward to its backward, moves nothing over PCIe, and runs its
forward once more in backward: its `forward_s` is added to the compute time. When it is
recomputed, its activations are back on the device whole, above what the blocks before it keep,
and its inputs beside them (the checkpoint holds them: counted apart, since a block need not
save its own input, as a bf16 Llama layer saves its norm's fp32 copy instead).

The choice: among the placements that fit, the fastest; of equally fast ones, the one
that pages the fewest blocks' activations, then the fewest blocks' weights. Activation
paging may not add more than `max_activation_slowdown` to the time of the same weight
placement without it; when nothing fits within that limit,
the fastest placement that fits is taken and the plan says so (the alternative is running
out of memory). Blocks are paged from the front of the stack: the first blocks' saved
activations are held the longest (from their forward to the end of backward).

Recomputation (`recompute=True`: activation_offload="auto"): of the first k blocks whose
activations leave the device, each is paged or recomputed; the blocks whose paging costs the
most PCIe time per second of their recompute are recomputed first, and every split of the k
is tried, so the cost model picks per block. A block whose call must not run twice
(`recomputable` False: it carries a key/value cache, or updates running statistics;
engine/recompute_call.py) is paged, as the engine would page it. The limit above counts the
recompute as it counts paging. [Note: settled modes] A block whose mode (paged or recomputed)
a replan on timed forwards chose keeps it when it leaves the device again (`settled`): the times that choice is
then measured under (its waits, its copies) must not undo it, so the plan cannot flip back
and forth between the two from step to step. At equal times, keeping comes first, then
recomputing (no pinned memory, no host work). [Note: recompute before timing] A block whose forward has not been timed yet
(`forward_s` None: the first step) has no recompute cost to weigh: every block leaving the
device is then recomputed where that keeps less than its activations (its inputs are
smaller: `recompute_frees`; the others are paged), since paging's first pass also pins fresh host memory for each
block's activations (far slower than the PCIe copy itself); the replan after the first timed
step decides per block with measured times. Recomputed blocks keep their inputs until
backward (36 x 32 MiB for the 1.9B GPT under a 4 GiB cap): where recomputing every such block
does not fit, the fewest of them are paged instead (a paged block keeps none).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..sizes import GiB

# At most this many placements are walked with the weights' fetches in the pipeline, in the
# order of their keys without them (make_plan): past it, the best walked is taken.
MAX_WALKS = 4096
# Recompute counts tried per number of blocks whose activations leave the device (_splits).
SPLITS = 16

# Backward's compute per forward's where the adapter has not said (PlanInputs.backward_per_forward):
# a matmul's input gradient and its weight gradient, each as much as the forward.
BACKWARD_PER_FORWARD = 2.0


@dataclass
class BlockBytes:
    weight_bytes: int  # on the device while resident
    crossing_bytes: int  # one fetch of the paged weights (the compute dtype's size)
    push_bytes: int  # the trainable weights' copy after each update, when resident
    act_bytes: int = 0  # saved activations of one forward pass, weights resident (measured; 0 when unknown)
    pageable: bool = True  # False: shares a parameter with the outside (tied weights)
    cast_bytes: int = 0  # of act_bytes: autocast's copies of the weights, held while they are resident
    input_bytes: int = 0  # what the block keeps when recomputed: its inputs (measured; 0 when unknown)
    forward_s: float | None = None  # one forward of the block (measured; None before it is timed)
    recomputable: bool = True  # False: a call of it must not run twice (recompute_call.py): paged instead
    backward_bytes: int = 0  # what its backward allocates beside its activations (measured; 0 when unknown)


@dataclass
class PlanInputs:
    blocks: list  # BlockBytes, in stack order
    fixed_bytes: int  # outside weights + transients + correction from measured peaks
    usable_bytes: int  # device memory the run may use (after vram_headroom)
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    adamw_s: float  # host AdamW time of one step
    grad_bytes: int  # gradients copied to the host per step
    outside_push_bytes: int  # the outside modules' updated weights, per step
    compute_s: float = 0.0  # forward + backward (0 when not measured yet)
    backward_per_forward: float = BACKWARD_PER_FORWARD  # how compute_s splits ([Note: step phases])
    max_activation_slowdown: float = 0.15
    prefetch_depth: int = 1
    # Device bytes a forward's activation copies may hold before it waits for them
    # (max_inflight_bytes; None: no limit). [Note: copies in the pipeline]
    inflight_bytes: int | None = None
    weights: str = "auto"  # "auto", or "fixed": keep `fixed_paged` as given
    activations: str = "auto"  # "auto", or "fixed": keep `fixed_act_paged`
    fixed_paged: tuple = ()
    fixed_act_paged: tuple = ()
    recompute: bool = False  # blocks may be recomputed instead of paged (activations "auto" only)
    after_stack_bytes: int = 0  # what the head and the loss add at the end of the forward (measured)
    held_after_stack_bytes: int = 0  # of that, still held when backward reaches the stack (measured)
    # block -> "page" or "recompute": how it leaves the device, if it does, as a replan on timed
    # forwards chose it ([Note: settled modes]); the search decides only the other blocks' modes.
    settled: dict = field(default_factory=dict)


@dataclass
class BlockPlan:
    """The placement the search chose: which blocks page their weights and their activations."""

    paged: list
    act_paged: list
    fits: bool
    device_bytes: int
    step_s: float
    act_slowdown: float  # predicted, of the activation paging chosen
    within_limit: bool  # act_slowdown <= max_activation_slowdown
    terms: dict = field(default_factory=dict)  # the four times of the chosen placement
    recompute: list = field(default_factory=list)  # blocks recomputed in backward (never also in act_paged)
    search_cut: bool = False  # MAX_WALKS reached with pairs not walked that might be faster

    def describe(self, usable: int) -> str:
        t = self.terms
        text = (
            f"{len(self.paged)} blocks' weights paged, {len(self.act_paged)} blocks' activations paged, "
            f"{len(self.recompute)} blocks recomputed; "
            f"device {self.device_bytes / GiB:.2f} of {usable / GiB:.2f} GiB usable; predicted step "
            f"{self.step_s * 1e3:.1f} ms (forward {t['forward'] * 1e3:.1f} then backward {t['backward'] * 1e3:.1f}; "
            f"compute {t['compute'] * 1e3:.1f}, PCIe in {t['h2d'] * 1e3:.1f}, "
            f"out {t['d2h'] * 1e3:.1f}, host AdamW {t['adamw'] * 1e3:.1f})"
        )
        if self.recompute and t.get("recompute"):
            text += f" (recompute {t['recompute'] * 1e3:.1f} of the compute)"
        elif self.recompute:  # [Note: recompute before timing]
            text += " (recompute not timed yet: no cost counted for it)"
        if self.act_paged or self.recompute:
            text += f", activation {'paging' if not self.recompute else 'paging and recompute'} adds {self.act_slowdown:.0%}"
        if self.search_cut:
            text += f" (the best of the first {MAX_WALKS} placements walked: the search was cut there)"
        return text


def activation_peak(inp: PlanInputs, act_paged, recompute=frozenset()) -> int:
    """Device bytes of saved activations at their peak (see the module docstring); autocast's
    copies of resident weights are counted with the weights."""
    b, depth = inp.blocks, inp.prefetch_depth
    kept = fetched = 0  # kept: what the blocks before block i hold until backward reaches them
    # (Plain comparisons, not max(): the search calls this for every activation policy.)
    for i, x in enumerate(b):
        # As block i's backward starts, the engine fetches the paged activations of the
        # `depth` blocks below it ahead, whatever block i's own mode.
        below = 0
        for j in range(i - depth if i > depth else 0, i):
            if j in act_paged:
                below += b[j].act_bytes
        if i in recompute:
            here = kept + x.input_bytes + x.act_bytes - x.cast_bytes + x.backward_bytes + below  # recomputed
            kept += x.input_bytes
        elif i in act_paged:
            here = kept + x.act_bytes + x.backward_bytes + below
        else:
            kept += x.act_bytes - x.cast_bytes
            if not x.backward_bytes and not below:
                continue
            here = kept + x.backward_bytes + below  # its backward, above what it and the blocks before it keep
        if here > fetched:
            fetched = here
    backward = fetched + inp.held_after_stack_bytes if fetched else 0
    return max(kept + inp.after_stack_bytes, backward)


def device_bytes(inp: PlanInputs, paged, act_paged, recompute=()) -> int:
    b = inp.blocks
    need = inp.fixed_bytes
    need += sum(x.weight_bytes + x.cast_bytes for i, x in enumerate(b) if i not in paged)
    if paged:
        need += 2 * max(b[i].crossing_bytes for i in paged)
    return need + activation_peak(inp, set(act_paged), set(recompute))


def paging_s(inp: PlanInputs, x: BlockBytes) -> float:
    """PCIe time of paging one block's activations on the busier link (the order in which
    blocks are recomputed rather than paged: _recompute_first)."""
    return max(x.act_bytes / inp.h2d_bytes_per_s, x.act_bytes / inp.d2h_bytes_per_s)


def paging_cost_s(act_bytes: int, h2d_bytes_per_s: float, d2h_bytes_per_s: float) -> float:
    """What paging a block's activations adds to the step where the links, not compute, set
    each phase's time ([Note: step phases]): out in the forward phase, then in in the backward
    phase, which do not overlap, so the two directions add. Recomputing it instead adds its
    forward_s to the backward phase. The online guard weighs a block with these two, as the
    events of a replan do."""
    return act_bytes / d2h_bytes_per_s + act_bytes / h2d_bytes_per_s


def recompute_frees(x: BlockBytes) -> bool:
    """May the block be recomputed, and does that keep less than keeping its activations? (Not
    when what it saves is its inputs, as a lone Linear's.)"""
    return x.recomputable and x.input_bytes < x.act_bytes - x.cast_bytes


def _recompute_first(inp: PlanInputs, chosen: list) -> list:
    """`chosen` in the order they are recomputed rather than paged: the most PCIe time per
    second of recompute first (stable: the front of the stack first among equals)."""
    b = inp.blocks
    return sorted(chosen, key=lambda i: -paging_s(inp, b[i]) / max(b[i].forward_s or 0.0, 1e-12))


def copy_waits(inp: PlanInputs, act_paged, recompute, paged=()) -> tuple[float, float]:
    """Seconds the forward and the backward wait for copies beyond their compute, block by
    block: paged activations', and paged weights' (`paged`) ([Note: copies in the pipeline])."""
    return _Pipeline(inp).waits(set(act_paged), set(recompute), frozenset(paged))


class _Pipeline:
    """copy_waits' per-block times, taken once for every activation policy the search weighs."""

    def __init__(self, inp: PlanInputs):
        b = inp.blocks
        untimed = inp.compute_s / (1.0 + inp.backward_per_forward) / max(len(b), 1)
        self.forward = [untimed if x.forward_s is None else x.forward_s for x in b]
        self.backward = [f * inp.backward_per_forward for f in self.forward]
        self.out = [x.act_bytes / inp.d2h_bytes_per_s for x in b]
        self.back_in = [x.act_bytes / inp.h2d_bytes_per_s for x in b]
        self.cross = [x.crossing_bytes / inp.h2d_bytes_per_s for x in b]
        # Seconds of copies a forward may have queued before it waits for them.
        self.lead = inp.inflight_bytes / inp.d2h_bytes_per_s if inp.inflight_bytes is not None else float("inf")
        self.depth = inp.prefetch_depth
        self.total_forward = sum(self.forward)
        # The forward's compute after the stack (the head, the loss): the copies still queued
        # run on under it.
        self.after = max(inp.compute_s / (1.0 + inp.backward_per_forward) - self.total_forward, 0.0)

    def waits(self, act_paged: set, recompute: set, paged: frozenset = frozenset()) -> tuple[float, float]:
        """(forward, backward) waits of this placement; `paged`: the blocks whose weights
        stream, whose fetches share the host-to-device link in backward with the activations'."""
        if not act_paged and not paged:
            return 0.0, 0.0
        forward, out, lead, cross = self.forward, self.out, self.lead, self.cross
        n = len(forward)
        # Forward: copies queue on one link, each starting no earlier than its block; a block
        # ends only once the copies still queued hold no more than the in-flight limit. A
        # paged block's weights come in on the other link, fetched as the block before it starts.
        t = link = 0.0
        weights_in = cross[0] if 0 in paged else 0.0
        for i in range(n):
            if i in paged and weights_in > t:
                t = weights_in
            start = t
            if i + 1 in paged:
                weights_in = (weights_in if weights_in > start else start) + cross[i + 1]
            t += forward[i]
            if i in act_paged:
                link = (link if link > start else start) + out[i]
                if link - lead > t:
                    t = link - lead
        t += self.after
        # Backward fetches none before it is out.
        forward_wait = (t if t > link else link) - self.total_forward - self.after
        # Backward: a block's backward fetches its own activations, then the weights of the
        # block below it, then the activations of the `prefetch_depth` blocks below it, on one
        # link; it starts once its weights and its own activations are in.
        back_in, depth = self.back_in, self.depth
        # The last block keeps its weights from its forward to its backward (the engine's
        # _exit_forward): nothing to fetch for it.
        t = work = link = 0.0
        ready, weights_ready = {}, {n - 1: 0.0}
        for i in range(n - 1, -1, -1):
            if i in act_paged and i not in ready:
                link = (link if link > t else t) + back_in[i]
                ready[i] = link
            if i - 1 in paged:
                link = (link if link > t else t) + cross[i - 1]
                weights_ready[i - 1] = link
            for j in range(i - 1, i - depth - 1 if i > depth else -1, -1):
                if j in act_paged and j not in ready:
                    link = (link if link > t else t) + back_in[j]
                    ready[j] = link
            own = self.backward[i] + (forward[i] if i in recompute else 0.0)
            work += own
            if i in paged and weights_ready[i] > t:
                t = weights_ready[i]
            if i in act_paged and ready[i] > t:
                t = ready[i]
            t += own
        return forward_wait, t - work


def phase_terms(
    inp: PlanInputs,
    weights_once: int,
    weights_in: int,
    acts_moved: int,
    recompute_s: float,
    waits: tuple = (0.0, 0.0),
) -> dict:
    """The times of a placement ([Note: step phases]): `weights_once`, one fetch of every paged
    block's weights (the forward's); `weights_in`, every weight byte in per step (fetches and
    pushes); `acts_moved`, the paged activations' bytes each way; `recompute_s`, the recomputed
    forwards; `waits`, the placement's copy_waits. "step" is what make_plan weighs; the totals
    per link are for the reader."""
    h2d, d2h = inp.h2d_bytes_per_s, inp.d2h_bytes_per_s
    forward_compute = inp.compute_s / (1.0 + inp.backward_per_forward)
    forward = max(forward_compute + waits[0], weights_once / h2d, acts_moved / d2h)
    backward = max(
        inp.compute_s - forward_compute + recompute_s + waits[1],
        (weights_in - weights_once + acts_moved) / h2d,
        inp.grad_bytes / d2h,
    )
    return {
        "compute": inp.compute_s + recompute_s,
        "h2d": (weights_in + acts_moved) / h2d,
        "d2h": (inp.grad_bytes + acts_moved) / d2h,
        "adamw": inp.adamw_s,
        "recompute": recompute_s,
        "forward": forward,
        "backward": backward,
        "step": max(forward + backward, inp.adamw_s),
    }


def placement_terms(inp: PlanInputs, paged, act_paged, recompute, pipeline=None) -> dict:
    """phase_terms of one placement: these blocks' weights paged, these blocks' activations
    paged, these blocks recomputed (what the events compare a plan with)."""
    b = inp.blocks
    once = sum(b[i].crossing_bytes for i in paged)
    pushes = inp.outside_push_bytes + sum(x.push_bytes for i, x in enumerate(b) if i not in paged)
    acts = sum(b[i].act_bytes for i in act_paged)
    recompute_s = sum(b[i].forward_s or 0.0 for i in recompute)
    waits = (pipeline or _Pipeline(inp)).waits(set(act_paged), set(recompute), frozenset(paged))
    return phase_terms(inp, once, pushes + 2 * once, acts, recompute_s, waits)


class _ActOption:
    """One activation policy: the blocks paged and the blocks recomputed (the rest kept)."""

    def __init__(self, inp: PlanInputs, paged: list, recompute: list, untimed_paged: int = 0):
        b = inp.blocks
        self.chosen, self.recompute = sorted(paged), sorted(recompute)
        # Blocks paged before any forward is timed that recomputing would free memory for: only
        # where recomputing them does not fit ([Note: recompute before timing]), so fewest first.
        self.untimed_paged = untimed_paged
        self.moved = sum(b[i].act_bytes for i in paged)  # PCIe bytes each way per step
        self.compute = sum(b[i].forward_s or 0.0 for i in recompute)  # forward time added in backward
        self.peak = activation_peak(inp, set(paged), set(recompute))
        self._waits = None

    def waits(self, pipeline: _Pipeline) -> tuple[float, float]:
        if self._waits is None:
            self._waits = pipeline.waits(set(self.chosen), set(self.recompute))
        return self._waits


def _act_options(inp: PlanInputs) -> list:
    """The activation policies to try (see the module docstring)."""
    if inp.activations == "fixed":
        return [_ActOption(inp, list(inp.fixed_act_paged), [])]
    n, options = len(inp.blocks), []
    untimed = any(x.forward_s is None for x in inp.blocks)
    for k in range(n + 1):
        leaving = list(range(k))
        if not inp.recompute:
            options.append(_ActOption(inp, leaving, []))
            continue
        if untimed:  # [Note: recompute before timing]
            frees = _recompute_first(inp, [i for i in leaving if recompute_frees(inp.blocks[i])])
            others = [i for i in leaving if i not in frees]
            options.extend(
                _ActOption(inp, others + frees[r:], frees[:r], len(frees) - r) for r in reversed(_splits(len(frees)))
            )
            continue
        # A block that must not be recomputed is paged, as the engine would page it anyway.
        held = {**inp.settled, **{i: "page" for i, x in enumerate(inp.blocks) if not x.recomputable}}
        paged = [i for i in leaving if held.get(i) == "page"]
        recomputed = [i for i in leaving if held.get(i) == "recompute"]
        free = [i for i in _recompute_first(inp, leaving) if i not in held]
        for r in _splits(len(free)):
            options.append(_ActOption(inp, paged + free[r:], recomputed + free[:r]))
            spread = _spread(sorted(free), len(free) - r)
            if 0 < r < len(free) and set(spread) != set(free[r:]):
                options.append(_ActOption(inp, paged + spread, recomputed + [i for i in free if i not in spread]))
    return options


def _splits(m: int) -> list:
    """How many of `m` blocks free to choose are recomputed, in the policies tried: every
    count up to SPLITS, past that SPLITS + 1 counts evenly apart (a step of a few blocks'
    recompute: the search over every count of every prefix grows as the square of the stack
    and is walked block by block, seconds on an 80-block stack)."""
    if m <= SPLITS:
        return list(range(m + 1))
    return sorted({round(j * m / SPLITS) for j in range(SPLITS + 1)})


def _spread(blocks: list, m: int) -> list:
    """`m` of `blocks` (in stack order), as evenly apart as they go from the first: a paged
    block below a recomputed one has its activations fetched while that one recomputes and
    runs its backward."""
    if m <= 0:
        return []
    return sorted({blocks[j * len(blocks) // m] for j in range(m)})


class _Option:
    """One set of paged blocks (weights or activations) with the sums a placement needs."""

    def __init__(self, blocks: list, chosen: list, moved, size=None, crossing=None):
        self.chosen = chosen
        self.moved = sum(moved(blocks[i]) for i in chosen)  # PCIe bytes added per step
        # Weights only (activations are counted at their peak by activation_peak):
        self.freed = sum(size(blocks[i]) for i in chosen) if size else 0  # device bytes no longer held
        self.in_flight = max((crossing(blocks[i]) for i in chosen), default=0) if crossing else 0
        self.crossing_once = sum(crossing(blocks[i]) for i in chosen) if crossing else 0  # one fetch of each


def _options(blocks: list, fixed, mode: str, order: list, moved, size=None, crossing=None) -> list:
    if mode == "fixed":
        return [_Option(blocks, sorted(fixed), moved, size, crossing)]
    return [_Option(blocks, order[:k], moved, size, crossing) for k in range(len(order) + 1)]


def make_plan(inp: PlanInputs) -> BlockPlan:
    """The fastest placement that fits (see the module docstring); `fits` is False when
    none does, and the plan is then the one that needs the least device memory."""
    b = inp.blocks
    pageable = [i for i, x in enumerate(b) if x.pageable]
    # A paged block's weights cross twice instead of being pushed once after the update.
    weight_opts = _options(
        b,
        inp.fixed_paged,
        inp.weights,
        pageable,
        lambda x: 2 * x.crossing_bytes - x.push_bytes,
        size=lambda x: x.weight_bytes + x.cast_bytes,
        crossing=lambda x: x.crossing_bytes,
    )
    act_opts = _act_options(inp)  # each with its peak, once per option, not per pair
    all_weights = sum(x.weight_bytes + x.cast_bytes for x in b)
    h2d_resident = inp.outside_push_bytes + sum(x.push_bytes for x in b)
    h2d_rate, d2h_rate, limit = inp.h2d_bytes_per_s, inp.d2h_bytes_per_s, inp.max_activation_slowdown + 1e-9
    grads_out = inp.grad_bytes / d2h_rate
    # [Note: step phases]: the forward's compute and the backward's, recompute not included.
    forward_compute = inp.compute_s / (1.0 + inp.backward_per_forward)
    backward_compute = inp.compute_s - forward_compute
    pipeline = _Pipeline(inp)

    def times(a):
        """What the pair loop adds up for an activation policy (kept to plain floats: the loop
        runs over every pair): backward's compute, the forward with its copies out, the
        copies in."""
        wait_forward, wait_backward = a.waits(pipeline)
        return (
            backward_compute + a.compute + wait_backward,
            max(a.moved / d2h_rate, forward_compute + wait_forward),
            a.moved / h2d_rate,
        )

    # A policy that fits under no weight placement is only ever the smallest (when nothing
    # fits): its waits are not walked.
    helds = [inp.fixed_bytes + all_weights - w.freed + 2 * w.in_flight for w in weight_opts]
    room = inp.usable_bytes - min(helds)
    acts = [(a, a.peak, *times(a), len(a.chosen)) for a in act_opts if a.peak <= room]
    # Every pair that fits, keyed by its times without the weights' fetches in the pipeline:
    # a lower bound of its key with them (they only add waits), so the search walks pairs in
    # that order and stops where the bound passes the best walked ([Note: copies in the pipeline]).
    candidates = []
    for wi, (w, held) in enumerate(zip(weight_opts, helds)):
        # The paged weights come in once for the forward; the rest (again, and the pushes) in backward.
        weights_in_forward = w.crossing_once / h2d_rate
        weights_in_backward = (h2d_resident + w.moved - w.crossing_once) / h2d_rate
        # Without recompute or activation paging: the same weight placement keeping every
        # activation (its weights' fetches walked: the base of both keys below).
        base_forward = max(forward_compute, weights_in_forward)
        base = placement_terms(inp, w.chosen, [], [], pipeline)["step"]
        n_paged = len(w.chosen)
        for ai, (a, peak, compute, out_s, in_s, n_acts) in enumerate(acts):
            need = held + peak
            if need > inp.usable_bytes:
                continue
            forward = base_forward if out_s <= base_forward else out_s
            backward = max(compute, weights_in_backward + in_s, grads_out)
            step = max(forward + backward, inp.adamw_s)
            slowdown = step / base - 1.0 if base > 0 else 0.0
            within = slowdown <= limit
            # Within the slowdown limit first; then, before any forward is timed, fewer blocks
            # paged that recomputing would free; then faster (to 0.1 ms); then fewer blocks'
            # activations moved off the device (kept first), and of those fewer paged (their
            # copies cost host work and pinned memory the model does not count, where weights
            # paged in bf16 under autocast cost none); then fewer blocks' weights paged.
            key = (not within, a.untimed_paged, round(step * 1e3, 1), n_acts + len(a.recompute), n_acts, n_paged)
            candidates.append((key, len(candidates), need, wi, ai, base))
    heapq.heapify(candidates)
    best, best_key = None, None
    for _ in range(min(len(candidates), MAX_WALKS)):
        key, _, need, wi, ai, base = heapq.heappop(candidates)
        if best_key is not None and key >= best_key:
            break
        w, a = weight_opts[wi], acts[ai][0]
        waits = pipeline.waits(set(a.chosen), set(a.recompute), frozenset(w.chosen))
        terms = phase_terms(inp, w.crossing_once, h2d_resident + w.moved, a.moved, a.compute, waits)
        step = terms["step"]
        slowdown = step / base - 1.0 if base > 0 else 0.0
        key = (slowdown > limit, key[1], round(step * 1e3, 1), *key[3:])
        if best_key is None or key < best_key:
            best_key = key
            best = BlockPlan(w.chosen, a.chosen, True, need, step, slowdown, slowdown <= limit, terms, a.recompute)
    if best is not None:
        # Walks left over with a bound below the best walked: the best of those walked is taken.
        best.search_cut = bool(candidates) and candidates[0][0] < best_key
        return best
    # Nothing fits: the placement that needs the least (the first such, in the search's order).
    held, w = min(zip(helds, weight_opts), key=lambda pair: pair[0])
    a = min(act_opts, key=lambda option: option.peak)
    waits = pipeline.waits(set(a.chosen), set(a.recompute), frozenset(w.chosen))
    terms = phase_terms(inp, w.crossing_once, h2d_resident + w.moved, a.moved, a.compute, waits)
    base = placement_terms(inp, w.chosen, [], [], pipeline)["step"]
    slowdown = terms["step"] / base - 1.0 if base > 0 else 0.0
    return BlockPlan(
        list(w.chosen),
        list(a.chosen),
        False,
        held + a.peak,
        terms["step"],
        slowdown,
        slowdown <= limit,
        terms,
        list(a.recompute),
    )
