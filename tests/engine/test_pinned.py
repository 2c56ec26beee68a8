"""engine/pinned.py: registered host memory ([Note: registered host memory]). On the CPU the CUDA
runtime is a fake that records its calls; the mappings, their views and their lifetimes are
real."""

import gc
import os

import pytest
import torch
from helpers import PAGED, assert_same_bits, train

from trainstream.engine import pinned
from trainstream.engine.device import Backend

CUDA0 = torch.device("cuda", 0)
MiB = 1 << 20


def _vm_flags(ptr: int):
    """The VmFlags of the mapping of this process that holds address `ptr`, or None."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= ptr < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return None


def _ours(ptr: int) -> bool:
    """`ptr` lies in a mapping made by pinned (the only shared anonymous ones here)."""
    flags = _vm_flags(ptr)
    return flags is not None and "sh" in flags


class FakeRuntime:
    def __init__(self, register_codes=(), unregister_code=0, register_raises=None):
        self.calls = []  # ("register", ptr, nbytes, index) / ("synchronize", index) / ("unregister", ptr, mapped)
        self.register_codes = list(register_codes)  # the codes of the first registers, then 0
        self.unregister_code = unregister_code
        self.register_raises = register_raises

    def current_device(self) -> int:
        return 0

    def register(self, ptr, nbytes, index):
        self.calls.append(("register", ptr, nbytes, index))
        if self.register_raises is not None:
            raise self.register_raises
        code = self.register_codes.pop(0) if self.register_codes else 0
        return code, "out of memory" if code else ""

    def synchronize(self, index):
        self.calls.append(("synchronize", index))

    def unregister(self, ptr, index):
        self.calls.append(("unregister", ptr, _ours(ptr)))
        return self.unregister_code

    def kinds(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def cached(monkeypatch):
    """The caching host allocator's requests (plain memory here: no CUDA)."""
    requests = []

    def fake_cached(nbytes):
        requests.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(pinned, "_cached_pinned", fake_cached)
    monkeypatch.setattr(pinned, "_note", None)
    monkeypatch.setattr(pinned, "_live", [0, 0])
    yield requests
    gc.collect()


def _use(monkeypatch, runtime):
    monkeypatch.setattr(pinned, "_runtime", runtime)
    return runtime


def test_a_buffer_is_registered_once_and_unregistered_after_its_last_view_dies(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime())
    t = pinned.host_bytes(2 * MiB, CUDA0)
    ptr = t.data_ptr()
    assert t.dtype == torch.uint8 and t.numel() == 2 * MiB and not cached
    assert fake.calls == [("register", ptr, 2 * MiB, 0)]
    assert _ours(ptr) and pinned.registered() == (1, 2 * MiB)
    assert int(t.count_nonzero()) == 0  # touched (zeroed) before it was registered

    view = t[100:200]
    del t
    gc.collect()
    assert fake.kinds() == ["register"]  # a view keeps the mapping, registered
    view.fill_(7)
    assert int(view.sum()) == 700 and _ours(ptr)

    del view
    gc.collect()
    # the device is waited for, then the range unregistered while still mapped, then unmapped
    assert fake.calls[1:] == [("synchronize", 0), ("unregister", ptr, True)]
    assert not _ours(ptr) and pinned.registered() == (0, 0)


def test_sizes_not_a_multiple_of_the_page_are_mapped_and_registered_in_whole_pages(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime())
    numel = MiB // 2 + 3  # bfloat16: 1 MiB + 6 bytes
    t = pinned.empty((numel,), torch.bfloat16, CUDA0)
    assert t.shape == (numel,) and t.dtype == torch.bfloat16 and t.is_contiguous()
    (_, ptr, registered_bytes, index) = fake.calls[0]
    assert ptr == t.data_ptr() and ptr % pinned.PAGE == 0 and index == 0
    assert registered_bytes % pinned.PAGE == 0 and 0 <= registered_bytes - 2 * numel < pinned.PAGE
    t[-1] = 1.5
    assert t[-1].item() == 1.5 and int(t[:-1].count_nonzero()) == 0

    grid = pinned.empty((3, MiB // 4 + 1), torch.float32, CUDA0)  # a 2-d shape, 4-byte elements
    assert grid.shape == (3, MiB // 4 + 1) and grid.dtype == torch.float32
    grid.copy_(torch.arange(grid.numel(), dtype=torch.float32).view(grid.shape))
    assert grid[2, -1].item() == grid.numel() - 1
    assert pinned.registered()[0] == 2 and not cached


def test_small_and_empty_requests_keep_the_caching_allocator(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime())
    assert pinned.host_bytes(pinned.MIN_BYTES - 1, CUDA0).numel() == pinned.MIN_BYTES - 1
    assert pinned.empty((0, 4), torch.float32, CUDA0).shape == (0, 4)
    assert pinned.empty((), torch.int32, CUDA0).shape == ()
    assert cached == [pinned.MIN_BYTES - 1, 0, 4]
    assert fake.calls == [] and pinned.fallback_note() is None


def test_a_failed_registration_falls_back_and_turns_registration_off(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime(register_codes=[2]))
    t = pinned.host_bytes(2 * MiB, CUDA0)
    assert cached == [2 * MiB] and t.numel() == 2 * MiB
    ptr = fake.calls[0][1]
    note = pinned.fallback_note()
    assert "error 2" in note and "out of memory" in note and "caching host allocator" in note
    gc.collect()
    assert not _ours(ptr)  # the mapping that failed to register is gone, never unregistered

    pinned.host_bytes(4 * MiB, CUDA0)  # off for the rest of the process: no second attempt
    assert cached == [2 * MiB, 4 * MiB] and fake.kinds() == ["register"]
    assert pinned.fallback_note() == note and pinned.registered() == (0, 0)


def test_a_registration_that_raises_falls_back(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime(register_raises=RuntimeError("no context")))
    pinned.host_bytes(2 * MiB, CUDA0)
    assert cached == [2 * MiB] and fake.kinds() == ["register"]
    assert "RuntimeError: no context" in pinned.fallback_note()


def test_no_runtime_turns_registration_off_with_its_reason(monkeypatch, cached):
    monkeypatch.setattr(pinned, "_runtime", None)
    monkeypatch.setattr(pinned, "_load_runtime", lambda: (None, "no runtime here"))
    pinned.host_bytes(2 * MiB, CUDA0)
    assert cached == [2 * MiB] and "no runtime here" in pinned.fallback_note()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU build of torch")
def test_a_torch_without_cuda_has_no_runtime_to_register_with():
    runtime, reason = pinned._load_runtime()
    assert runtime is None and "cudart" in reason


def _cudart_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return any("libcudart.so" in line for line in maps)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU build of torch, which loads no CUDA runtime")
def test_the_error_clearing_never_loads_a_cuda_runtime_of_its_own(monkeypatch):
    """Only the runtime torch loaded holds torch's last error: another copy, loaded here from
    the library path, would clear nothing of it."""
    if _cudart_loaded():
        pytest.skip("another library of this process loaded a CUDA runtime")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert pinned._torch_cuda_get_last_error() is None and not _cudart_loaded()


def test_an_unregister_that_fails_keeps_the_range_mapped(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime(unregister_code=1))
    monkeypatch.setattr(pinned, "_leaked", [])
    t = pinned.host_bytes(2 * MiB, CUDA0)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert fake.kinds() == ["register", "synchronize", "unregister"]
    assert _ours(ptr) and len(pinned._leaked) == 1  # leaked, not handed back while it may be mapped
    pinned._leaked.clear()  # the finalizer ran once: now it is only unmapped
    gc.collect()
    assert not _ours(ptr) and fake.kinds().count("unregister") == 1


@pytest.mark.parametrize("huge", [False, True])
def test_mappings_are_shared_with_a_fork_and_madvised_for_huge_pages_when_asked(monkeypatch, cached, huge):
    _use(monkeypatch, FakeRuntime())
    monkeypatch.setattr(pinned, "HUGE_PAGES", huge)
    t = pinned.host_bytes(4 * MiB, CUDA0)
    flags = _vm_flags(t.data_ptr())
    assert "sh" in flags and "dc" not in flags  # MAP_SHARED, in a fork too (not MADV_DONTFORK)
    assert ("hg" in flags) == huge  # MADV_HUGEPAGE


def test_a_forked_child_does_not_unregister_its_parents_buffers(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime())
    t = pinned.host_bytes(2 * MiB, CUDA0)
    gc.collect()  # the child collects nothing: other objects' finalizers may expect threads it lacks
    pid = os.fork()
    if pid == 0:  # the child: its copy of `t`, the mapping's only holder, dies here over pages it does not have
        try:
            del t
            os._exit(0 if fake.kinds() == ["register"] else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(t.count_nonzero()) == 0 and fake.kinds() == ["register"]


def test_arguments_are_checked(monkeypatch, cached):
    _use(monkeypatch, FakeRuntime())
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        pinned.host_bytes(-1, CUDA0)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        pinned.host_bytes(1.5, CUDA0)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        pinned.host_bytes(True, CUDA0)
    with pytest.raises(ValueError, match="device=cpu"):
        pinned.host_bytes(16, torch.device("cpu"))
    with pytest.raises(ValueError, match="shape must be non-negative ints"):
        pinned.empty((2, -1), torch.float32, CUDA0)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        pinned.empty((2,), "float32", CUDA0)
    assert cached == []


def test_the_runtime_clears_a_failed_calls_error_and_decodes_it(monkeypatch):
    """A failed runtime call stays the calling thread's last error, which torch's next kernel
    launch there would raise as its own: _CudaRuntime reads it back (clears it) on failure."""

    class Code(int):  # what torch's cudart binding returns: an enum that converts with int()
        pass

    class Cudart:
        def __init__(self):
            self.calls = []

        def cudaHostRegister(self, ptr, nbytes, flags):
            self.calls.append(("register", ptr, nbytes, flags))
            return Code(2 if nbytes > MiB else 0)

        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr))
            return Code(1)

        def cudaGetErrorString(self, code):
            return f"message {int(code)}"

    class Device:  # torch.cuda.device, which a CPU build cannot enter
        def __init__(self, index):
            cudart.calls.append(("device", index))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    cudart, cleared = Cudart(), []
    monkeypatch.setattr(torch.cuda, "device", Device)
    runtime = pinned._CudaRuntime(cudart, lambda: cleared.append(True))
    assert runtime.register(4096, MiB, 3) == (0, "") and cleared == []
    assert runtime.register(4096, 2 * MiB, 3) == (2, "message 2") and cleared == [True]
    assert runtime.unregister(4096, 3) == 1 and cleared == [True, True]
    assert cudart.calls[:2] == [("device", 3), ("register", 4096, MiB, 0x03)]  # portable | mapped


def test_a_gpu_backends_host_empty_is_registered_from_min_bytes_up(monkeypatch, cached):
    fake = _use(monkeypatch, FakeRuntime())
    backend = Backend(torch.device("cpu"))
    backend.is_cuda, backend._index = True, 2  # a GPU backend's two fields host_empty reads
    big = backend.host_empty((MiB // 2,), torch.float32)
    small = backend.host_empty((3, 5), torch.float64)
    assert big.shape == (MiB // 2,) and big.dtype == torch.float32 and fake.calls[0][1:] == (big.data_ptr(), 2 * MiB, 2)
    assert small.shape == (3, 5) and small.dtype == torch.float64 and cached == [3 * 5 * 8]


@pytest.mark.gpu
def test_gpu_a_registered_buffer_is_pinned_mapped_and_copies_through_it_are_bit_exact():
    from trainstream.engine.params import _mapped_view

    n = 8 * MiB + 123
    gc.collect()  # earlier tests' buffers die now, not between the two counts
    before = pinned.registered()[0]
    t = pinned.host_bytes(n, torch.device("cuda", torch.cuda.current_device()))
    assert pinned.fallback_note() is None, pinned.fallback_note()
    assert pinned.registered()[0] == before + 1 and t.is_pinned() and t.numel() == n
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    t.copy_(src, non_blocking=True)  # D2H
    back = torch.empty_like(src)
    torch.cuda.synchronize()
    back.copy_(t, non_blocking=True)  # H2D
    torch.cuda.synchronize()
    assert torch.equal(back, src) and torch.equal(t, src.cpu())
    mapped = _mapped_view(t)  # read in place by the device, at the host address
    assert mapped.device == src.device and torch.equal(mapped.clone(), src)
    values = pinned.empty((3, MiB + 1), torch.bfloat16, src.device)
    values.copy_(torch.randn(values.shape, dtype=torch.bfloat16))
    assert values.is_pinned() and torch.equal(values.cuda(non_blocking=True).cpu(), values)


@pytest.mark.gpu
def test_gpu_paging_through_registered_buffers_gives_the_caching_allocators_bits(monkeypatch):
    monkeypatch.setattr(pinned, "MIN_BYTES", 1 << 62)  # every buffer from torch's caching host allocator
    cached_run = train("gpt", PAGED, device="cuda")
    monkeypatch.setattr(pinned, "MIN_BYTES", 1)  # every buffer but empty ones registered
    gc.collect()
    before = pinned.registered()[0]
    registered_run = train("gpt", PAGED, device="cuda")
    assert pinned.fallback_note() is None, pinned.fallback_note()
    engine = registered_run[2][0]._trainstream_engine
    assert pinned.registered()[0] > before and engine.acts.slabs.pieces
    assert all(p.is_pinned() for p in engine.weights.arena.pieces + engine.acts.slabs.pieces)
    assert_same_bits(cached_run, registered_run)


def test_a_buffer_dying_during_a_graph_capture_is_kept_not_synchronized(monkeypatch, cached):
    """A device synchronize inside a CUDA graph capture would invalidate it: the finalizer
    keeps the range mapped and registered (leaked) instead."""
    fake = _use(monkeypatch, FakeRuntime())
    monkeypatch.setattr(pinned, "_capturing", lambda: True)
    t = pinned.host_bytes(2 * MiB, CUDA0)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert fake.kinds() == ["register"] and _ours(ptr) and len(pinned._leaked) == 1
    pinned._leaked.clear()
    monkeypatch.setattr(pinned, "_capturing", lambda: False)
    gc.collect()
