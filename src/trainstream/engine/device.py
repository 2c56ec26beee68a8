"""Streams, events and host buffers for the engine's compute device.

On a GPU, weights come in on one copy stream (H2D) and gradients and activations go out on
another (D2H), so both PCIe directions run at once and neither waits behind compute; with
optimizer_mode="gpu" the updates run on a third stream, beside backward, and their moments
travel on two streams of their own. On the CPU backend every stream operation is a no-op
and a copy is finished when it returns: the engine's bookkeeping (hooks, hand-offs, paging
decisions) then runs unchanged in CI, where there is no GPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque

import torch

from ..ops._streams import current_stream_handle
from . import pinned


class _DoneEvent:
    """The CPU backend's event: the work it marks finished when it was recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = _DoneEvent()


class DeviceUpdate:
    """A unit's AdamW queued on the device's update stream (optimizer_mode="gpu"): the
    handle the engine keeps in place of a host job's. Device work that must follow it (the
    next forward, a copy of the host weights it writes) orders itself after `event`, the
    end of its last kernel, on the GPU. Host readers of the moments wait() for that and for
    `home`, the last of its regions' copies home (moments.py): a unit's regions each have
    their own kernel, and a mapped region's may end after a copied one's copy home. A host
    buffer the kernels only read (a gradient landed for clipping or accumulation) is free
    again at `event`: wait_read()."""

    __slots__ = ("event", "home")

    def __init__(self, event, home=None):
        self.event = event
        self.home = home if home is not None else event

    def done(self) -> bool:
        return self.event.query() and self.home.query()

    def wait(self) -> None:
        self.event.synchronize()
        self.home.synchronize()

    def wait_read(self) -> None:
        self.event.synchronize()


class Backend:
    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._current = None  # (raw handle, torch.cuda.Stream) of the last current stream seen (compute_stream)
        if self.is_cuda:
            self._index = device.index if device.index is not None else torch.cuda.current_device()
            self.copy_in = torch.cuda.Stream(device)  # host -> device: weights, activations
            self.copy_out = torch.cuda.Stream(device)  # device -> host: gradients, activations
            # optimizer_mode="gpu": the AdamW kernel, beside backward rather than behind it, and
            # its moments' copies in and out (moments.py), apart from the weights' and the
            # activations' so that neither queues behind the other
            self.update = torch.cuda.Stream(device)
            self.moments_in = torch.cuda.Stream(device)
            self.moments_out = torch.cuda.Stream(device)
        else:
            self.copy_in = self.copy_out = self.update = self.moments_in = self.moments_out = None

    def compute_stream(self):
        """The current stream of the engine's device (the user may run the model under
        torch.cuda.stream(s)); None on the CPU. torch.cuda.current_stream() builds a new
        Stream object on every call, and the engine asks several times per tensor it moves,
        so the object is kept and reused while the raw handle of the current stream, read
        from torch without building one, is the one it was made for. The handle names the
        stream (each thread has its own current stream: the check covers every thread)."""
        if not self.is_cuda:
            return None
        raw = current_stream_handle(self._index)
        cached = self._current  # one tuple, read once: another thread may replace it
        if cached is not None and cached[0] == raw:
            return cached[1]
        stream = torch.cuda.current_stream(self.device)
        self._current = (stream.cuda_stream, stream)
        return stream

    def on(self, stream):
        """Context: queue work on `stream` (a no-op on the CPU)."""
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def record(self, stream=None):
        """An event marking the work queued so far on `stream` (default: compute)."""
        if not self.is_cuda:
            return DONE
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.compute_stream())
        return event

    def wait(self, event, stream=None) -> None:
        """Make `stream` (default: compute) wait on the GPU for `event`; the host goes on."""
        if self.is_cuda and event is not None and event is not DONE:
            (stream if stream is not None else self.compute_stream()).wait_event(event)

    def follow_compute(self, stream) -> None:
        """Order `stream` after everything compute has queued so far (a copy of a tensor
        compute just produced). Call it outside `on(stream)`: compute is the current stream."""
        if self.is_cuda:
            stream.wait_stream(self.compute_stream())

    def follow(self, stream, sources) -> None:
        """Order `stream` after everything each of `sources` (streams; None on the CPU) has
        queued so far."""
        if self.is_cuda:
            for source in {id(s): s for s in sources if s is not None}.values():
                stream.wait_stream(source)

    def allocated(self) -> dict:
        """The caching allocator's allocated-bytes counters ("current", "peak") on a GPU.
        torch.cuda.memory_allocated() flattens every allocator statistic into a new dict on
        each call (about a tenth of a millisecond); the engine reads these a few times per
        block, so it takes the nested statistics torch builds that dict from."""
        try:
            return torch._C._cuda_memoryStats(self.device.index)["allocated_bytes"]["all"]
        except (AttributeError, KeyError, TypeError, RuntimeError):
            return {
                "current": torch.cuda.memory_allocated(self.device),
                "peak": torch.cuda.max_memory_allocated(self.device),
            }

    def keep_until(self, tensor: torch.Tensor, stream) -> None:
        """Keep `tensor`'s device memory out of reuse until `stream` has passed its current
        work (the caching allocator would otherwise hand it out while a copy still reads it)."""
        if self.is_cuda:
            tensor.record_stream(stream)

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for transfers: page-locked on a GPU machine, so copies are
        asynchronous (registered with the driver from pinned.MIN_BYTES up: [Note: registered
        host memory]); plain memory on the CPU."""
        if not self.is_cuda:
            return torch.empty(shape, dtype=dtype)
        return pinned.empty(shape, dtype, torch.device("cuda", self._index))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t` in transfer memory (its own storage, never an alias)."""
        host = self.host_empty(t.shape, t.dtype)
        host.copy_(t)
        return host


class TransferLedger:
    """Device memory that transfers hold, against one cap (max_inflight_bytes), for every
    manager that moves bytes (weights, gradients, activations, moments).

    Released bytes: memory the engine let go of that the caching allocator keeps until a copy
    or compute passes an event (the CPU runs ahead of the GPU, so without a bound it would
    release and fetch far more than the GPU has consumed); make_room() holds the host back
    until they fit. Activations on their way out to host memory (forward's paging) are
    released bytes like any other, except for a weight fetch: the plan budgets the weights in
    flight apart (two blocks'), so the next block's weights never wait for the activations'
    copies out. (They did, and each paged block's forward then ran as copy out, weights in,
    compute, one after the other.)

    Bytes fetched ahead of use, in two counts, each with a prefetch that would take it past
    its limit skipped (the use fetches on demand), except the first, so that something is
    always on its way: weights, against the cap, held beside the released bytes that a weight
    fetch waits for; and activations in backward, against the larger of the cap and the
    caller's `window`: the paged activations of the block whose backward starts and of the
    `prefetch_depth` blocks below it, which the plan holds at once (planner/plan.py), so a
    cap smaller than two blocks' activations does not turn every prefetch into a fetch on
    demand."""

    def __init__(self, cap: int):
        self.cap = cap
        self._items = deque()  # [event, bytes, outgoing activations?], oldest first
        self.bytes = 0  # released, still held by queued work
        self.outgoing = 0  # of those, activations on their way to host memory
        self.ahead = 0  # weights fetched ahead of use, not yet used
        self.acts_ahead = 0  # activations fetched ahead of their backward, not yet used

    def add(self, event, nbytes: int, *, outgoing_activations: bool = False) -> None:
        if event is not DONE:
            self._items.append((event, nbytes, outgoing_activations))
            self.bytes += nbytes
            if outgoing_activations:
                self.outgoing += nbytes

    def _forget(self, item) -> None:
        self.bytes -= item[1]
        if item[2]:
            self.outgoing -= item[1]

    def settle(self) -> None:
        while self._items and self._items[0][0].query():
            self._forget(self._items.popleft())

    def make_room(self, nbytes: int) -> None:
        """Wait (host side, oldest first) until `nbytes` more fit under the cap."""
        self.settle()
        while self._items and self.bytes + nbytes > self.cap:
            item = self._items.popleft()
            item[0].synchronize()
            self._forget(item)

    def make_room_for_weights(self, nbytes: int) -> None:
        """make_room() for a weight fetch ahead of use: `nbytes` beside the weights fetched
        ahead, waiting (oldest first) for released bytes other than outgoing activations."""
        self.settle()
        while self.bytes - self.outgoing + self.ahead + nbytes > self.cap:
            item = next((it for it in self._items if not it[2]), None)
            if item is None:
                return
            self._items.remove(item)
            item[0].synchronize()
            self._forget(item)

    def may_fetch_ahead(self, nbytes: int) -> bool:
        """Weights."""
        return not self.ahead or self.ahead + nbytes <= self.cap

    def fetched_ahead(self, nbytes: int) -> None:
        self.ahead += nbytes

    def used(self, nbytes: int) -> None:
        """Weights fetched ahead were attached to compute (or dropped)."""
        self.ahead -= nbytes

    def may_fetch_acts_ahead(self, nbytes: int, window: int) -> bool:
        return not self.acts_ahead or self.acts_ahead + nbytes <= max(self.cap, window)

    def acts_fetched_ahead(self, nbytes: int) -> None:
        self.acts_ahead += nbytes

    def acts_used(self, nbytes: int) -> None:
        """Activations fetched ahead were restored for backward (or dropped)."""
        self.acts_ahead -= nbytes


class HostArena:
    """Transfer memory for the engine's host buffers, pinned once at wrap() and carved into
    tensors. Pinning costs about 0.1 s per GiB (registered: [Note: registered host memory];
    about 0.5 s through the caching host allocator), so it happens once, not per step. The
    caching host allocator rounds each request up to a power of two (a registration, to
    whole pages), so the arena asks for power-of-two pieces: the largest that the remaining
    need fills, the first at most MAX_PIECE and each later one at most twice the one before
    (or MAX_PIECE, if larger), and never smaller than the tensor that opens it. The waste is
    a piece's tail when the next tensor does not fit in it: a piece of at most twice the one
    before is large against the tensors that fill it, so the tails stay a few percent of the
    need (a 7B full fine-tune's layout: 51.0 GiB pinned for 50.2 needed, where pieces capped
    at MAX_PIECE each pinned 66); the planner counts the pinned bytes (pinned_for), not the
    need.

    [Note: pinning ahead] Pinning is the kernel faulting in (and zeroing) pages and the driver
    locking them: from pinned.MIN_BYTES up the faults run on torch's intra-op threads and the
    lock is one registration, about 0.1 s per GiB on the H200 host (16 threads); a smaller
    piece goes to cudaHostAlloc, on one thread, about 0.5 s per GiB. At wrap() the quantizer
    and the copies that fill the pieces run meanwhile. Told the sizes of the tensors it will
    hand out (pinning_ahead), the arena knows every piece it will ask for, and a thread of
    its own pins them in order while take() fills those before; take() waits only for a
    piece not pinned yet. MAX_PIECE bounds the first piece, the one nothing overlaps; the
    doubling after it keeps the pieces few. The thread never outlives pinning_ahead's block:
    it is joined when the block ends, also when the block raises, and an error it met is
    raised from the take() that needed its piece (or at the block's end)."""

    ALIGN = 64
    MAX_PIECE = 256 << 20

    def __init__(self, backend: Backend, nbytes: int):
        self.backend = backend
        self.remaining = nbytes  # bytes still to be handed out
        self.pieces: list = []
        self._piece = None
        self._used = 0
        self._pinner = None  # _Pinner while pinning_ahead

    @staticmethod
    def size_of(numel: int, dtype: torch.dtype) -> int:
        n = numel * dtype.itemsize
        return -(-n // HostArena.ALIGN) * HostArena.ALIGN

    @property
    def reserved(self) -> int:
        return sum(p.numel() for p in self.pieces)

    @classmethod
    def piece_size(cls, remaining: int, need: int, previous: int = 0) -> int:
        """The piece to ask for when a tensor of `need` bytes does not fit in the current one
        (of `previous` bytes; 0 before the first) and `remaining` bytes are still to be
        handed out."""
        floor_pow2 = 1 << (max(remaining, 1).bit_length() - 1)
        cap = max(cls.MAX_PIECE, 2 * previous) if previous else cls.MAX_PIECE
        return max(min(floor_pow2, cap), 1 << (need - 1).bit_length())

    @classmethod
    def piece_sizes(cls, remaining: int, sizes) -> list:
        """Every piece take() asks for when it hands out tensors of `sizes` bytes (size_of
        each) in that order, `remaining` bytes still to be handed out: take()'s own rule."""
        pieces, free = [], 0
        for n in sizes:
            if not pieces or n > free:
                pieces.append(cls.piece_size(remaining, n, pieces[-1] if pieces else 0))
                free = pieces[-1]
            free -= n
            remaining -= n
        return pieces

    @classmethod
    def pinned_for(cls, sizes) -> int:
        """The bytes an arena pins to hand out tensors of `sizes` bytes (size_of each) in that
        order, and nothing more: what the host and its pinning limit must hold."""
        sizes = list(sizes)
        return sum(cls.piece_sizes(sum(sizes), sizes))

    @contextlib.contextmanager
    def pinning_ahead(self, sizes):
        """Within the block, the pieces for takes of `sizes` bytes (size_of each, in the
        order the block takes them) are pinned ahead by a thread ([Note: pinning ahead])."""
        if self._pinner is not None or self.pieces:
            raise RuntimeError("trainstream: the host arena pins ahead once, before its first take")
        sizes = list(sizes)
        if sum(sizes) > self.remaining:
            raise RuntimeError("trainstream: host arena asked to pin ahead for more than it holds (a sizing bug)")
        pinner = _Pinner(self.backend, self.piece_sizes(self.remaining, sizes))
        pinner.start()  # set only once started: a take() of an arena whose thread never ran pins on demand
        self._pinner = pinner
        try:
            yield self
        finally:
            self._pinner = None
            pinner.stop()
        pinner.raise_error()

    def _new_piece(self, need: int) -> None:
        size = self.piece_size(self.remaining, need, self.pieces[-1].numel() if self.pieces else 0)
        if self._pinner is not None:
            self._piece = self._pinner.piece(len(self.pieces), size)
        else:
            self._piece = self.backend.host_empty((size,), torch.uint8)
        self.pieces.append(self._piece)
        self._used = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        n = self.size_of(numel, dtype)
        if n > self.remaining:
            raise RuntimeError("trainstream: host arena exhausted (a sizing bug)")
        if self._piece is None or self._used + n > self._piece.numel():
            self._new_piece(n)
        region = self._piece[self._used : self._used + numel * dtype.itemsize]
        self._used += n
        self.remaining -= n
        return region.view(dtype).view(shape)


class HostSlabs:
    """Pinned host memory for paged activations: pieces carved exactly (64-byte aligned),
    one region per storage, and carved again from the start by each pass.

    [Note: activation slabs] Asking the caching host allocator for one buffer per storage
    pins each request rounded up to a power of two (a 7B model's MLP activations: 78 MB in a
    128 MiB buffer), with a fresh page-locking call for every one the first pass makes. Here
    a pass carves its storages from power-of-two pieces, each into the first piece carved
    this pass that still has room for it (first fit), else into a piece of its own: one free
    from earlier passes, or a new one, a quarter of the pool so far, from MIN_PIECE up to
    MAX_PIECE, or the storage's own power of two if larger. The waste is what no later
    storage fitted into and the last piece's unused end. A piece is carved again only once no
    region of it is held (autograd let go of every saved tensor in it: a graph kept for a
    second backward keeps its pieces), so the pool grows to what the passes hold at once and
    never shrinks. A piece carved again may still be read by copies to the device queued
    before: the first copy into it this pass waits (on the GPU) for every copy the copy-in
    stream had queued when the pass began. The pieces are registered ([Note: registered host
    memory]): a 7B LoRA under 8 GiB holds about 9.6 GB of them from its first paged pass,
    which took about 9 s to pin through the caching host allocator, about 0.1 s per GiB so."""

    ALIGN = 64
    MIN_PIECE = 1 << 20
    MAX_PIECE = HostArena.MAX_PIECE

    def __init__(self, backend: Backend):
        self.backend = backend
        self.pieces: list = []
        self._held: list = []  # per piece: weak references to the regions carved from it
        self._free: list = []  # pieces no region of which is held, this pass has not carved yet
        self._used: dict = {}  # piece -> bytes carved from it this pass, in the order carved
        self._fence = None  # copy-in's work when this pass began, until a reused piece is carved

    @property
    def reserved(self) -> int:
        return sum(p.numel() for p in self.pieces)

    def new_pass(self) -> None:
        """A pass begins: every piece none of whose regions is held may be carved again."""
        self._free = [k for k, held in enumerate(self._held) if all(r() is None for r in held)]
        for k in self._free:
            self._held[k] = []
        self._used = {}
        self._fence = self.backend.record(self.backend.copy_in) if self._free else None

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of pinned memory (uint8), apart from every other region still held."""
        n = max(-(-nbytes // self.ALIGN) * self.ALIGN, self.ALIGN)
        k = next((k for k, used in self._used.items() if self.pieces[k].numel() - used >= n), None)
        if k is None:
            k = self._open_piece(n)
        start = self._used[k]
        region = self.pieces[k][start : start + nbytes]
        self._used[k] = start + n
        self._held[k].append(weakref.ref(region))
        return region

    def _open_piece(self, n: int) -> int:
        """A piece of at least `n` bytes to carve this pass: a free one, else a new one."""
        k = next((k for k in self._free if self.pieces[k].numel() >= n), None)
        if k is not None:
            self._free.remove(k)
            if self._fence is not None:
                self.backend.wait(self._fence, self.backend.copy_out)
                self._fence = None
        else:
            grown = min(self.MAX_PIECE, max(self.MIN_PIECE, self.reserved // 4))
            size = max(1 << (grown - 1).bit_length(), 1 << (n - 1).bit_length())
            self.pieces.append(self.backend.host_empty((size,), torch.uint8))
            self._held.append([])
            k = len(self.pieces) - 1
        self._used[k] = 0
        return k


class _Pinner(threading.Thread):
    """HostArena's thread that pins its pieces ahead, in order ([Note: pinning ahead])."""

    def __init__(self, backend: Backend, sizes: list):
        super().__init__(name="trainstream-arena-pinner", daemon=True)
        self.backend = backend
        self.sizes = sizes
        self._pieces: list = []  # pinned so far, in order
        self._error: BaseException | None = None
        self._stopping = False
        self._changed = threading.Condition()

    def run(self) -> None:
        try:
            if self.backend.is_cuda:
                # A fresh thread's current device is 0: with a context there, pinned memory
                # would be registered with GPU 0's context and mapped (read in place by a
                # paged weight's placeholder) only on cuda:0, not on the engine's GPU
                torch.cuda.set_device(self.backend._index)
            for size in self.sizes:
                with self._changed:
                    if self._stopping:
                        return
                piece = self.backend.host_empty((size,), torch.uint8)  # the GIL is released while it pins
                with self._changed:
                    self._pieces.append(piece)
                    self._changed.notify_all()
        except BaseException as error:  # handed to the waiting take() or the block's end
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def piece(self, k: int, size: int) -> torch.Tensor:
        """Piece `k` once pinned; it must be `size` bytes (the takes are the ones announced)."""
        if k >= len(self.sizes) or self.sizes[k] != size:
            raise RuntimeError(
                f"trainstream: host arena piece {k} of {size} bytes was not among those pinned ahead (a sizing bug)"
            )
        with self._changed:
            self._changed.wait_for(lambda: len(self._pieces) > k or self._error is not None)
            if len(self._pieces) > k:
                return self._pieces[k]
            error = self._error
        raise error

    def stop(self) -> None:
        """No more pieces: the one being pinned finishes, then the thread ends (joined)."""
        with self._changed:
            self._stopping = True
        self.join()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error
