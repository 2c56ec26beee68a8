"""Activation paging: saved tensors paged through checkpointing bit-exactly."""

import torch
from helpers import PAGED, RESIDENT, assert_same_bits, max_diff, train
from models import checkpointed_gpt


def test_non_reentrant_checkpointing_pages_bit_exactly():
    factory = checkpointed_gpt(reentrant=False)
    resident = train("ckpt", RESIDENT, model_factory=factory, steps=3, autocast=torch.bfloat16)
    assert_same_bits(resident, train("ckpt", PAGED, model_factory=factory, steps=3, autocast=torch.bfloat16))
    stock = train("ckpt", None, model_factory=factory, steps=3)
    assert max_diff(stock[1], train("ckpt", PAGED, model_factory=factory, steps=3)[1]) < 2e-5


def test_backward_prefetches_the_blocks_below_whole_under_a_small_inflight_cap(monkeypatch):
    """The plan holds a block's paged activations and those of the prefetch_depth blocks
    below it at once (planner/plan.py), so a max_inflight_bytes smaller than a block's
    activations must not leave the prefetch to fetches on demand: as each block's backward
    starts, every paged storage of the blocks below it in the window is on its way."""
    from trainstream.engine.engine import Engine

    seen = []
    starts = Engine.block_backward_starts

    def observed(self, unit):
        starts(self, unit)
        for below in self.block_units[max(unit.block - self.opts.prefetch_depth, 0) : unit.block]:
            seen.append((len(below.acts), sum(rec.device_copy is not None for rec in below.acts)))

    monkeypatch.setattr(Engine, "block_backward_starts", observed)
    for depth in (1, 2):
        seen.clear()
        train("gpt", dict(PAGED, max_inflight_bytes=1, prefetch_depth=depth), steps=2)
        assert seen and all(n > 1 for n, _ in seen)
        assert all(fetched == n for n, fetched in seen), seen
