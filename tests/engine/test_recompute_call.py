"""Which block calls the planner may recompute in backward, and the checkpoint call: a call that
carries a key/value cache and a block that updates its own state in forward are paged instead
(recomputing them would update the cache or the statistics twice); the call's keywords and the
device's RNG state reach the recompute."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_bits, planned_recompute, train
from models import MODELS
from torch import nn

import trainstream
from trainstream.engine.recompute_call import cache_in_call, recompute_call, state_in_forward, why_not_recompute


class FakeCache:  # what a transformers Cache offers, as far as the check reads it
    def update(self, *a):
        pass

    def get_seq_length(self):
        return 0


def test_a_normalization_tracking_statistics_in_training_is_state_in_forward():
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert "BatchNorm1d (1) updates its running statistics" in state_in_forward(block)
    assert state_in_forward(block.eval()) is None
    assert state_in_forward(nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False))) is None
    assert state_in_forward(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))) is None
    assert "InstanceNorm1d" in state_in_forward(nn.InstanceNorm1d(4, track_running_stats=True))


def test_a_call_carrying_a_cache_updates_it():
    assert "use_cache=True" in cache_in_call((), {"use_cache": True})
    assert "past_key_values" in cache_in_call((), {"past_key_values": object()})
    assert "layer_past" in cache_in_call((), {"layer_past": (torch.ones(1),)})
    assert "key/value cache" in cache_in_call((torch.ones(1), FakeCache()), {})
    assert cache_in_call((torch.ones(1),), {"past_key_values": None, "use_cache": False, "mask": None}) is None
    block = nn.Linear(2, 2)
    assert why_not_recompute(block, (torch.ones(1),), {}) is None
    assert why_not_recompute(block, (), {"use_cache": True}) is not None


class KwBlock(nn.Module):
    """A block with dropout, called with keywords only, one of them named as checkpoint's own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, *, x, preserve_rng_state=1.0):
        return self.drop(self.fc(x)) * preserve_rng_state


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_recompute_gets_the_calls_keywords_and_its_forwards_rng_state(device):
    """Against the same call without a checkpoint: the same output and gradients (the dropout
    mask recomputed from the forward's RNG state, on the device too, though no positional
    tensor is on it), a keyword named like checkpoint's own reaching the block, and the device
    generator where the plain run leaves it."""
    torch.manual_seed(0)
    block = KwBlock().to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    results = []
    for recompute in (False, True):
        torch.manual_seed(1)
        kwargs = dict(x=x, preserve_rng_state=3.0)
        out = recompute_call(block, (), kwargs, torch.device(device)) if recompute else block(**kwargs)
        out.sum().backward()
        rng = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
        results.append((out.detach().clone(), x.grad.clone(), block.fc.weight.grad.clone(), rng))
        x.grad = None
        block.zero_grad()
    (out0, gx0, gw0, rng0), (out1, gx1, gw1, rng1) = results
    assert torch.equal(out0, out1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    assert torch.equal(rng0, rng1)


# -- the engine: such blocks are paged where the plan would recompute them -----------------------


def _llama_with_cache():
    """The tests' tiny Llama with use_cache on (its configs' default) and a padding mask."""
    base = MODELS["llama"]

    def build():
        model, batch, _ = base()
        model.config.use_cache = True
        model.config._attn_implementation = "eager"

        def loss_fn(m, ids):
            mask = torch.ones_like(ids)
            mask[0, :3] = 0  # left padding
            return m(input_ids=ids, attention_mask=mask, labels=ids).loss

        return model, batch, loss_fn

    return build


def test_a_block_called_with_a_cache_is_paged_instead_of_recomputed(monkeypatch):
    pytest.importorskip("transformers")
    factory = _llama_with_cache()
    options = dict(activation_offload="auto", param_offload=False)
    with planned_recompute(monkeypatch, []):
        kept = train("llama", options, steps=3, model_factory=factory)
    with planned_recompute(monkeypatch, [0, 2]):
        planned = train("llama", options, steps=3, model_factory=factory)
    report = trainstream.memory_report(planned[2][0])
    assert report["params"]["recompute_blocks"] == []
    assert {0, 2} <= set(report["params"]["activation_paged_blocks"])
    assert "use_cache=True" in report["events"] and "paged instead" in report["events"]
    assert_same_bits(kept, planned)


class NormBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + self.bn(torch.relu(self.fc(x)))


def _norm_stack():
    def build():
        model = nn.Sequential(*[NormBlock() for _ in range(4)])

        def batch(i, device):
            return torch.randn(8, 16, generator=torch.Generator().manual_seed(4000 + i)).to(device)

        return model, batch, lambda m, x: m(x).pow(2).mean()

    return build


def test_a_block_updating_its_statistics_in_forward_is_paged_instead_of_recomputed(monkeypatch):
    options = dict(activation_offload="auto", param_offload=False)
    with planned_recompute(monkeypatch, []):
        kept = train("mlp", options, steps=3, model_factory=_norm_stack())
    with planned_recompute(monkeypatch, [0, 2]):
        planned = train("mlp", options, steps=3, model_factory=_norm_stack())
    report = trainstream.memory_report(planned[2][0])
    assert report["params"]["recompute_blocks"] == []
    assert "running statistics" in report["events"]
    # The running statistics and the batch counts too: state_dict holds the buffers.
    assert_same_bits(kept, planned)
    assert planned[1]["0.bn.num_batches_tracked"].item() == 3
