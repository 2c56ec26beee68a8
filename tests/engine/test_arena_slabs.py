"""HostSlabs, the pinned host memory of paged activations ([Note: activation slabs] in
engine/device.py): storages carved exactly from a few pieces, carved again by each pass once
nothing holds them, never while a graph still holds its saved tensors; and the paging it
serves stays bit-exact."""

import pytest
import torch
from helpers import PAGED, RESIDENT, assert_same_bits
from models import tiny_gpt

import trainstream
from trainstream.api import _engine_of
from trainstream.engine.device import Backend, HostSlabs

CPU = Backend(torch.device("cpu"))
MiB = 1 << 20


def _span(t):
    return t.data_ptr(), t.data_ptr() + t.numel()


def _piece_of(slabs, t) -> int:
    return next(k for k, p in enumerate(slabs.pieces) if _span(p)[0] <= t.data_ptr() and _span(t)[1] <= _span(p)[1])


def test_a_pass_carves_exact_aligned_regions_apart_from_each_other():
    slabs = HostSlabs(CPU)
    slabs.new_pass()
    sizes = [1000, 64, 1, 300_000, 5, 700_000, 128, 2_000_000, 77]
    regions = [slabs.take(n) for n in sizes]
    assert [r.numel() for r in regions] == sizes and all(r.dtype == torch.uint8 for r in regions)
    assert all(r.data_ptr() % HostSlabs.ALIGN == 0 for r in regions)
    spans = sorted(_span(r) for r in regions)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    for r in regions:
        _piece_of(slabs, r)  # inside one piece
    sizes_pinned = [p.numel() for p in slabs.pieces]
    assert all(s & (s - 1) == 0 for s in sizes_pinned)
    # 1 MiB, then 2 MiB for the 2 MB storage: less than one power of two per storage, as the
    # caching host allocator pins them (3.5 MiB here)
    assert slabs.reserved == 3 * MiB < sum(1 << (n - 1).bit_length() for n in sizes)


def test_new_pieces_grow_with_the_pool_from_min_to_max_piece(monkeypatch):
    monkeypatch.setattr(HostSlabs, "MAX_PIECE", 8 * MiB)
    slabs = HostSlabs(CPU)
    slabs.new_pass()
    held = [slabs.take(MiB - 64) for _ in range(40)]
    sizes = [p.numel() // MiB for p in slabs.pieces]
    # a quarter of the pool so far, as a power of two, at least MIN_PIECE: 1 MiB until the
    # pool holds 5 MiB, then 2, 2 (7 MiB), 4 (9), 4 (13), 8 (17) = MAX_PIECE from then on
    assert sizes[:10] == [1, 1, 1, 1, 1, 2, 2, 4, 4, 8] and set(sizes[10:]) == {8}
    assert len(sizes) == 12  # 8 storages in each 8 MiB piece: 17 + 8 + 8 + 7
    big = slabs.take(20 * MiB)  # larger than MAX_PIECE: a piece of its own power of two
    assert slabs.pieces[_piece_of(slabs, big)].numel() == 32 * MiB
    assert len(held) == 40


def test_the_next_pass_carves_the_same_memory_once_nothing_holds_it():
    slabs = HostSlabs(CPU)
    sizes = [5000, 123_456, 64, 999_999]
    slabs.new_pass()
    first = [_span(slabs.take(n)) for n in sizes]  # the regions die at once
    reserved = slabs.reserved
    for _ in range(3):
        slabs.new_pass()
        again = [_span(slabs.take(n)) for n in sizes]
        assert again == first
    assert slabs.reserved == reserved


def test_a_held_region_keeps_its_piece_out_of_the_next_pass():
    slabs = HostSlabs(CPU)
    slabs.new_pass()
    kept = slabs.take(1000)
    kept.fill_(7)
    slabs.new_pass()
    other = [slabs.take(1000) for _ in range(10)]
    for r in other:
        r.fill_(1)
        assert _piece_of(slabs, r) != _piece_of(slabs, kept)
    assert torch.all(kept == 7)
    del kept, other
    slabs.new_pass()
    reserved = slabs.reserved
    slabs.take(1000)
    assert slabs.reserved == reserved  # both pieces free again: nothing new pinned


def test_a_storage_goes_to_the_first_piece_with_room_and_a_free_piece_too_small_waits():
    slabs = HostSlabs(CPU)
    slabs.new_pass()
    slabs.take(1000)  # piece 0: MIN_PIECE
    slabs.new_pass()
    big = slabs.take(3 * MiB)  # piece 0 is free but too small: piece 1, 4 MiB
    small = slabs.take(2 * MiB)  # not in piece 1's last MiB, nor piece 0: piece 2, 2 MiB
    tiny = slabs.take(100)  # first fit: the tail of piece 1
    rest = slabs.take(900_000)  # still piece 1's tail
    more = slabs.take(500_000)  # no room in pieces 1 and 2: piece 0, free since the last pass
    assert [_piece_of(slabs, t) for t in (big, small, tiny, rest, more)] == [1, 2, 1, 1, 0]
    assert [p.numel() for p in slabs.pieces] == [MiB, 4 * MiB, 2 * MiB]
    del big, small, tiny, rest, more
    slabs.new_pass()
    exact = slabs.take(4 * MiB)  # fills piece 1 (4 MiB), the first free piece it fits
    assert _piece_of(slabs, exact) == 1
    assert _piece_of(slabs, slabs.take(10)) == 0 and len(slabs.pieces) == 3


# -- the engine's paging through it ---------------------------------------------------------------------


def _run(options, steps=3, hold_two=False, dropped_graph=False):
    """tiny_gpt for `steps` steps; with `hold_two`, two forwards are held and then both go
    back in one backward (the first graph's saved tensors are held during the second
    forward); with `dropped_graph`, each step begins with a forward under grad whose graph
    is dropped unused (an eval loss computed without no_grad). Losses, final state and the
    slabs' reserved bytes after each step."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, **options)
    losses, reserved = [], []
    for step in range(steps):
        if dropped_graph:
            losses.append(loss_fn(model, batch(100 + step, "cpu")).item())  # its graph goes at once
        if hold_two:
            a = loss_fn(model, batch(2 * step, "cpu"))
            b = loss_fn(model, batch(2 * step + 1, "cpu"))
            (a + b).backward()
            losses += [a.item(), b.item()]
        else:
            loss = loss_fn(model, batch(step, "cpu"))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        reserved.append(_engine_of(model).acts.slabs.reserved)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, state, reserved


@pytest.mark.parametrize("hold_two", [False, True], ids=["one graph", "two graphs held"])
def test_paged_activations_through_the_slabs_are_bit_exact(hold_two):
    resident = _run(RESIDENT, hold_two=hold_two)
    paged = _run(PAGED, hold_two=hold_two)
    assert resident[0] == paged[0]
    assert resident[1].keys() == paged[1].keys()
    for k in resident[1]:
        assert_same_bits(resident[1][k], paged[1][k])
    assert paged[2][0] > 0 and paged[2] == [paged[2][0]] * len(paged[2])  # pinned in the first step only


def test_a_forward_whose_graph_is_dropped_leaves_the_pool_as_it_was():
    # The dropped graph's storages stayed in their blocks' lists until the next forward
    # reached each block, after the pass had begun: their pieces looked held, and the pool
    # doubled for good.
    plain = _run(PAGED)
    resident, paged = _run(RESIDENT, dropped_graph=True), _run(PAGED, dropped_graph=True)
    assert paged[2] == plain[2]
    assert resident[0] == paged[0]
    for k in resident[1]:
        assert_same_bits(resident[1][k], paged[1][k])


def test_the_pager_reports_the_slabs_reserved_bytes():
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, **PAGED)
    pager = _engine_of(model).acts
    assert pager.slab_bytes == 0
    loss_fn(model, batch(0, "cpu")).backward()
    assert pager.slab_bytes == sum(p.numel() for p in pager.slabs.pieces) > 0


def test_the_slabs_reused_too_early_would_show(monkeypatch):
    # The two-graphs run above fails if a pass may carve what the first graph still holds:
    # the first graph's backward would read the second forward's activations.
    original = HostSlabs.new_pass

    def careless(self):
        original(self)
        self._free = list(range(len(self.pieces)))

    resident = _run(RESIDENT, steps=1, hold_two=True)
    monkeypatch.setattr(HostSlabs, "new_pass", careless)
    careless_run = _run(PAGED, steps=1, hold_two=True)
    assert any(not torch.equal(resident[1][k], careless_run[1][k]) for k in resident[1])


@pytest.mark.gpu
def test_cuda_slabs_are_pinned_and_paging_stays_bit_exact():
    def run(options):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        model, opt = trainstream.wrap(model, opt, device="cuda", offload=True, **options)
        losses = []
        for step in range(3):
            loss = loss_fn(model, batch(step, "cuda"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        torch.cuda.synchronize()
        return losses, {k: v.cpu() for k, v in model.state_dict().items()}, _engine_of(model)

    resident, paged = run(RESIDENT), run(PAGED)
    assert resident[0] == paged[0]
    for k in resident[1]:
        assert_same_bits(resident[1][k], paged[1][k])
    slabs = paged[2].acts.slabs
    assert slabs.pieces and all(p.is_pinned() for p in slabs.pieces)
