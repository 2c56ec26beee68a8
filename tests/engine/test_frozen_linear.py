"""engine/frozen_linear.py: frozen Linears whose weight the engine streams run as one
autograd Function that saves nothing; a block whose streamed weights are all theirs runs
without the engine's saved-tensor hooks. Training gives the bits of the engine without the
Function (FrozenLinears.install disabled: today's saved-weight path) and of stock torch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import PAGED, RESIDENT, assert_same_bits, max_diff, train
from models import MODELS, checkpointed_gpt
from torch import nn

import trainstream
from trainstream.engine.engine import Engine
from trainstream.engine.frozen_linear import FrozenLinearFunction, FrozenLinears
from trainstream.engine.params import WeightPager

FROZEN = lambda n: n.startswith("layers.") and n.endswith(("qkv.weight", "fc.weight", "out.weight"))  # noqa: E731
QUANT_RESIDENT = dict(RESIDENT, quantize="nf4")
WEIGHTS_PAGED = dict(param_offload=True, activation_offload=False)


@pytest.fixture
def without_function(monkeypatch):
    """The engine as it was before the Function: no Linear gets our forward."""

    def disable():
        monkeypatch.setattr(FrozenLinears, "install", lambda self, *a, **k: None)

    return disable


class FrozenBlock(nn.Module):
    """Frozen Linears only (one with a bias, one called twice): a paged block of these
    streams nothing but their weights."""

    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.fc1(x)
        return x + self.fc2(F.gelu(h)) + 0.5 * self.fc1(h)


class FrozenStack(nn.Module):
    """A trained embedding and head around frozen blocks; `shared`: each block's fc2 is
    fc1 (a weight registered twice)."""

    def __init__(self, d=32, layers=4, vocab=53, shared=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(FrozenBlock(d) for _ in range(layers))
        if shared:
            for blk in self.layers:
                blk.fc2.weight = blk.fc1.weight
        for p in self.layers.parameters():
            p.requires_grad_(False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for blk in self.layers:
            x = blk(x)
        return F.cross_entropy(self.head(x).float().flatten(0, 1), tgt.flatten())


def frozen_stack(shared=False):
    def factory():
        model = FrozenStack(shared=shared)

        def batch(i, device):
            g = torch.Generator().manual_seed(500 + i)
            idx = torch.randint(0, 53, (3, 10), generator=g)
            return idx.to(device), torch.roll(idx, -1, 1).to(device)

        return model, batch, lambda m, b: m(*b)

    return factory


def _count(monkeypatch, cls, name):
    """Calls of cls.name from now on, in a list (one entry per call)."""
    calls, original = [], getattr(cls, name)

    def counting(self, *args, **kwargs):
        calls.append(args[0] if args else None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counting)
    return calls


def _peft_llama():
    peft = pytest.importorskip("peft")

    def build():
        model, batch, loss_fn = MODELS["llama"]()
        config = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            bias="none",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        return peft.get_peft_model(model, config), batch, loss_fn

    return build


class _Attached:
    """A pager stand-in whose attached weight is `w`."""

    def __init__(self, w):
        self.w = w

    def attached_weight(self, slot, dtypes):
        return self.w


@pytest.mark.parametrize(
    "x_shape", [(5, 7), (3, 4, 7), (2, 1, 3, 7), (1, 7), (1, 1, 7), (6, 1), (1, 1)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_function_gives_stock_autograds_input_gradient_bit_for_bit(x_shape, bias, autocast):
    inputs = x_shape[-1]
    w = torch.randn(9, inputs)
    b = torch.randn(9) if bias else None
    x = torch.randn(x_shape)
    grad = torch.randn(*x_shape[:-1], 9)
    results = []
    for use_function in (False, True):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            if use_function:
                y = FrozenLinearFunction.apply(xi, (w, b, None, _Attached(w), None))
            else:
                y = F.linear(xi, w, b)
        y.backward(grad.to(y.dtype))
        results.append((y, xi.grad))
    (y_stock, g_stock), (y_ours, g_ours) = results
    assert_same_bits(y_ours.detach(), y_stock.detach())
    assert_same_bits(g_ours, g_stock)


def test_installed_on_the_frozen_linears_and_a_quantized_block_needs_no_hooks(monkeypatch):
    packed = _count(monkeypatch, Engine, "pack")
    backward_reads = _count(monkeypatch, WeightPager, "attached_weight")
    _, _, (model, opt) = train("gpt", QUANT_RESIDENT, steps=2, freeze=FROZEN)  # the measured passes
    engine = model._trainstream_engine
    installed = {n for n, m in model.named_modules() if "forward" in m.__dict__ and isinstance(m, nn.Linear)}
    assert installed == {f"layers.{i}.{name}" for i in range(4) for name in ("qkv", "fc", "out")}
    assert all(engine.linears.serves(u) for u in engine.block_units)
    assert backward_reads  # the Function's backward read the re-attached weights
    packed.clear()
    loss = model(*MODELS["gpt"]()[1](5, "cpu"))
    loss.backward()
    opt.step()
    assert not packed  # no saved-tensor hooks of ours: the blocks save no streamed weight


def test_unwrap_restores_the_forwards_and_a_wrapped_model_still_refuses_a_copy():
    _, _, (model, _) = train("gpt", QUANT_RESIDENT, steps=1, freeze=FROZEN)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert any("forward" in m.__dict__ for m in linears)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(model)
    plain = trainstream.unwrap(model)
    assert not any("forward" in m.__dict__ for m in plain.modules())
    copy.deepcopy(plain)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("base", [RESIDENT, WEIGHTS_PAGED, PAGED], ids=["resident", "paged", "paged+acts"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_the_same_bits_as_without_the_function(fmt, base, autocast, without_function):
    kw = dict(steps=4, autocast=autocast, freeze=FROZEN)
    opts = dict(base, quantize=fmt)
    served = train("gpt", opts, **kw)
    without_function()
    assert_same_bits(served, train("gpt", opts, **kw))


@pytest.mark.parametrize("base", [RESIDENT, WEIGHTS_PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_gives_the_same_bits_as_without_the_function(base, reentrant, without_function, monkeypatch):
    backward_reads = _count(monkeypatch, WeightPager, "attached_weight")
    opts = dict(base, quantize="nf4")
    forwards = []
    served = train("ckpt", opts, steps=3, freeze=FROZEN, model_factory=checkpointed_gpt(reentrant, forwards))
    assert len(forwards) == 3 * 4 * 2 and backward_reads
    without_function()
    assert_same_bits(served, train("ckpt", opts, steps=3, freeze=FROZEN, model_factory=checkpointed_gpt(reentrant)))


@pytest.mark.parametrize("base", [RESIDENT, WEIGHTS_PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_peft_lora_over_a_quantized_base(base, autocast, without_function, monkeypatch):
    opts = dict(base, quantize="nf4")
    packed = _count(monkeypatch, Engine, "pack")
    served = train("llama", opts, steps=4, autocast=autocast, model_factory=_peft_llama())
    engine = served[2][0]._trainstream_engine
    base_layers = [m for n, m in served[2][0].named_modules() if n.endswith("base_layer") and ".layers." in n]
    assert len(base_layers) == 21 and all("forward" in m.__dict__ for m in base_layers)
    if base is RESIDENT:
        assert all(engine.linears.serves(u) for u in engine.block_units)
        assert len(packed) < 4 * 3 * 100  # only the measured passes' blocks ran under our hooks
    without_function()
    assert_same_bits(served, train("llama", opts, steps=4, autocast=autocast, model_factory=_peft_llama()))


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_paged_blocks_of_frozen_linears_need_no_hooks_and_train_as_stock(autocast, without_function, monkeypatch):
    # Not quantized: every block paged, all of its weights frozen Linears' (one with a bias,
    # one called twice); the gradients flow through the blocks to the embedding.
    packed = _count(monkeypatch, Engine, "pack")
    kw = dict(steps=5, autocast=autocast, model_factory=frozen_stack())
    served = train("stack", WEIGHTS_PAGED, **kw)
    engine = served[2][0]._trainstream_engine
    assert all(u.paged and engine.linears.serves(u) for u in engine.block_units)
    in_measured = len(packed)
    loss = served[2][0](*frozen_stack()()[1](9, "cpu"))
    loss.backward()
    assert len(packed) == in_measured  # the pass after the measured ones: no hooks
    without_function()
    assert_same_bits(served, train("stack", WEIGHTS_PAGED, **kw))
    if autocast is None:
        stock = train("stack", None, **kw)
        assert max_diff(stock[1], served[1]) < 5e-5
        assert served[0] == pytest.approx(stock[0], rel=1e-4, abs=1e-5)


def test_a_shared_weight_keeps_todays_path(without_function):
    kw = dict(steps=3, model_factory=frozen_stack(shared=True))
    served = train("stack", WEIGHTS_PAGED, **kw)
    model = served[2][0]
    engine = model._trainstream_engine
    assert not any("forward" in m.__dict__ for blk in model.layers for m in (blk.fc1, blk.fc2))
    assert not any(engine.linears.serves(u) for u in engine.block_units)
    without_function()
    assert_same_bits(served, train("stack", WEIGHTS_PAGED, **kw))


def test_a_weight_read_outside_its_forward_brings_the_hooks_back():
    # A block that also reads fc1's weight itself (as a DoRA layer reads base_layer.weight):
    # the measured passes see it saved for backward, and its unit keeps the hooks.
    class Reading(FrozenBlock):
        def forward(self, x):
            return super().forward(x) + x @ self.fc1.weight.t() * 0.1

    def factory():
        model, batch, loss_fn = frozen_stack()()
        for i, blk in enumerate(model.layers):
            reading = Reading(32)
            reading.load_state_dict(blk.state_dict())
            reading.requires_grad_(False)
            model.layers[i] = reading
        return model, batch, loss_fn

    served = train("stack", WEIGHTS_PAGED, steps=4, model_factory=factory)
    engine = served[2][0]._trainstream_engine
    fc1 = {s for u in engine.block_units for s in u.slots if s.name.endswith("fc1.weight")}
    assert engine.linears.saved_elsewhere == fc1
    assert not any(engine.linears.serves(u) for u in engine.block_units)
    stock = train("stack", None, steps=4, model_factory=factory)
    assert max_diff(stock[1], served[1]) < 5e-5


def test_no_grad_and_inference_forwards_use_the_linears_own_forward(monkeypatch):
    _, _, (model, _) = train("gpt", QUANT_RESIDENT, steps=2, freeze=FROZEN)
    applied = []
    original = FrozenLinearFunction.forward

    def counting(*args):
        applied.append(1)
        return original(*args)

    monkeypatch.setattr(FrozenLinearFunction, "forward", staticmethod(counting))
    batch = MODELS["gpt"]()[1](3, "cpu")
    with torch.no_grad():
        a = model(*batch)
    with torch.inference_mode():
        b = model(*batch)
    assert not applied and torch.equal(a, b)
    model(*batch).backward()
    assert len(applied) == 4 * 3


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("base", [RESIDENT, WEIGHTS_PAGED], ids=["resident", "paged"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gpu_the_same_bits_as_without_the_function(fmt, base, autocast, without_function):
    kw = dict(steps=4, autocast=autocast, device="cuda", model_factory=_peft_llama())
    opts = dict(base, quantize=fmt)
    served = train("llama", opts, **kw)
    without_function()
    assert_same_bits(served, train("llama", opts, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gpu_checkpointing_gives_the_same_bits_as_without_the_function(reentrant, without_function):
    kw = dict(steps=3, freeze=FROZEN, device="cuda", autocast=torch.bfloat16)
    opts = dict(RESIDENT, quantize="nf4")
    served = train("ckpt", opts, model_factory=checkpointed_gpt(reentrant), **kw)
    without_function()
    assert_same_bits(served, train("ckpt", opts, model_factory=checkpointed_gpt(reentrant), **kw))
