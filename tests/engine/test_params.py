"""Weights on the device: paged weights are placeholders between uses, the guard, and blocks
moved between paged and resident."""

import torch
from helpers import PAGED, assert_same_bits, gpt_steps, train

from trainstream.engine.adapt import Replan


def test_guard_params_false_gives_the_same_run():
    assert_same_bits(
        train("gpt", dict(PAGED, guard_params=True), steps=3), train("gpt", dict(PAGED, guard_params=False), steps=3)
    )


def test_paged_weights_are_placeholders_between_uses():
    _, _, (model, _) = train("gpt", PAGED, steps=1)
    w = model.layers[0].qkv.weight
    assert w.shape == (192, 64) and w.untyped_storage().nbytes() == 4 and torch.isnan(w).all()
    assert model.layers[0].qkv.weight.dtype == torch.float32


def _train_and_move(mode: str) -> dict:
    """Three steps with every block resident, blocks 0 and 1 paged, three more steps, block 0
    back: the host weights of a unit updated on the device must be brought level first."""

    def move(i, engine):
        if i in (3, 6):  # between steps, where the engine applies the adapter's replans
            engine.apply(Replan([0, 1] if i == 3 else [1], []))

    model, _ = gpt_steps(mode, steps=9, before_step=move)
    engine = model._trainstream_engine
    assert [u.paged for u in engine.block_units] == [False, True, False, False]
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_gpu_mode_blocks_moved_between_steps_keep_their_weights():
    host, device = _train_and_move("cpu"), _train_and_move("gpu")
    for k in host:
        assert torch.equal(host[k], device[k]), k
