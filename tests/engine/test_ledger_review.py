"""Review R12 of the transfer ledger's room (TransferLedger.room, Adapter.stack_room): what
the plan keeps for what runs after the stack may be taken by released bytes only while it is
free. Each test here failed on the code it was written against (7a80962); each is marked
xfail(strict=True) until the engine is fixed (the mark then goes with the fix)."""

import pytest
import torch
from helpers import FakeDevice, machine
from models import tiny_gpt, tiny_mlp

import trainstream
from trainstream.api import _engine_of

MiB = 1 << 20


def _wrapped_on_fake_device(make, vram_mib, now):
    """`make`'s model wrapped on the CPU path with block 0's weights paged (so backward marks
    each block's start), its device memory simulated: (model, optimizer, engine, fake device,
    batch, loss_fn)."""
    torch.manual_seed(0)
    model, batch, loss_fn = make()
    model, opt = trainstream.wrap(
        model,
        None,
        device="cpu",
        lr=1e-2,
        offload=True,
        param_offload=[0],
        activation_offload="auto",
        profile=machine(vram_gib=vram_mib / 1024),
    )
    engine = _engine_of(model)
    return model, opt, engine, FakeDevice(engine.adapter, now), batch, loss_fn


@pytest.mark.xfail(strict=True, reason="R12 #1: stack_room counts a provisional head (a peak from before wrap)")
def test_a_head_taken_from_a_peak_before_wrap_gives_the_ledger_no_room():
    """A device peak set before wrap() (the model on the device first) that this run never
    passes is taken as the head's (after_stack_provisional: the safe side for the plan), and
    stays so until a step's peak rises past it. That figure is the earlier peak less the
    stack's end, not anything this run's head holds: the ledger must not let released bytes
    take it (Adapter.stack_room: "0 until a step has measured them"), or the host runs as far
    ahead of the GPU as the earlier peak was high."""
    model, opt, engine, fake, batch, loss_fn = _wrapped_on_fake_device(tiny_mlp, 256, 2 * MiB)
    fake.peak = 50 * MiB  # set before wrap(); this run stays below it
    for i in range(2):
        fake.now = 2 * MiB
        loss = loss_fn(model, batch(i, "cpu"))
        fake.peak = max(fake.peak, fake.now + 3 * MiB)  # the head's real rise: 3 MiB
        loss.backward()
        opt.step()
        opt.zero_grad()
    adapter = engine.adapter
    assert adapter.after_stack_provisional and adapter.after_stack == 48 * MiB  # the guess, as designed
    assert engine.ledger.room == 0, engine.ledger.room


class _Released:
    """An event of queued device work the host has not waited for: done once synchronized."""

    def __init__(self):
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


@pytest.mark.xfail(strict=True, reason="R12 #2: the room stays lent while the head runs")
def test_the_room_is_the_heads_again_when_what_runs_after_the_stack_starts():
    """The room is what the plan keeps for the head's logits and the loss, free only while the
    stack runs (TransferLedger's docstring). Released bytes that took it during the stack's
    forward are still held by queued work when the head allocates: the host must wait for
    them, down to the cap alone, before the head runs (the allocator would otherwise find the
    head's memory taken, and empty its cache to wait for them), and lend no room until
    backward reaches the stack."""
    model, opt, engine, fake, batch, loss_fn = _wrapped_on_fake_device(tiny_gpt, 256, 2 * MiB)
    ledger = engine.ledger
    seen = {}

    def head_rises(m, args, out):
        fake.peak = max(fake.peak, fake.now + 3 * MiB)  # the logits and the loss

    def last_block_starts(m, args):
        # Released bytes of the stack's forward, up to what the room lets them take.
        seen["stack_room"] = ledger.room
        nbytes = ledger.cap + ledger.room - ledger.bytes
        ledger.make_room(nbytes)
        ledger.add(_Released(), nbytes)

    def head_starts(m, args):
        seen["head_bytes"], seen["head_room"] = ledger.bytes, ledger.room

    def head_backward(m, grad):
        seen["head_backward_room"] = ledger.room

    model.head.register_forward_hook(head_rises)
    for i in range(2):
        if i == 1:  # the room was measured by the first step
            model.layers[-1].register_forward_pre_hook(last_block_starts)
            model.head.register_forward_pre_hook(head_starts)
            model.head.register_full_backward_pre_hook(head_backward)
        fake.now = 2 * MiB
        loss = loss_fn(model, batch(i, "cpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert seen["stack_room"] >= 3 * MiB  # lent while the stack runs
    assert seen["head_bytes"] <= ledger.cap, seen
    assert seen["head_room"] == 0 and seen["head_backward_room"] == 0, seen


@pytest.mark.xfail(strict=True, reason="R12 #3: backward's room ignores the plan's backward moment")
def test_backward_lends_no_room_the_plans_backward_moment_holds():
    """The plan holds the larger of two moments (planner/plan.py): the end of the forward (the
    not-paged activations, the head on top) and each block's backward (its activations and
    those fetched ahead below it, and what the head still holds), so the head's bytes are the
    backward's fetched activations' as well: they are never held at once. In backward the
    ledger may lend only what the plan leaves over its backward moment, not the head's whole
    rise less what backward finds held. Here every block's activations are paged (nothing
    kept) and the head's rise is smaller than a block's backward moment: the plan leaves
    nothing over it in backward."""
    from dataclasses import replace

    from trainstream.planner.plan import device_bytes

    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(
        model,
        None,
        device="cpu",
        lr=1e-2,
        offload=True,
        param_offload=True,
        activation_offload=True,
        min_offload_bytes=0,
        profile=machine(vram_gib=256 / 1024),
    )
    engine = _engine_of(model)
    adapter, ledger = engine.adapter, engine.ledger
    fake = FakeDevice(adapter, 2 * MiB)
    model.head.register_forward_hook(lambda m, a, out: setattr(fake, "peak", max(fake.peak, fake.now + 4096)))
    rooms = []
    for i in range(2):
        if i == 1:
            model.layers[1].register_full_backward_pre_hook(lambda m, g: rooms.append(ledger.room))
        fake.now = 2 * MiB
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    inputs = adapter._inputs(adapter.correction)
    placement = (*adapter.current(), adapter.recomputed())
    assert set(placement[1]) == set(range(len(engine.block_units)))  # every block's activations paged
    whole = device_bytes(inputs, *placement)
    without_head = device_bytes(replace(inputs, after_stack_bytes=0), *placement)  # the backward moment's
    assert adapter.after_stack_measured and not adapter.after_stack_provisional
    assert adapter.planned_after_stack() - adapter.held_after_stack > 0  # the head's rise, less nothing held
    assert whole == without_head  # the backward moment is the larger: nothing left over it
    assert rooms and all(room <= whole - without_head for room in rooms), rooms
