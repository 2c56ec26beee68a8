"""optimizer_mode="gpu": where the AdamW moments live, and how they reach the kernel.

The moments stay in host memory (pinned on a GPU). Each unit's params are cut into groups
of at most `limit` bytes of moments, in order, and each group's moments fill one contiguous
region of the host arena. Before the kernel updates a group, the region is copied to VRAM
in one copy on the moments-in stream; after the kernel, it is copied back on the
moments-out stream. The copy engines move both directions at once at the PCIe rate.

The kernel could also read and write mapped host memory itself, without copies. In a
diagnostic run on the H200 (the same kernel both ways, same bits), mapping reached 40 GB/s
each way and the staged copies 44.6 to 47.6 GB/s; 48.2 is the two-way copy rate. Beside a
busy GPU, 402M params took 100.6 ms staged against 104.1 ms mapped, and 1.9B params 325 ms
against 377 ms.

A region is staged only where, when its update is queued, its VRAM copy fits under the
process's peak so far (the caching allocator's counter) and, with the other transfers in
flight, under max_inflight_bytes: staging is not to raise the peak the planner and the user
see. At the start of backward, before activations are freed, the kernel maps the first
units' moments instead (staged regardless, the 402M MLP's peak rose by 32 MB, 1.3%, on the
H200). A param whose moments alone exceed `limit` gets a region of its own, still copied
up to twice `limit` (half the cap: a Llama-7B MLP matrix, 360 MB, under the default 1 GiB)
with less overlap; beyond that it always stays mapped: the kernel reads and writes its
moments over PCIe. Copying such a param in slices would need the element offset of each
slice in both AdamW kernels (bf16 moments' stochastic rounding hashes the element index).
On the CPU backend the "device" copy is a second host buffer, so CI runs the layout, the
offsets and the copies.
"""
from __future__ import annotations

import torch

from .device import HostArena


class MomentRegion:
    """One group's moments: a contiguous host region and where each param's two moments
    sit in it (byte offsets), as `views` of any buffer laid out like it."""
    __slots__ = ("host", "layout", "staged", "last")

    def __init__(self, host: torch.Tensor, layout: list, staged: bool):
        self.host = host        # uint8, the group's bytes in the arena
        self.layout = layout    # [(param, exp_avg offset, exp_avg_sq offset, dtype)]
        self.staged = staged    # small enough to be copied to VRAM for each update (else mapped)
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
        for p, m_at, v_at, dtype in self.layout:
            n = p.numel() * dtype.itemsize
            out[p] = (buf[m_at:m_at + n].view(dtype).view(p.shape), buf[v_at:v_at + n].view(dtype).view(p.shape))
        return out


def region_limit(max_inflight_bytes: int) -> int:
    """The largest region of several params (one param alone may take up to twice this,
    see lay_out): a quarter of the in-flight cap, which also counts the gradients each
    update holds until its kernel has run. Then, as a rule, two units' regions are in VRAM
    at once, one unit's coming in while the other's go home. With half the cap, a 1.9B GPT's
    blocks went one at a time under the default cap, each PCIe direction idle in turn."""
    return max_inflight_bytes // 4


def lay_out(units, moment_dtype: torch.dtype, limit: int, take) -> list:
    """The moment regions of every trainable param of `units`, carved by `take(shape, dtype)`
    from the host arena: each unit's params in order, a new region whenever the next param
    would take the current one past `limit` bytes. Regions up to twice `limit` (one param
    alone) are copied for the update; larger ones are mapped."""
    regions = []

    def close(group, nbytes):
        host = take((nbytes,), torch.uint8)
        layout, at = [], 0
        for p in group:
            size = HostArena.size_of(p.numel(), moment_dtype)
            layout.append((p, at, at + size, moment_dtype))
            at += 2 * size
        regions.append(MomentRegion(host, layout, staged=nbytes <= 2 * limit))

    for unit in units:
        group, nbytes = [], 0
        for s in unit.trainable:
            size = 2 * HostArena.size_of(s.param.numel(), moment_dtype)
            if group and nbytes + size > limit:
                close(group, nbytes)
                group, nbytes = [], 0
            group.append(s.param)
            nbytes += size
        if group:
            close(group, nbytes)
    return regions


class Staged:
    """What stage_in() hands the kernel: where to read each param's moments, the VRAM
    copies to send back after it, and the regions it maps."""
    __slots__ = ("moments", "copies", "mapped")

    def __init__(self):
        self.moments: dict = {}   # param -> (exp_avg, exp_avg_sq), in VRAM or mapped host memory
        self.copies: list = []    # (region, its VRAM copy)
        self.mapped: list = []    # regions the kernel reads and writes in host memory


class MomentStager:
    def __init__(self, engine, regions: list):
        self.engine = engine
        self.region_of = {p: r for r in regions for p, *_ in r.layout}
        self.copies = self.mapped = 0  # regions staged, and left mapped for want of room, so far

    def room(self) -> int | None:
        """VRAM this process may take without passing its peak so far (None: no limit, the
        CPU backend)."""
        backend = self.engine.backend
        if not backend.is_cuda:
            return None
        counters = backend.allocated()
        return counters["peak"] - counters["current"]

    def _fits(self, region, held: int) -> bool:
        """Whether to copy `region` in, `held` bytes being already staged for this update:
        the copy must fit under the VRAM peak so far (the counters already include what is
        held) and, once older regions have come home (the host waits), under
        max_inflight_bytes with everything else in flight. The unit's own gradients, in
        VRAM whatever is decided here, join the ledger after the kernel."""
        engine = self.engine
        cap = engine.max_inflight_bytes
        if held + region.nbytes > cap:
            return False  # more than the cap allows even with nothing else in flight
        room = self.room()
        if room is not None and region.nbytes > room:
            return False  # checked first: waiting for the ledger frees no allocated bytes
        engine.inflight.make_room(region.nbytes, cap, held)
        return True

    def stage_in(self, params, stream) -> Staged:
        """Copy the regions holding `params`' moments to VRAM and order `stream` (the
        kernel's) after the copies and after each mapped region's last device work. The
        buffers come from compute's pool (the allocator reuses memory per stream: there, the
        activations backward frees back them, and the peak check means what it says), so
        the copies first follow compute."""
        engine, backend = self.engine, self.engine.backend
        staged, held = Staged(), 0
        for region in dict.fromkeys(self.region_of[p] for p in params):
            fits = region.staged and self._fits(region, held)
            self.mapped += region.staged and not fits
            if not fits:
                backend.wait(region.last, stream)
                staged.mapped.append(region)
                staged.moments.update(region.views(region.host))
                continue
            if not staged.copies:
                backend.follow_compute(backend.moments_in)
            self.copies += 1
            held += region.nbytes
            buf = torch.empty(region.nbytes, dtype=torch.uint8, device=backend.device)
            backend.wait(region.last, backend.moments_in)
            with backend.on(backend.moments_in):
                buf.copy_(region.host, non_blocking=True)
            backend.keep_until(buf, backend.moments_in)  # even if the update is never queued
            staged.copies.append((region, buf))
            staged.moments.update(region.views(buf))
        if staged.copies:
            backend.wait(backend.record(backend.moments_in), stream)
        return staged

    def send_home(self, staged: Staged, kernel_done):
        """Copy the updated regions back once the kernel (`kernel_done`, an event) is past
        them, and mark each region's last device work. Returns the event of the copies'
        arrival (None if nothing was staged)."""
        for region in staged.mapped:
            region.last = kernel_done
        if not staged.copies:
            return None
        engine, backend = self.engine, self.engine.backend
        out = backend.moments_out
        backend.wait(kernel_done, out)
        with backend.on(out):
            for region, buf in staged.copies:
                region.host.copy_(buf, non_blocking=True)
        home = backend.record(out)
        for region, buf in staged.copies:
            region.last = home
            for stream in (backend.update, out):  # the kernel's and the copy home's uses
                backend.keep_until(buf, stream)   # (stage_in kept it for the copy in)
            engine.inflight.add(home, region.nbytes)
        return home
