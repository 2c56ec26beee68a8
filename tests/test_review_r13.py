"""Review R13: defects found in engine/pinned.py (registered host memory) and in the fused
cross-entropy row op (ops/loss_rows.py): a strict xfail while a defect is not fixed, the test of
its fix once it is.

On the CPU the CUDA runtime is a fake that records its calls (as tests/engine/test_pinned.py
does); the mappings, their views, their lifetimes and the forks are real."""

import ctypes
import io
import mmap
import os

import numpy as np
import pytest
import torch

from trainstream.engine import pinned
from trainstream.ops.loss_rows import loss_and_dlogits_

CUDA0 = torch.device("cuda", 0)
MiB = 1 << 20


class FakeRuntime:
    def __init__(self):
        self.calls = []

    def current_device(self) -> int:
        return 0

    def register(self, ptr, nbytes, index):
        self.calls.append("register")
        return 0, ""

    def synchronize(self, index):
        self.calls.append("synchronize")

    def unregister(self, ptr, index):
        self.calls.append("unregister")
        return 0


@pytest.fixture
def fake(monkeypatch):
    runtime = FakeRuntime()
    monkeypatch.setattr(pinned, "_runtime", runtime)
    monkeypatch.setattr(pinned, "_note", None)
    monkeypatch.setattr(pinned, "_live", [0, 0])
    return runtime


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _in_child(body) -> int:
    """Runs body() in a forked child and gives its exit code (a signal: minus its number).
    The child runs no torch op (torch's intra-op pool does not survive a fork), no
    collection, and leaves by os._exit; a crash there writes no core file."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            import faulthandler
            import resource

            faulthandler.disable()
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            code = body()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _map_until_inside(lo: int, hi: int, tries: int = 8):
    """Maps pieces of anonymous memory of hi - lo bytes in this process until one lies in
    [lo, hi): (that piece, all pieces mapped), or (None, all pieces) after `tries`. A piece
    of the hole's own size: when the parent's mapping was made, no higher gap (top-down
    layout) held that many bytes, so the kernel's first choice is the hole, if it is free."""
    pieces = []
    for _ in range(tries):
        m = mmap.mmap(-1, hi - lo)
        pieces.append(m)
        if lo <= _address(m) < hi:
            return m, pieces
    return None, pieces


def test_a_forked_childs_own_memory_never_takes_the_addresses_of_its_parents_buffers(fake):
    t = pinned.host_bytes(8 * MiB, CUDA0)
    lo, hi = t.data_ptr(), t.data_ptr() + 8 * MiB

    def child():
        inside, _pieces = _map_until_inside(lo, hi)
        return 0 if inside is None else 1

    assert _in_child(child) == 0
    assert fake.calls == ["register"]


def test_a_forked_child_dropping_an_inherited_buffer_keeps_its_own_memory_mapped(fake):
    t = pinned.host_bytes(8 * MiB, CUDA0)
    lo, hi = t.data_ptr(), t.data_ptr() + 8 * MiB
    holder = [t]
    del t

    def child():
        own, _pieces = _map_until_inside(lo, hi)
        if own is not None:
            own[0] = 7
        holder.clear()  # the child's copy of the buffer, the mapping's only holder, dies here
        if own is not None and own[0] != 7:  # a read of the child's own memory
            return 1
        return 0

    assert _in_child(child) == 0
    assert fake.calls == ["register"]  # neither process unregistered the parent's buffer
    assert int(holder[0].count_nonzero()) == 0  # the parent's pages, untouched by the child


def _share_memory(view):
    view.share_memory_()


def _forking_pickle(view):
    # what multiprocessing's Queue.put, a spawned DataLoader worker's dataset and mp.spawn's
    # arguments do to a CPU tensor (torch.multiprocessing's reduction moves it to shared memory)
    import multiprocessing.reduction

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions)

    multiprocessing.reduction.ForkingPickler(io.BytesIO()).dump(view)


@pytest.mark.xfail(
    strict=True,
    reason="R13: torch moves a storage into shared memory by swapping its data pointer, so "
    "share_memory_() or a ForkingPickler of any view of a HostArena piece (a paged param's "
    "host weights; model.state_dict() hands out aliases with their own storage since "
    "state._own_storage) drops the mapping while other views live: the piece is unregistered "
    "and unmapped, every view moves to unpinned shared memory, and a mapped CUDA view "
    "(params._mapped_view, a paged param's .data) keeps the old, now unmapped, host address",
)
@pytest.mark.parametrize("move", [_share_memory, _forking_pickle], ids=["share_memory_", "ForkingPickler"])
def test_a_registered_buffer_stays_registered_at_its_address_while_a_view_of_it_lives(fake, move):
    t = pinned.host_bytes(2 * MiB, CUDA0)
    ptr = t.data_ptr()
    move(t[: 4 * 1024].view(torch.float32))
    assert t.data_ptr() == ptr
    assert fake.calls == ["register"] and pinned.registered() == (1, 2 * MiB)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_logits_not_aligned_to_their_element_size_are_refused_naming_z(dtype):
    rows, vocab = 3, 40
    itemsize = dtype.itemsize
    raw = np.zeros(rows * vocab * itemsize + itemsize, dtype=np.uint8)[itemsize // 2 :]
    raw = raw[: rows * vocab * itemsize]
    z = torch.from_numpy(raw.view(np.float16 if dtype == torch.float16 else np.float32).reshape(rows, vocab))
    assert z.data_ptr() % itemsize != 0 and z.dtype == dtype
    column = torch.zeros(rows, dtype=torch.int64)
    valid = torch.ones(rows, dtype=torch.bool)
    scale = torch.ones(rows)
    with pytest.raises(ValueError, match=r"z.*align"):
        loss_and_dlogits_(z, column, valid, scale, True)


def test_an_out_that_aliases_an_input_is_refused_naming_out():
    rows, vocab = 4, 16
    z = torch.randn(rows, vocab)
    column = torch.zeros(rows, dtype=torch.int64)
    valid = torch.ones(rows, dtype=torch.bool)
    scale = torch.ones(rows)
    with pytest.raises(ValueError, match=r"out.*(overlap|alias)"):
        loss_and_dlogits_(z, column, valid, scale, True, out=scale)


@pytest.mark.gpu
def test_gpu_a_block_of_more_than_two_to_the_31_elements_matches_the_twin_in_its_last_rows():
    """Not a defect (the kernel indexes in 64 bits): a guard for the brief's overflow case, a
    chunk whose last rows start past 2**31 elements (16384 x 256000 is 4.2e9), against the
    twin on those rows."""
    from test_loss_rows import _assert_dlogits_close, _assert_losses_close, _row_args, _twin

    rows, vocab, dtype = 8400, 256000, torch.bfloat16
    assert (rows - 1) * vocab > 2**31  # the last row's first element
    z = torch.randn(rows, vocab, dtype=dtype, device="cuda").mul_(3.0)
    column, valid, scale = _row_args(rows, vocab, dtype, "cuda")
    tail = slice(rows - 4, rows)
    twin_loss, twin_z = _twin(z[tail], column[tail], valid[tail], scale[tail], True)
    loss = loss_and_dlogits_(z, column, valid, scale, True)
    _assert_losses_close(loss[tail], twin_loss)
    _assert_dlogits_close(z[tail], twin_z, column[tail], valid[tail], scale[tail])


def test_torch_save_of_a_wrapped_models_state_dict_writes_about_its_own_bytes():
    from helpers import PAGED, train

    model = train("gpt", PAGED, device="cpu")[2][0]
    state = model.state_dict()
    own = sum(v.numel() * v.element_size() for v in state.values())
    saved = io.BytesIO()
    torch.save(state, saved)
    assert len(saved.getvalue()) <= 1.1 * own + 64 * 1024  # the pickle and zip records besides
