"""The pieces that order transfers and hold host buffers: the transfer ledger and the host arena."""

import pytest
import torch


class _Event:
    def __init__(self, log, name):
        self.log, self.name, self.finished = log, name, False

    def query(self):
        return self.finished

    def synchronize(self):
        self.log.append(self.name)
        self.finished = True


def test_transfer_ledger_waits_oldest_first_until_it_fits():
    from trainstream.engine.device import DONE, TransferLedger

    log = []
    ledger = TransferLedger(cap=40)
    events = [_Event(log, i) for i in range(4)]
    for e in events:
        ledger.add(e, 10)
    ledger.add(DONE, 10**9)  # finished work holds nothing
    events[0].finished = True
    ledger.make_room(15)  # 30 held after the finished one settles: wait for one more
    assert log == [1] and ledger.bytes == 20
    ledger.make_room(100)  # more than the cap alone: wait for everything, then go ahead
    assert log == [1, 2, 3] and ledger.bytes == 0


def test_host_arena_carves_power_of_two_pieces_without_overlap():
    from trainstream.engine.device import Backend, HostArena

    shapes = [(1000,), (300, 7), (5,), (4096,), (1,), (2500, 3)] * 5
    total = sum(HostArena.size_of(s[0] * (s[1] if len(s) > 1 else 1), torch.float32) for s in shapes)
    arena = HostArena(Backend(torch.device("cpu")), total)
    taken = [arena.take(s, torch.float32) for s in shapes]
    assert arena.remaining == 0 and all(p.numel() & (p.numel() - 1) == 0 for p in arena.pieces)
    assert arena.reserved < 2 * total
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in taken)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    with pytest.raises(RuntimeError, match="exhausted"):
        arena.take((1,), torch.float32)


def test_transfer_ledger_counts_weights_fetched_ahead_against_the_same_cap():
    from trainstream.engine.device import TransferLedger

    log = []
    ledger = TransferLedger(cap=100)
    assert ledger.may_fetch_ahead(150)  # the first prefetch always goes, whatever its size
    ledger.fetched_ahead(60)
    assert ledger.may_fetch_ahead(40) and not ledger.may_fetch_ahead(41)
    held = _Event(log, "held")
    ledger.add(held, 30)
    ledger.make_room(10)  # released bytes alone: 30 + 10 fit
    assert log == []
    ledger.make_room_for_weights(20)  # 30 released + 60 ahead + 20 do not: wait for the release
    assert log == ["held"] and ledger.bytes == 0
    ledger.used(60)
    assert ledger.ahead == 0 and ledger.may_fetch_ahead(100)


def test_a_weight_fetch_does_not_wait_for_activations_on_their_way_out():
    """The plan budgets the weights in flight apart from the activations forward pages out:
    the next block's weights wait for other released bytes, oldest first, never for those
    copies; any other make_room() waits for them as for everything released."""
    from trainstream.engine.device import TransferLedger

    log = []
    ledger = TransferLedger(cap=100)
    acts = [_Event(log, f"acts{i}") for i in range(3)]
    grads = _Event(log, "grads")
    ledger.add(acts[0], 40, outgoing_activations=True)
    ledger.add(grads, 30)
    ledger.add(acts[1], 40, outgoing_activations=True)
    assert ledger.bytes == 110 and ledger.outgoing == 80
    ledger.make_room_for_weights(60)  # 30 + 60 fit beside the outgoing 80
    assert log == []
    ledger.make_room_for_weights(80)  # 30 + 80 do not: the gradients' copy, not the older activations'
    assert log == ["grads"] and ledger.bytes == 80 and ledger.outgoing == 80
    ledger.make_room_for_weights(500)  # only outgoing activations left: nothing to wait for
    assert log == ["grads"]
    ledger.add(acts[2], 40, outgoing_activations=True)
    ledger.make_room(30)  # 120 + 30 released: the oldest activations go first
    assert log == ["grads", "acts0", "acts1"] and ledger.bytes == 40 and ledger.outgoing == 40


def test_activations_fetched_ahead_count_apart_against_the_larger_of_cap_and_window():
    """Backward's prefetch of the blocks below: limited by the caller's window (the paged
    activations the plan holds at once) where that exceeds the cap; weights fetched ahead
    neither limit it nor are limited by it."""
    from trainstream.engine.device import TransferLedger

    ledger = TransferLedger(cap=100)
    ledger.fetched_ahead(90)
    assert ledger.may_fetch_acts_ahead(150, window=0)  # the first always goes
    ledger.acts_fetched_ahead(150)
    assert not ledger.may_fetch_acts_ahead(1, window=0)  # past the cap
    assert ledger.may_fetch_acts_ahead(150, window=300) and not ledger.may_fetch_acts_ahead(151, window=300)
    assert ledger.may_fetch_ahead(10) and not ledger.may_fetch_ahead(11)  # weights: 90 of their own
    ledger.acts_used(150)
    assert ledger.acts_ahead == 0 and ledger.ahead == 90
