"""optimizer_mode="gpu": where the AdamW moments live, and how they reach the kernel.

The moments stay in host memory (pinned on a GPU). Each unit's params are cut into groups
of at most region_limit bytes of moments, in order, and each group's moments fill one
contiguous region of the host arena. Each region gets its own kernel: the region is copied
to VRAM in one copy on the moments-in stream, the kernel updates it, and it is copied back
on the moments-out stream, while the next region's copy in runs. The copy engines move both
directions at once at the PCIe rate.

The kernel can also read and write mapped host memory itself, without copies, with the
same bits; the copy engines reach more of the link than the kernel's own reads and writes
do, so mapping is the fallback.

A region is copied only where, when its update is queued, its VRAM copy fits under the
process's peak so far (the caching allocator's counter): staging is not to raise the peak
the planner and the user see. At the start of backward, before activations are freed, the
kernel maps the first units' moments instead. Under max_inflight_bytes the host waits for older transfers
to come home before it queues the copy. A param whose moments alone exceed region_limit
gets a region of its own, still copied up to copy_limit with less overlap; beyond that it
always stays mapped: the kernel reads and writes its moments over PCIe. Copying such a
param in slices would need regions of two host ranges (its exp_avg and its exp_avg_sq each
stay whole for the optimizer's state), one step count per param rather than per slice and,
with bf16 moments, the element offset of each slice in both AdamW kernels (stochastic
rounding hashes the element index).
On the CPU backend the "device" copy is a second host buffer, so CI runs the layout, the
offsets and the copies.
"""

from __future__ import annotations

import math

import torch

from .device import HostArena


def moment_shape(s) -> tuple:
    """The shape of slot `s`'s moments: the param's, or under data parallel the 1-D shard this
    rank updates (distributed.py, [Note: shards])."""
    if s.shard is None:
        return tuple(s.param.shape)
    lo, hi = s.shard
    return (hi - lo,)


class MomentRegion:
    """One group's moments: a contiguous host region and where each param's two moments
    sit in it (byte offsets), as `views` of any buffer laid out like it."""

    __slots__ = ("host", "layout", "staged", "last")

    def __init__(self, host: torch.Tensor, layout: list, staged: bool):
        self.host = host  # uint8, the group's bytes in the arena
        self.layout = layout  # [(param, exp_avg offset, exp_avg_sq offset, dtype, moment shape)]
        self.staged = staged  # small enough to be copied to VRAM for each update (else mapped)
        # The end of the last device work on the host bytes (an event; None: none yet): the
        # copy home if the last update was staged, the kernel if it mapped them. The next
        # update, either way, waits for it on the GPU: a region can go one way in one step
        # and the other in the next (room under the peak varies), and without the wait a
        # late copy home would overwrite a mapped kernel's update, or a copy in would read
        # moments a mapped kernel has not written yet.
        self.last = None

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def views(self, buf: torch.Tensor) -> dict:
        """param -> (exp_avg, exp_avg_sq) as views of `buf`, a buffer laid out like the host
        region (the region itself, or its copy in VRAM)."""
        out = {}
        for p, m_at, v_at, dtype, shape in self.layout:
            n = math.prod(shape) * dtype.itemsize
            out[p] = (buf[m_at : m_at + n].view(dtype).view(shape), buf[v_at : v_at + n].view(dtype).view(shape))
        return out


def region_limit(max_inflight_bytes: int) -> int:
    """The largest region of several params: an eighth of the in-flight cap. Each region
    has its own kernel between its copy in and its copy home, so with both PCIe directions
    busy it holds VRAM for about two copy times; a few regions in flight then keep both
    directions busy, beside the gradients the cap also counts."""
    return max_inflight_bytes // 8


def copy_limit(max_inflight_bytes: int) -> int:
    """The largest region copied to VRAM for its update (a single param's, larger than
    region_limit): half the in-flight cap, a Llama-7B MLP matrix (360 MB) under the default
    1 GiB. Larger ones are mapped."""
    return max_inflight_bytes // 2


def lay_out(units, moment_dtype: torch.dtype, region_bytes: int, copy_bytes: int, take) -> list:
    """The moment regions of every trainable param of `units` (of its shard, under data
    parallel: moment_shape), carved by `take(shape, dtype)` from the host arena: each unit's
    params in order, a new region whenever the next param would take the current one past
    `region_bytes` (region_limit). Regions up to `copy_bytes` (copy_limit) are copied for the
    update; larger ones are mapped."""
    regions = []

    def close(group, nbytes):
        host = take((nbytes,), torch.uint8)
        layout, at = [], 0
        for s in group:
            shape = moment_shape(s)
            size = HostArena.size_of(math.prod(shape), moment_dtype)
            layout.append((s.param, at, at + size, moment_dtype, shape))
            at += 2 * size
        regions.append(MomentRegion(host, layout, staged=nbytes <= copy_bytes))

    for unit in units:
        group, nbytes = [], 0
        for s in unit.trainable:
            size = 2 * HostArena.size_of(math.prod(moment_shape(s)), moment_dtype)
            if group and nbytes + size > region_bytes:
                close(group, nbytes)
                group, nbytes = [], 0
            group.append(s)
            nbytes += size
        if group:
            close(group, nbytes)
    return regions


class Staged:
    """What stage_in() hands the kernel: where to read each param of one region's moments,
    and the region's VRAM copy to send back after it (None: the kernel maps the region)."""

    __slots__ = ("region", "moments", "copy")

    def __init__(self, region, moments: dict, copy):
        self.region = region
        self.moments = moments  # param -> (exp_avg, exp_avg_sq), in VRAM or mapped host memory
        self.copy = copy  # uint8 VRAM buffer laid out like region.host, or None


class MomentStager:
    """Owns the moment regions and each update's copies of them (optimizer_mode="gpu")."""

    def __init__(self, backend, ledger, regions: list):
        self.backend = backend
        self.ledger = ledger
        self.region_of = {p: r for r in regions for p, *_ in r.layout}
        self.copies = self.mapped = 0  # regions staged, and left mapped for want of room, so far

    def views(self) -> dict:
        """param -> (exp_avg, exp_avg_sq) in the host regions: the optimizer's state
        (StreamedAdamW.pin_state)."""
        out = {}
        for region in dict.fromkeys(self.region_of.values()):
            out.update(region.views(region.host))
        return out

    def by_region(self, slots) -> list:
        """`slots` grouped by the region holding their moments, in the order they come: one
        kernel each."""
        groups = {}
        for s in slots:
            groups.setdefault(self.region_of[s.param], []).append(s)
        return list(groups.values())

    def room(self) -> int | None:
        """VRAM this process may take without passing its peak so far (None: no limit, the
        CPU backend)."""
        backend = self.backend
        if not backend.is_cuda:
            return None
        counters = backend.allocated()
        return counters["peak"] - counters["current"]

    def _fits(self, region) -> bool:
        """Whether to copy `region` in: the copy must fit under the VRAM peak so far, and
        then, once older transfers have come home (the host waits for them, oldest first),
        under max_inflight_bytes with everything else in flight."""
        room = self.room()
        if room is not None and region.nbytes > room:
            return False  # checked first: waiting for the ledger frees no allocated bytes
        self.ledger.make_room(region.nbytes)
        return True

    def stage_in(self, params, stream) -> Staged:
        """Bring the moments of `params` (one region's) to the kernel on `stream`: copied to
        VRAM on the moments-in stream, `stream` ordered after the copy; or mapped, `stream`
        ordered after the region's last device work. The buffer comes from compute's pool
        (the allocator reuses memory per stream: there, the activations backward frees back
        it, and the peak check means what it says), so the copy first follows compute."""
        backend = self.backend
        regions = {self.region_of[p] for p in params}
        if len(regions) != 1:
            raise ValueError("trainstream internal: stage_in takes one region's params (by_region)")
        region = regions.pop()
        fits = region.staged and self._fits(region)
        self.mapped += region.staged and not fits
        if not fits:
            backend.wait(region.last, stream)
            return Staged(region, region.views(region.host), None)
        self.copies += 1
        buf = torch.empty(region.nbytes, dtype=torch.uint8, device=backend.device)
        backend.follow_compute(backend.moments_in)
        backend.wait(region.last, backend.moments_in)
        with backend.on(backend.moments_in):
            buf.copy_(region.host, non_blocking=True)
        backend.keep_until(buf, backend.moments_in)  # even if the update is never queued
        backend.wait(backend.record(backend.moments_in), stream)
        return Staged(region, region.views(buf), buf)

    def send_home(self, staged: Staged, kernel_done):
        """Copy the updated region back once the kernel (`kernel_done`, an event) is past
        it, and mark the region's last device work. Returns the event of the copy's arrival
        (None if the region was mapped)."""
        region = staged.region
        if staged.copy is None:
            region.last = kernel_done
            return None
        backend = self.backend
        out = backend.moments_out
        backend.wait(kernel_done, out)
        with backend.on(out):
            region.host.copy_(staged.copy, non_blocking=True)
        home = region.last = backend.record(out)
        for stream in (backend.update, out):  # the kernel's and the copy home's uses
            backend.keep_until(staged.copy, stream)  # (stage_in kept it for the copy in)
        self.ledger.add(home, region.nbytes)
        return home
