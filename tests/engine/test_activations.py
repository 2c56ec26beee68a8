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
