"""Activation paging: tensors a block saves for backward go to pinned host memory during
forward and come back ahead of their use in backward.

Paging works on whole storages, not on the saved tensors: q, k and v split from one qkv
projection are three views of one storage; they are copied out once and come back as the
same views (same strides, same offsets) of one restored storage. Backward then runs the
very kernels it would have run on the original tensors, which is what makes paging
bit-exact. A storage is recognised again only while it is alive and unmodified (a weak
reference and the tensor version counter), so a recycled address is never confused with
an earlier tensor.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .device import HostSlabs


class PagedStorage:
    __slots__ = ("host", "d2h_event", "device_copy", "h2d_event", "ref", "version", "nbytes", "ahead")

    def __init__(self, host, d2h_event, ref, version, nbytes):
        self.host, self.d2h_event, self.ref, self.version, self.nbytes = host, d2h_event, ref, version, nbytes
        self.device_copy = None
        self.h2d_event = None
        self.ahead = False


class PagedTensor:
    """What autograd holds instead of a saved tensor: where its bytes are and how to view them."""

    __slots__ = ("storage", "dtype", "size", "stride", "offset")

    def __init__(self, storage, t: torch.Tensor):
        self.storage = storage
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()


def _bytes_of(storage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class ActivationPager:
    """Owns the paged copies of saved activations, from pack in forward to drop in backward."""

    def __init__(self, backend, ledger, block_units: list, act_paged=()):
        """`act_paged`: the blocks whose saved activations go to host memory."""
        self.backend = backend
        self.ledger = ledger
        for u in block_units:
            u.act_paged = u.block in act_paged
        self._recent: dict = {}  # storage pointer -> PagedStorage, this forward pass
        self.slabs = HostSlabs(backend)  # the pinned host copies ([Note: activation slabs])
        self.paged_bytes = 0  # bytes copied out since wrap (for the report)

    @property
    def slab_bytes(self) -> int:
        """Host memory the slabs hold (pinned on a GPU), carved or not."""
        return self.slabs.reserved

    def pack(self, t: torch.Tensor, unit):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        rec = self._recent.get(ptr)
        if rec is None or rec.ref.expired() or rec.version != t._version:
            backend = self.backend
            src = _bytes_of(storage, t.device)
            self.ledger.make_room(src.numel())
            host = self.slabs.take(src.numel())
            backend.follow_compute(backend.copy_out)  # outside the stream context: compute is the current stream
            with backend.on(backend.copy_out):
                host.copy_(src, non_blocking=True)
                backend.keep_until(src, backend.copy_out)
            rec = PagedStorage(
                host, backend.record(backend.copy_out), StorageWeakRef(storage), t._version, storage.nbytes()
            )
            # the device storage can go once copied
            self.ledger.add(rec.d2h_event, rec.nbytes, outgoing_activations=True)
            self._recent[ptr] = rec
            unit.acts.append(rec)
            self.paged_bytes += rec.nbytes
        return PagedTensor(rec, t)

    def fetch(self, rec: PagedStorage, *, ahead: bool = False, window: int = 0) -> None:
        """Start `rec`'s copy back to the device. `ahead`: before its backward needs it,
        skipped past the ledger's limit for activations ahead (the larger of its cap and
        `window`, TransferLedger)."""
        if rec.device_copy is not None:
            return
        backend = self.backend
        if ahead and not self.ledger.may_fetch_acts_ahead(rec.nbytes, window):
            return
        backend.wait(rec.d2h_event, backend.copy_in)
        with backend.on(backend.copy_in):
            dev = torch.empty(rec.nbytes, dtype=torch.uint8, device=backend.device)
            dev.copy_(rec.host, non_blocking=True)
        rec.device_copy = dev
        rec.h2d_event = backend.record(backend.copy_in)
        if ahead:
            rec.ahead = True
            self.ledger.acts_fetched_ahead(rec.nbytes)

    def prefetch(self, unit, window: int) -> None:
        for rec in unit.acts:
            self.fetch(rec, ahead=True, window=window)

    @staticmethod
    def held_nbytes(units) -> int:
        """Bytes of the paged activations `units` hold (restored or not)."""
        return sum(rec.nbytes for u in units for rec in u.acts)

    def unpack(self, packed: PagedTensor) -> torch.Tensor:
        rec = packed.storage
        self.fetch(rec)
        backend = self.backend
        backend.wait(rec.h2d_event)
        backend.keep_until(rec.device_copy, backend.compute_stream())
        if rec.ahead:
            rec.ahead = False
            self.ledger.acts_used(rec.nbytes)
        return torch.empty(0, dtype=packed.dtype, device=backend.device).set_(
            rec.device_copy.untyped_storage(), packed.offset, packed.size, packed.stride
        )

    def page(self, unit, paged: bool) -> None:
        """From the next pass on (or the rest of this one: the online guard), `unit`'s saved
        activations go to host memory, or stay on the device."""
        unit.act_paged = paged

    def drop(self, unit) -> None:
        """The unit's backward is over: let go of its restored storages (autograd's own
        references, if any, keep them alive as long as it needs them)."""
        for rec in unit.acts:
            if rec.ahead:
                rec.ahead = False
                self.ledger.acts_used(rec.nbytes)
            rec.device_copy = None
        unit.acts = []

    def new_pass(self) -> None:
        """A pass begins. Call drop() first for every unit whose storages no pass still
        needs: a storage in a unit's list holds its slab region, so its piece looks held."""
        self._recent.clear()
        self.slabs.new_pass()
