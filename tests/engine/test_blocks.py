"""Finding the repeated block stack, and a model without one."""

import pytest
import torch
from helpers import max_diff, train
from torch import nn

import trainstream
from trainstream.engine.blocks import find_blocks, named_stack


class Block(nn.Module):
    def __init__(self, d, experts=0):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts)) if experts else None
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class TinyGPT(nn.Module):
    def __init__(self, d=16, layers=4, experts=0):
        super().__init__()
        self.embed = nn.Embedding(100, d)
        self.layers = nn.ModuleList(Block(d, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 100)


def test_finds_a_transformers_layers():
    model = TinyGPT()
    stack = find_blocks(model)
    assert stack.name == "layers"
    assert stack.blocks == list(model.layers)
    assert stack.params_in_blocks == sum(p.numel() for p in model.layers.parameters())
    assert stack.params_total == sum(p.numel() for p in model.parameters())
    assert "4 x Block" in stack.describe()


def test_prefers_the_layers_over_more_numerous_experts_inside_them():
    model = TinyGPT(layers=3, experts=8)
    assert find_blocks(model).name == "layers"


def test_a_sequential_mlp_is_a_stack():
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(6)])
    stack = find_blocks(model)
    assert stack.name == "" and len(stack.blocks) == 6  # the model itself


def test_mixed_or_parameterless_lists_are_not_stacks():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert find_blocks(model).blocks == []
    model = nn.ModuleDict({"drop": nn.Sequential(nn.Dropout(), nn.Dropout()), "lin": nn.Linear(2, 2)})
    stack = find_blocks(model)
    assert stack.blocks == [] and "no repeated block stack found" in stack.describe()


def test_named_stack_checks_what_the_caller_gave():
    model = TinyGPT()
    stack = named_stack(model, list(model.layers)[:2])
    assert stack.name == "layers" and len(stack.blocks) == 2
    with pytest.raises(ValueError, match=r"blocks\[0\] is not a submodule"):
        named_stack(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="same module twice"):
        named_stack(model, [model.layers[0], model.layers[0]])
    with pytest.raises(
        ValueError, match=r"blocks\[0\] \('layers.0'\) contains another listed block \('layers.0.attn'\)"
    ):
        named_stack(model, [model.layers[0], model.layers[0].attn])


def test_model_without_a_block_stack():
    def factory():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return (
            model,
            (lambda i, d: torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(d)),
            (lambda m, x: m(x).square().mean()),
        )

    stock = train("none", None, model_factory=factory)
    wrapped = train("none", {}, model_factory=factory)
    assert max_diff(stock[1], wrapped[1]) < 1e-5
    report = trainstream.memory_report(wrapped[2][0])
    assert "no repeated block stack" in report["events"]
    assert report["params"]["paged_blocks"] == [] and report["params"]["resident_blocks"] == []


def test_an_encoder_decoder_has_both_its_stacks_found_and_paged():
    import hf_models

    model = hf_models.build("t5")
    stack = find_blocks(model)
    assert stack.name == "encoder.block + decoder.block"
    assert stack.blocks == list(model.encoder.block) + list(model.decoder.block)  # the order they run in
    assert "5 x T5Block" in stack.describe()
    t5 = hf_models.factory("t5")
    paged = train(
        "t5", dict(param_offload=True, activation_offload=True, min_offload_bytes=0), steps=4, model_factory=t5
    )
    resident = train("t5", dict(param_offload=False, activation_offload=False), steps=4, model_factory=t5)
    stock = train("t5", None, steps=4, model_factory=t5)
    assert paged[0] == resident[0] and all(torch.equal(paged[1][k], resident[1][k]) for k in paged[1])
    assert max_diff(stock[1], paged[1]) < 5e-5
    report = trainstream.memory_report(paged[2][0])
    assert report["params"]["paged_blocks"] == [0, 1, 2, 3, 4]  # the encoder's blocks too


def test_lists_of_plain_torch_layers_are_not_joined():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
            self.heads = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    model = Model()
    stack = find_blocks(model)
    assert stack.name == "body" and stack.blocks == list(model.body)
