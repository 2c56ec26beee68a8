"""What the engine keeps per parameter: the host copies a slot holds."""

import torch
from helpers import PAGED, train


def test_autocast_pages_linear_weights_in_bf16():
    _, _, (model, _) = train("gpt", PAGED, autocast=torch.bfloat16, steps=2)
    engine = model._trainstream_engine
    slots = {s.name: s for u in engine.block_units for s in u.slots}
    assert torch.bfloat16 in slots["layers.0.qkv.weight"].host  # Linear: bf16 copy kept by the optimizer
    assert torch.bfloat16 not in slots["layers.0.ln1.weight"].host  # LayerNorm runs in fp32 under autocast
