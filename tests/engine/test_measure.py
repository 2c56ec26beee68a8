"""Saved-activation bytes per block: measured as with the weights resident, autocast's copies
of the weights counted beside them."""

import torch
from helpers import PAGED, RESIDENT, train

import trainstream


def test_saved_activations_are_measured_per_block():
    _, _, (model, _) = train("gpt", RESIDENT, steps=3)
    measured = trainstream.memory_report(model)["plan"]["activation_bytes_per_block"]
    assert sorted(measured) == [0, 1, 2, 3]
    # Each block saves at least its input (4 x 16 tokens x 64 fp32) and its MLP hidden (4x wider).
    assert all(b >= 4 * 16 * 64 * 4 * 5 for b in measured.values()), measured
    _, _, (paged, _) = train("gpt", PAGED, steps=1)
    assert trainstream.memory_report(paged)["plan"]["activation_bytes_per_block"] == measured


def test_activations_are_recorded_as_with_the_weights_resident_autocasts_copies_included():
    """Under bf16 autocast a resident block also saves autocast's bf16 copies of its weights;
    a paged one fetches them in bf16 and saves none. Every block's activations are recorded
    as they are with its weights resident, with the copies' share beside them."""
    from trainstream.engine.measure import activations_as_placed
    from trainstream.engine.switch import stock_bytes

    _, _, (model, _) = train("gpt", dict(param_offload=[0], activation_offload=False), steps=2, autocast=torch.bfloat16)
    engine = model._trainstream_engine
    acts, casts = engine.activation_bytes, engine.activation_cast
    copies = sum(m.weight.numel() * 2 for m in model.layers[1].modules() if isinstance(m, torch.nn.Linear))
    # Block 1 (resident) saved the copies, found by their autograd history; block 0 (paged)
    # saved none, and is recorded with what it would have saved resident. Same shapes: same bytes.
    assert casts[1] == casts[0] == copies > 0
    assert acts[0] == acts[1]
    assert activations_as_placed(engine, engine.block_units[0], paged=True) == acts[0] - copies
    inp = engine.adapter._inputs(0)
    assert inp.blocks[0].act_bytes == acts[0] and inp.blocks[0].cast_bytes == copies
    need = stock_bytes(engine.units, engine.meter, engine.adapter.planned_after_stack())
    assert need["activations (measured)"] == sum(acts.values())


def test_a_weight_copy_backward_does_not_keep_is_not_counted():
    # The first Linear's input needs no gradient: backward keeps no copy of its weight (only
    # of its input); every later Linear's input does, so its weight's copy is kept.
    _, _, (model, _) = train("mlp", RESIDENT, steps=1, autocast=torch.bfloat16)
    casts = model._trainstream_engine.activation_cast
    assert casts[0] == 0 and casts[1] == model[1].weight.numel() * 2
