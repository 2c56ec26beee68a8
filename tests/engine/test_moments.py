"""optimizer_mode="gpu": the moments cut into regions, copied to VRAM and home around each
update or mapped by the kernel, and the order of copies and kernels."""

import pytest
import torch
from helpers import GPU_MODE, PAGED, RESIDENT, assert_same_bits, train
from models import tiny_mlp

import trainstream


def test_gpu_mode_stages_moments_in_regions_of_an_eighth_of_the_inflight_cap():
    """Each unit's moments are cut, in order, into regions of at most max_inflight_bytes / 8
    that go to VRAM and back around each update (on the CPU backend into a second host
    buffer: a region not copied back, or a param read at another's offset, changes the
    bits); a param whose moments alone exceed that has its own region, copied up to half
    the cap and mapped for the kernel beyond."""
    cap = 240_000  # tiny_gpt: a block's norms share a region, qkv (98 KB) is copied alone, fc and out (131 KB) mapped
    host = train("gpt", RESIDENT, steps=4)
    device = train("gpt", dict(RESIDENT, **GPU_MODE, max_inflight_bytes=cap), steps=4)
    assert_same_bits(host, device)
    engine = device[2][0]._trainstream_engine
    regions = list(dict.fromkeys(engine.moments.region_of.values()))
    assert all(r.staged == (r.nbytes <= cap // 2) for r in regions)
    assert all(len(r.layout) == 1 for r in regions if r.nbytes > cap // 8)
    assert any(r.staged and r.nbytes > cap // 8 for r in regions)
    assert max(len(r.layout) for r in regions if r.staged) > 1 and any(not r.staged for r in regions)
    order = [s.param for u in engine.units for s in u.trainable]
    assert [p for r in regions for p, *_ in r.layout] == order  # each unit's params, in order
    for r in regions:  # a region never spans two units
        assert (
            len({next(u.name for u in engine.units if any(s.param is p for s in u.trainable)) for p, *_ in r.layout})
            == 1
        )
    assert engine.moments.copies == 4 * sum(r.staged for r in regions) and engine.moments.mapped == 0
    assert trainstream.memory_report(device[2][0])["plan"]["moment_copies"] == {
        "regions": len(regions),
        "regions_too_large_to_copy": sum(not r.staged for r in regions),
        "copied": engine.moments.copies,
        "mapped_for_want_of_room": 0,
    }
    assert trainstream.memory_report(host[2][0])["plan"]["moment_copies"] is None


def test_gpu_mode_runs_one_kernel_per_region_between_its_copies(monkeypatch):
    """Each region's kernel comes after its own copy in and before its copy home, and the
    next region's copy in comes after this one's kernel: a unit's regions are never all
    held in VRAM at once waiting for one kernel."""
    from trainstream.engine.moments import MomentStager
    from trainstream.engine.optimizer import StreamedAdamW

    calls = []
    stage_in, send_home, kernel = MomentStager.stage_in, MomentStager.send_home, StreamedAdamW.queue_on_device

    def record(name, fn, region_of):
        def wrapped(self, *args, **kwargs):
            calls.append((name, region_of(self, *args)))
            return fn(self, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        MomentStager,
        "stage_in",
        record("in", stage_in, lambda self, params, stream: {id(self.region_of[p]) for p in params}),
    )
    monkeypatch.setattr(
        MomentStager, "send_home", record("home", send_home, lambda self, staged, done: {id(staged.region)})
    )
    monkeypatch.setattr(
        StreamedAdamW,
        "queue_on_device",
        record("kernel", kernel, lambda self, device, slots, *rest: {id(s.param) for s in slots}),
    )
    device = train("gpt", dict(RESIDENT, **GPU_MODE, max_inflight_bytes=240_000), steps=2)
    stager = device[2][0]._trainstream_engine.moments
    params_of = {id(r): {id(p) for p, *_ in r.layout} for r in stager.region_of.values()}
    names = [name for name, _ in calls]
    assert names == ["in", "kernel", "home"] * (2 * len(params_of))  # every region, each step
    for (_, into), (_, kernel_params), (_, home) in zip(calls[::3], calls[1::3], calls[2::3]):
        assert len(into) == 1 and into == home and kernel_params == params_of[next(iter(into))]


def test_gpu_mode_maps_the_moments_a_copy_would_raise_the_peak_for(monkeypatch):
    """No room under the peak so far: every region stays in host memory for the kernel to
    map, with the same bits."""
    _moment_room(monkeypatch, lambda self: 0)
    host = train("gpt", RESIDENT, steps=3)
    device = train("gpt", dict(RESIDENT, **GPU_MODE), steps=3)
    assert_same_bits(host, device)
    stager = device[2][0]._trainstream_engine.moments
    assert stager.copies == 0 and stager.mapped == 3 * len(set(stager.region_of.values()))


def _moment_room(monkeypatch, room) -> None:
    """Set what MomentStager sees as room under the VRAM peak: `room(stager)` -> bytes or
    None (no limit). With tiny activations the real peak leaves too little to copy the
    moments in, and these tests are about the copies."""
    from trainstream.engine.moments import MomentStager

    monkeypatch.setattr(MomentStager, "room", room)


@pytest.mark.gpu
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("copied", [True, False], ids=["copied", "mapped"])
def test_gpu_mode_synchronization_stress(base, copied, monkeypatch):
    """gpu mode, tiny compute, each layer's moments (34 MB) copied to VRAM and home around
    its update, or mapped by the kernel: the bits of the host AdamW."""
    _moment_room(monkeypatch, lambda self: None if copied else 0)
    factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)  # noqa: E731
    host = train("mlp", base, device="cuda", steps=8, lr=1e-3, model_factory=factory)
    device = train("mlp", dict(base, **GPU_MODE), device="cuda", steps=8, lr=1e-3, model_factory=factory)
    assert_same_bits(host, device)
    stager = device[2][0]._trainstream_engine.moments
    assert (stager.copies > 0, stager.mapped > 0) == (copied, not copied)


def _staged(stager) -> int:
    """The regions of `stager` copied to VRAM when there is room."""
    return sum(r.staged for r in set(stager.region_of.values()))


@pytest.mark.gpu
def test_gpu_mode_regions_switching_between_copied_and_mapped_keep_their_order(monkeypatch):
    """Steps that copy the moments in, copy them in again, then map them (room under the
    peak varies), every copy home held back on the GPU: the next update, copied or mapped,
    must wait for the region's last copy home, or it reads stale moments, or the late copy
    lands on top of a mapped kernel's update. (Mapped, then copied, is also ordered by the
    next forward's wait for the kernel.)"""
    from trainstream.engine.moments import MomentStager

    delay = int(1e8)  # GPU cycles, tens of milliseconds: longer than a step of this model
    send_home = MomentStager.send_home

    def late_copy_home(self, staged, kernel_done):
        if staged.copy is not None:
            with torch.cuda.stream(self.backend.moments_out):
                torch.cuda._sleep(delay)  # no wait added here: send_home orders the copy itself
        return send_home(self, staged, kernel_done)

    factory = lambda: tiny_mlp(layers=6, dim=2048, rows=2)  # noqa: E731
    host = train("mlp", RESIDENT, device="cuda", steps=9, lr=1e-3, model_factory=factory)
    # No room under the peak on every third step: each staged region asks once per step, so
    # the regions decided so far count the steps.
    _moment_room(monkeypatch, lambda self: 0 if (self.copies + self.mapped) // _staged(self) % 3 == 2 else None)
    monkeypatch.setattr(MomentStager, "send_home", late_copy_home)
    device = train("mlp", dict(RESIDENT, **GPU_MODE), device="cuda", steps=9, lr=1e-3, model_factory=factory)
    assert_same_bits(host, device)
    stager = device[2][0]._trainstream_engine.moments
    assert stager.copies > 0 and stager.mapped > 0


@pytest.mark.gpu
@pytest.mark.parametrize("base", [RESIDENT, PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("late", ["copy_in", "kernel", "copy_home"])
def test_gpu_mode_units_of_several_regions_with_one_stream_held_back(base, late, monkeypatch):
    """tiny_gpt under this cap: each block's moments in five regions, three copied and two
    mapped (fc, out), each with a kernel of its own. One stream's work is held back each
    time (several held back at once keep pace with each other and hide a missing wait), and
    nothing here orders it: a missing wait between a region's copy in, its kernel and its
    copy home, between steps, or between a unit's copies home and a host reader of the
    moments, changes the bits. The host's waits under max_inflight_bytes are switched off:
    under this small cap they order nearly everything themselves (with them, a copy in
    that skipped its wait for the region's copy home passed this test on the H200)."""
    from trainstream.engine.device import TransferLedger
    from trainstream.engine.moments import MomentStager
    from trainstream.engine.optimizer import StreamedAdamW

    delay = int(1e7)  # GPU cycles, a few milliseconds: longer than this model's kernels and copies
    stage_in, send_home, kernel = MomentStager.stage_in, MomentStager.send_home, StreamedAdamW.queue_on_device

    def late_copy_in(self, params, stream):
        with torch.cuda.stream(self.backend.moments_in):
            torch.cuda._sleep(delay)
        return stage_in(self, params, stream)

    def late_kernel(self, *args, **kwargs):
        torch.cuda._sleep(delay)  # on the update stream, where the engine queues the kernel
        return kernel(self, *args, **kwargs)

    def late_copy_home(self, staged, kernel_done):
        with torch.cuda.stream(self.backend.moments_out):
            torch.cuda._sleep(delay)
        return send_home(self, staged, kernel_done)

    cap = dict(max_inflight_bytes=240_000)
    host = train("gpt", dict(base, **cap), device="cuda", steps=4)
    _moment_room(monkeypatch, lambda self: None)
    monkeypatch.setattr(TransferLedger, "make_room", lambda self, nbytes, with_ahead=False: self.settle())
    if late == "copy_in":
        monkeypatch.setattr(MomentStager, "stage_in", late_copy_in)
    elif late == "kernel":
        monkeypatch.setattr(StreamedAdamW, "queue_on_device", late_kernel)
    else:
        monkeypatch.setattr(MomentStager, "send_home", late_copy_home)
    device = train("gpt", dict(base, **GPU_MODE, **cap), device="cuda", steps=4)
    assert_same_bits(host, device)
    moments = lambda opt: {
        (i, k): v
        for i, st in opt.state_dict()["state"].items()  # noqa: E731
        for k, v in st.items()
        if k != "step"
    }
    host_moments, device_moments = moments(host[2][1]), moments(device[2][1])
    assert host_moments.keys() == device_moments.keys() and host_moments
    for k in host_moments:
        assert torch.equal(host_moments[k], device_moments[k]), k
    stager = device[2][0]._trainstream_engine.moments
    block_regions = [
        r
        for r in set(stager.region_of.values())
        if any(p is q for p, *_ in r.layout for q in device[2][0].layers[0].parameters())
    ]
    assert sorted(r.staged for r in block_regions) == [False, False, True, True, True]
    assert stager.copies > 0 and stager.mapped == 0
