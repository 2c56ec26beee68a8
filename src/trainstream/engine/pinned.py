"""Page-locked host memory for transfers, registered with the CUDA driver.

[Note: registered host memory] torch.empty(pin_memory=True) goes to torch's caching host
allocator, which asks cudaHostAlloc for a new block: the driver allocates, zeroes and locks the
pages on one thread (about 0.5 s per GiB on the H200 host), and the calling thread's other CUDA
calls wait behind it. host_bytes() instead maps anonymous memory, faults its pages in on
torch's intra-op threads (zero_(): the kernel zeroes each page at its first touch, in
parallel), then locks them with cudaHostRegister, which has little left to do: about 0.1 s
per GiB with 16 threads there, at the same copy bandwidth. The registration is portable
(every CUDA context sees the pages pinned) and mapped, under the engine's device made
current: a device may read the pages at their host address (params._mapped_view, what
cudaDevAttrCanUseHostPointerForRegisteredMem promises on 64-bit Linux), and torch names a
CUDA view of them by that device.

Lifetime: the tensor is torch.frombuffer over the mapping object, whose storage holds a
reference to it while any view of it lives (torch releases the buffer export at once and
keeps the object, so nothing but the last view's death frees it). The mapping's finalizer
then waits for its device (the caching allocator delays reuse of a block until the streams
that used it pass their recorded events; this memory has no such record, and a copy queued
through it may still run), unregisters, and only then is the range unmapped. A range the
driver would not unregister stays mapped (leaked) rather than handed back while it may still
be mapped for the device. The mapping is shared (MAP_SHARED), as cudaHostAlloc's pages are to
the driver: a forked child (a DataLoader worker) maps the same pages, so a fork neither copies
the locked pages nor lets copy-on-write move the parent's pages away from the addresses the
GPU maps, and the child's copy of a buffer, dropped, unmaps only the child's view. (Not a private mapping
left out of forks with MADV_DONTFORK: that leaves a hole at the buffer's address in the child,
where the child's own allocations land under the tensors it inherited.)

Below MIN_BYTES requests keep the caching host allocator, and so does every request once a
registration failed (RLIMIT_MEMLOCK on some drivers, a platform without registration, a torch
without cudart()): fallback_note() says why, for the engine's events; there is no warning.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading

import torch

# Below this the caching host allocator serves a request: it reuses the blocks it keeps, so a
# repeated small request costs no driver call, where a registered buffer costs a mapping, a
# registration and a device synchronize at its release. cudaHostAlloc's cost grows with the
# size (about 0.5 ms for 1 MiB); the engine's small buffers (marks, per-tensor buffers of
# norms, biases, adapters) are many, its large ones (arena pieces, activation slabs, a large
# parameter's buffers) at least HostSlabs.MIN_PIECE, 1 MiB, and pinned once.
MIN_BYTES = 1 << 20

# cudaHostRegisterPortable | cudaHostRegisterMapped (0x01 and 0x02, CUDA's driver_types.h)
REGISTER_FLAGS = 0x01 | 0x02

# madvise(MADV_HUGEPAGE) the mappings. Off: with THP's defrag setting "madvise" (the default),
# a madvised region's faults may compact memory synchronously; on a 2-core CI machine half the
# first touches of a madvised 256 MiB took about 2.7 s per GiB, 5 to 10 times the 4 KiB pages'
# 0.25-0.5 (the other half 0.15). The figures above are the H200 host's, with 4 KiB pages.
HUGE_PAGES = False

PAGE = mmap.PAGESIZE

_lock = threading.RLock()  # reentrant: a mapping's finalizer may run inside a locked section
_runtime = None  # _CudaRuntime once loaded
_note: str | None = None  # why registration is off for this process (set once)
_live = [0, 0]  # registered mappings alive: count, bytes
_leaked: list = []  # mappings the driver would not unregister: never unmapped


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A page-locked host tensor of `shape` and `dtype` for transfers to and from `device`
    (a CUDA device): host_bytes() viewed as `dtype`. Its contents are unspecified (zero where
    registered)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"trainstream: dtype must be a torch.dtype, got {dtype!r}")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"trainstream: shape must be non-negative ints, got {shape!r}")
    numel = math.prod(dims)
    # a uint8 buffer of whole elements, its start page-aligned: view(dtype) needs nothing more
    return host_bytes(numel * dtype.itemsize, device).view(dtype).view(dims)


def host_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` bytes (uint8) of page-locked host memory for transfers to and from `device`
    (a CUDA device): registered ([Note: registered host memory]) from MIN_BYTES up while
    registration works, else from torch's caching host allocator."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"trainstream: nbytes must be an int, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"trainstream: nbytes must be >= 0, got {nbytes}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"trainstream: page-locked host memory is for a CUDA device, got device={device}")
    if nbytes == 0 or nbytes < MIN_BYTES:
        return _cached_pinned(nbytes)
    runtime = _registration()
    if runtime is not None:
        index = device.index if device.index is not None else runtime.current_device()
        t = _registered(nbytes, index, runtime)
        if t is not None:
            return t
    return _cached_pinned(nbytes)


def fallback_note() -> str | None:
    """Why transfer buffers come from the caching host allocator for the rest of this
    process (a registration failed, or cannot be done here); None while registration works
    or was never tried."""
    return _note


def registered() -> tuple[int, int]:
    """Registered buffers alive now: (how many, bytes)."""
    with _lock:
        return _live[0], _live[1]


def _cached_pinned(nbytes: int) -> torch.Tensor:
    # device="cpu": a default-device context (with torch.device("cuda"):) must not move it
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)


def _turn_off(reason: str) -> None:
    global _note
    with _lock:
        if _note is None:
            _note = (
                f"pinned memory: {reason}; transfer buffers come from torch's caching host allocator "
                "(cudaHostAlloc, one thread: about 0.5 s per GiB) for the rest of this process"
            )


def _registration():
    """The runtime to register with, loaded once; None once registration is off."""
    global _runtime
    with _lock:
        if _note is not None:
            return None
        if _runtime is None:
            runtime, reason = _load_runtime()
            if runtime is None:
                _turn_off(reason)
                return None
            _runtime = runtime
        return _runtime


def _registered(nbytes: int, index: int, runtime) -> torch.Tensor | None:
    """A registered buffer of `nbytes` for device `index`, or None (registration is then off)."""
    length = -(-nbytes // PAGE) * PAGE  # the mapping, the registration and the pages locked
    try:
        mapping = _Mapping(length)
    except (OSError, ValueError) as e:
        _turn_off(f"mapping {length} bytes of host memory failed ({e})")
        return None
    t = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` while any view lives
    t.zero_()  # the first touch, on torch's intra-op threads; registering it then only locks
    try:
        code, text = runtime.register(t.data_ptr(), length, index)
    except Exception as e:  # any failure falls back, and the note says which
        code, text = -1, f"{type(e).__name__}: {e}"
    if code != 0:
        # never registered: `t` and `mapping` die here and the range is unmapped
        _turn_off(f"cudaHostRegister of {length} bytes failed (error {code}: {text})")
        return None
    mapping._registered(runtime, t.data_ptr(), index)
    return t if length == nbytes else t[:nbytes]


class _Mapping(mmap.mmap):
    """Anonymous shared memory whose finalizer unregisters it before mmap unmaps it."""

    def __new__(cls, length: int):
        self = super().__new__(cls, -1, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._runtime = None  # set once registered
        if HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE"):
            self.madvise(mmap.MADV_HUGEPAGE)
        return self

    def _registered(self, runtime, ptr: int, index: int) -> None:
        self._ptr, self._index, self._pid = ptr, index, os.getpid()
        self._runtime = runtime
        with _lock:
            _live[0] += 1
            _live[1] += len(self)

    def __del__(self) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            return
        try:
            if self._pid != os.getpid():  # a forked child: the registration is its parent's
                return
            if _capturing():  # a device synchronize would invalidate a CUDA graph capture: keep the range
                code = -1
            else:
                runtime.synchronize(self._index)  # no copy through these pages is still queued
                code = runtime.unregister(self._ptr, self._index)
        except Exception:  # a finalizer must not raise (at exit, CUDA may be gone); the range stays mapped
            code = -1
        with _lock:
            if code != 0:
                _leaked.append(self)  # resurrected: never unmapped while it may be mapped for the device
            else:
                _live[0] -= 1
                _live[1] -= len(self)


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _CudaRuntime:
    """The CUDA runtime calls of this module, made through torch's runtime (torch.cuda.cudart()
    and the libcudart it is bound to)."""

    def __init__(self, cudart, get_last_error):
        self._cudart = cudart
        self._get_last_error = get_last_error

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def register(self, ptr: int, nbytes: int, index: int) -> tuple[int, str]:
        """(error code, its text): 0 once the range is registered."""
        with torch.cuda.device(index):
            rc = self._cudart.cudaHostRegister(ptr, nbytes, REGISTER_FLAGS)
            code = int(rc)
            if code == 0:
                return 0, ""
            # a failed runtime call stays this thread's last error, and torch's next kernel
            # launch on the thread would raise it as its own
            self._get_last_error()
            return code, str(self._cudart.cudaGetErrorString(rc))

    def unregister(self, ptr: int, index: int) -> int:
        with torch.cuda.device(index):
            code = int(self._cudart.cudaHostUnregister(ptr))
            if code != 0:
                self._get_last_error()
            return code

    def synchronize(self, index: int) -> None:
        torch.cuda.synchronize(index)


def _load_runtime():
    """(_CudaRuntime, None), or (None, why registration cannot be done here)."""
    if not (hasattr(mmap, "MAP_SHARED") and hasattr(os, "RTLD_NOLOAD")):
        return None, "this platform has no anonymous shared mappings or no dlopen(RTLD_NOLOAD) (not Linux)"
    try:
        cudart = torch.cuda.cudart()
        for name in ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString"):
            getattr(cudart, name)
    except (AttributeError, AssertionError, RuntimeError) as e:
        return None, f"this torch offers no cudaHostRegister through torch.cuda.cudart() ({e})"
    get_last_error = _torch_cuda_get_last_error()
    if get_last_error is None:
        return None, (
            "the CUDA runtime library torch loaded (libcudart.so) was not found in this process, "
            "so a failed registration could not be cleared from it"
        )
    return _CudaRuntime(cudart, get_last_error), None


def _torch_cuda_get_last_error():
    """cudaGetLastError of the libcudart this process has loaded (torch's: the native module's
    cudart is static, its symbols hidden), or None. RTLD_NOLOAD: never load another copy."""
    names = []
    major = (torch.version.cuda or "").split(".")[0]
    if major:
        names.append(f"libcudart.so.{major}")
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcudart.so"):
                    names.append(fields[5].strip())
    except OSError:
        pass
    for name in dict.fromkeys(names):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            fn = lib.cudaGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        return fn
    return None
