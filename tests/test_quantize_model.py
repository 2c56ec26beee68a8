"""quantize_model(): frozen block weights stored as codes in place, before wrap(), and kept by
wrap() as they are; which weights of the layer zoo (nn.Linear, GPT-2's Conv1D, fused MoE
expert tensors) are stored quantized, and the events naming what is not.

The reference for a quantized model is the same model whose quantized weights hold their
quantize-dequantize values instead: it must compute, save and train to the same bits."""

import hf_models
import pytest
import torch
from helpers import PAGED, RESIDENT, assert_same_bits, train

import trainstream
from trainstream import ops
from trainstream.engine.layout import NOT_MATMUL
from trainstream.quant import QuantizedWeight, stored

BLOCK_WEIGHT = lambda n: ".layers." in n and n.endswith("proj.weight")  # noqa: E731


def _frozen(kind, frozen=BLOCK_WEIGHT, seed=0):
    model = hf_models.build(kind, seed=seed)
    for n, p in model.named_parameters():
        p.requires_grad_(not frozen(n))
    return model


def _round_trip(model, names, fmt, block_size=64):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in names:
                p.copy_(QuantizedWeight.quantize(p, fmt, block_size).dequantize())
    return model


def _held(model) -> dict:
    return {n: stored.codes_of(p) for n, p in model.named_parameters() if stored.codes_of(p) is not None}


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_codes_are_the_ops_codes_of_each_frozen_block_weight(fmt):
    model = _frozen("llama")
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    result = trainstream.quantize_model(model, fmt, block_size=32)
    held = _held(model)
    assert sorted(held) == sorted(n for n in original if BLOCK_WEIGHT(n))  # 7 Linear weights x 3 blocks
    quantize = ops.quantize_nf4 if fmt == "nf4" else ops.quantize_int8
    for n, q in held.items():
        codes, absmax = quantize(original[n], 32)
        assert torch.equal(q.codes, codes) and torch.equal(q.absmax, absmax), n
        assert q.block_size == 32 and q.shape == original[n].shape and q.dtype == original[n].dtype
        p = dict(model.named_parameters())[n]
        assert p is params[n]  # the same parameter object: optimizers and peft still refer to it
        assert p.untyped_storage().nbytes() == 4 and torch.isnan(p).all()  # no values kept
    assert result == {
        "tensors": 21,
        "bytes_before": sum(original[n].numel() * 4 for n in held),
        "bytes_after": sum(q.nbytes for q in held.values()),
    }
    again = trainstream.quantize_model(model, fmt)  # codes already held are left as they are
    assert again == {"tensors": 0, "bytes_before": 0, "bytes_after": 0}
    assert all(stored.codes_of(params[n]) is held[n] for n in held)


def test_a_quantized_model_computes_saves_and_backpropagates_as_its_round_trip():
    model = _frozen("llama")
    reference = _round_trip(_frozen("llama"), {n for n, _ in model.named_parameters() if BLOCK_WEIGHT(n)}, "nf4")
    trainstream.quantize_model(model)
    ids = hf_models.batch(0)
    losses = []
    for m in (model, reference):
        loss = hf_models.loss_fn(m, ids)
        loss.backward()
        losses.append(loss)
    assert_same_bits(losses[0].detach(), losses[1].detach())
    grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads[n].grad is None), n
        if p.grad is not None:
            assert_same_bits(p.grad, grads[n].grad)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert_same_bits(ours[k], theirs[k])
    param = model.model.layers[0].self_attn.q_proj.weight  # forward put the parameter back
    assert isinstance(param, torch.nn.Parameter) and stored.codes_of(param) is not None
    with pytest.raises(RuntimeError):  # writing into the placeholder fails, it does not write one element
        model.load_state_dict(theirs)


def _prequantized(kind, fmt):
    def build():
        model = _frozen(kind)
        trainstream.quantize_model(model, fmt)
        return model, hf_models.batch, hf_models.loss_fn

    return build


def _reference(kind, fmt):
    def build():
        model = _frozen(kind)
        names = {n for n, _ in model.named_parameters() if BLOCK_WEIGHT(n)}
        return _round_trip(model, names, fmt), hf_models.batch, hf_models.loss_fn

    return build


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_wrap_keeps_the_codes_and_trains_as_the_round_trip(fmt):
    model_factory = _prequantized("llama", fmt)
    kept = {}

    def remembering():
        model, batch, loss = model_factory()
        kept.update(_held(model))
        return model, batch, loss

    # quantize="none": there are no values left to keep unquantized; the codes are served as they are
    resident = train("llama", dict(RESIDENT, quantize="none"), steps=4, model_factory=remembering)
    engine = resident[2][0]._trainstream_engine
    slots = {s.name: s for u in engine.units for s in u.slots}
    for n, q in kept.items():  # the very codes quantize_model made, not quantized a second time
        assert slots[n].quant.codes.data_ptr() == q.codes.data_ptr(), n
    report = trainstream.memory_report(resident[2][0])
    assert report["plan"]["quantized"]["tensors"] == 21
    assert f"21 frozen weights arrived quantized as {fmt}" in report["events"]
    paged = train("llama", dict(PAGED, quantize="nf4"), steps=4, model_factory=_prequantized("llama", fmt))
    reference = train("llama", RESIDENT, steps=4, model_factory=_reference("llama", fmt))
    assert_same_bits(resident, reference)
    assert_same_bits(paged, reference)
    assert resident[0][-1] < resident[0][0]


def test_wrap_refuses_codes_it_cannot_serve():
    model = _frozen("llama")
    trainstream.quantize_model(model)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    q_proj.requires_grad_(True)
    with pytest.raises(ValueError, match=r"q_proj.weight holds quantized codes and requires grad: .*requires_grad_"):
        trainstream.wrap(model, device="cpu", offload=True)
    q_proj.requires_grad_(False)
    with pytest.raises(ValueError, match="outside the block stack"):  # a stack that leaves them outside
        trainstream.wrap(model, device="cpu", offload=True, blocks=[model.model.norm, model.lm_head])
    with pytest.raises(ValueError, match="cannot hold quantized codes"):
        stored.store(model.lm_head, "weight", QuantizedWeight.quantize(model.lm_head.weight.detach()), block=model)


def test_bad_arguments_name_themselves():
    model = _frozen("llama")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        trainstream.quantize_model("llama")
    for fmt in ("fp8", "NF4", None, "none", 4):
        with pytest.raises(ValueError, match=r"quantize must be one of \['nf4', 'int8'\]"):
            trainstream.quantize_model(model, fmt)
    for size in (3, 0, True, 8192, 64.0):
        with pytest.raises(ValueError, match="block_size must be an even integer >= 2 and <= 4096"):
            trainstream.quantize_model(model, block_size=size)
    for budget in (0, 1 << 30, "1GiB"):
        with pytest.raises(ValueError, match="pin_budget accepts only None"):
            trainstream.quantize_model(model, pin_budget=budget)
    for blocks in ("layers", [], [1, 2]):
        with pytest.raises(ValueError, match="blocks must be None or a non-empty list of modules"):
            trainstream.quantize_model(model, blocks=blocks)
    with pytest.raises(ValueError, match="is not a submodule of the model"):
        trainstream.quantize_model(model, blocks=[torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="no repeated block stack found"):
        trainstream.quantize_model(torch.nn.Linear(4, 4).requires_grad_(False))
    assert not _held(model)  # nothing was changed by a refused call
    wrapped, _ = trainstream.wrap(model, device="cpu", offload=True)
    with pytest.raises(ValueError, match="the model is wrapped"):
        trainstream.quantize_model(wrapped)


def test_explicit_blocks_are_quantized_and_nothing_else():
    model = _frozen("llama", frozen=lambda n: "proj.weight" in n)
    layers = list(model.model.layers)
    result = trainstream.quantize_model(model, blocks=layers[:2])
    assert result["tensors"] == 14
    assert sorted({n.split(".")[2] for n in _held(model)}) == ["0", "1"]


# -- the layer zoo: which weights are stored quantized -------------------------------------------


def _frozen_everything_in_blocks(kind):
    model = hf_models.build(kind)
    for n, p in model.named_parameters():
        p.requires_grad_(not any(f".{k}." in n for k in ("h", "layers")))
    return model


def _wrapped_quantized(kind, fmt="nf4"):
    model = _frozen_everything_in_blocks(kind)
    model, _ = trainstream.wrap(model, device="cpu", offload=True, quantize=fmt, **RESIDENT)
    engine = model._trainstream_engine
    slots = [s for u in engine.units if u.block is not None for s in u.slots]
    return model, {s.name: s for s in slots if s.quant is not None}, slots


@pytest.mark.parametrize(
    "kind, weights, matrices_kept",
    [
        ("gpt2", ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"), ()),
        ("mixtral", ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                     "mlp.experts.gate_up_proj", "mlp.experts.down_proj"), ("mlp.gate.weight",)),
    ],
)  # fmt: skip
def test_conv1d_and_fused_expert_weights_are_quantized(kind, weights, matrices_kept):
    model, quantized, slots = _wrapped_quantized(kind)
    assert sorted(quantized) == sorted(s.name for s in slots if s.name.endswith(weights))
    assert len(quantized) == 3 * len(weights)
    events = trainstream.memory_report(model)["events"]
    left = [s for s in slots if s.name not in quantized]
    biases = [s for s in left if s.param.dim() == 1]
    kib = sum(s.full_nbytes for s in biases) / 1024
    assert f"1-D (biases, norms, scales): {len(biases)} tensors, {kib:.1f} KiB" in events
    # Mixtral's router is a raw parameter its own forward multiplies: no module the rule knows
    # as a matmul, so it stays exact (and tiny), listed as such.
    others = [s for s in left if s.param.dim() > 1]
    assert sorted(s.name for s in others) == sorted(s.name for s in slots if s.name.endswith(matrices_kept))
    if others:
        kib = sum(s.full_nbytes for s in others) / 1024
        assert f"{NOT_MATMUL}: {len(others)} tensors, {kib:.1f} KiB" in events


def test_fused_experts_train_as_their_round_trip():
    frozen = lambda n: ".layers." in n and n.endswith(("proj.weight", "gate_up_proj", "down_proj"))  # noqa: E731
    quantized = train("mixtral", dict(PAGED, quantize="nf4"), steps=3, freeze=frozen,
                      model_factory=hf_models.factory("mixtral"))  # fmt: skip

    def reference():
        model = hf_models.build("mixtral")
        names = {n for n, _ in model.named_parameters() if frozen(n)}
        return _round_trip(model, names, "nf4"), hf_models.batch, hf_models.loss_fn

    expected = train("mixtral", RESIDENT, steps=3, freeze=frozen, model_factory=reference)
    assert_same_bits(quantized, expected)
    engine = quantized[2][0]._trainstream_engine
    assert sum(s.quant is not None for u in engine.units for s in u.slots) == 3 * 6


def test_the_events_name_trainable_and_embedding_weights_left_unquantized():
    model = hf_models.build("llama")
    for n, p in model.named_parameters():
        p.requires_grad_(not n.endswith("q_proj.weight"))
    trainable = [p for n, p in model.named_parameters() if ".layers." in n and p.requires_grad]
    model, _ = trainstream.wrap(model, device="cpu", offload=True, quantize="int8", **RESIDENT)
    events = trainstream.memory_report(model)["events"]
    assert "quantize='int8': 3 frozen weights as int8" in events
    kib = sum(p.numel() * 4 for p in trainable) / 1024
    assert len(trainable) == 3 * 8 and f"trainable: 24 tensors, {kib:.1f} KiB" in events


def test_embeddings_inside_a_block_stay_unquantized():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8, bias=False)

        def forward(self, x, ids):
            return self.lin(x) + self.emb(ids)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x, ids):
            for b in self.layers:
                x = b(x, ids)
            return x

    model = Model().requires_grad_(False)
    assert trainstream.quantize_model(model)["tensors"] == 2
    assert sorted(_held(model)) == ["layers.0.lin.weight", "layers.1.lin.weight"]


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_gpu_codes_made_by_quantize_model_train_as_the_round_trip(where):
    """Codes made on the host or on the device, served by wrap() on CUDA, paged, under bf16
    autocast: the bits of the round-tripped model (made on the same device) trained resident."""

    def prequantized():
        model = _frozen("llama").to(where)
        trainstream.quantize_model(model, "nf4")
        assert all(q.device.type == where for q in _held(model).values())
        return model, hf_models.batch, hf_models.loss_fn

    def reference():
        model = _frozen("llama").to(where)
        names = {n for n, _ in model.named_parameters() if BLOCK_WEIGHT(n)}
        return _round_trip(model, names, "nf4"), hf_models.batch, hf_models.loss_fn

    kw = dict(steps=4, device="cuda", autocast=torch.bfloat16)
    ours = train("llama", dict(PAGED, quantize="none"), model_factory=prequantized, **kw)
    assert_same_bits(ours, train("llama", RESIDENT, model_factory=reference, **kw))
    assert trainstream.memory_report(ours[2][0])["plan"]["quantized"]["tensors"] == 21


def test_a_deep_copy_that_lost_the_codes_refuses_to_compute_or_wrap():
    import copy

    model = _frozen("llama")
    trainstream.quantize_model(model)
    clone = copy.deepcopy(model)  # a parameter's attributes, the codes among them, do not travel
    with pytest.raises(RuntimeError, match="Linear.weight was stored quantized, and this copy of it lost its codes"):
        hf_models.loss_fn(clone, hf_models.batch(0))
    with pytest.raises(RuntimeError, match="lost its codes"):
        clone.state_dict()
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight was stored quantized and this copy"):
        trainstream.wrap(clone, device="cpu", offload=True)
    with pytest.raises(ValueError, match=r"quantize_model\(\): model.layers.0.self_attn.q_proj.weight was stored"):
        trainstream.quantize_model(clone)  # it would quantize the placeholders' NaN
    assert not _held(clone)
    wrapped, _ = trainstream.wrap(model, device="cpu", offload=True)
    plain = copy.deepcopy(trainstream.unwrap(wrapped))  # unwrapped: real weights, nothing lost
    assert torch.isfinite(hf_models.loss_fn(plain, hf_models.batch(0)))


# -- weights read by a module that does not own them ----------------------------------------------

ENCODER_WEIGHTS = ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight", "linear2.weight")


def _encoder(fmt=None):
    """A 3-layer nn.TransformerEncoder, frozen but its norms; `fmt`: its matmul weights
    round-tripped through that format (the reference). nn.MultiheadAttention reads
    out_proj.weight in its own forward (F.multi_head_attention_forward): out_proj's forward
    never runs."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    for n, p in model.named_parameters():
        p.requires_grad_(".norm" in n)
    if fmt is not None:
        _round_trip(model, {n for n, _ in model.named_parameters() if n.endswith(ENCODER_WEIGHTS)}, fmt)
    return model


def _encoder_batch(i, device="cpu"):
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i)).to(device)


def _encoder_loss(model, x):
    return model(x).square().mean()


def test_a_weight_another_module_reads_is_dequantized_for_its_blocks_forward():
    model, reference = _encoder(), _encoder("int8")
    assert trainstream.quantize_model(model, "int8", blocks=list(model.layers))["tensors"] == 12
    assert sorted(n.split(".", 2)[2] for n in _held(model)) == sorted(ENCODER_WEIGHTS * 3)
    outs, grads = [], []
    for m in (model, reference):
        x = _encoder_batch(0).requires_grad_(True)
        out = m(x)
        out.square().sum().backward()  # the dequantized weights autograd saved are alive for backward
        outs.append(out.detach())
        grads.append([x.grad] + [p.grad for p in m.parameters() if p.requires_grad])
    assert not torch.isnan(outs[0]).any()
    assert_same_bits(outs[0], outs[1])
    for ours, theirs in zip(grads[0], grads[1], strict=True):
        assert_same_bits(ours, theirs)
    out_proj = model.layers[0].self_attn.out_proj.weight  # the forward put the placeholder back
    assert isinstance(out_proj, torch.nn.Parameter) and stored.codes_of(out_proj) is not None
    with torch.no_grad():  # eval: nn.TransformerEncoderLayer's fused path reads every weight itself
        assert_same_bits(model.eval()(_encoder_batch(1)), reference.eval()(_encoder_batch(1)))
        x = _encoder_batch(2)  # a module inside a block called on its own serves its own part
        attn, ref_attn = model.layers[1].self_attn, reference.layers[1].self_attn
        assert_same_bits(attn(x, x, x)[0], ref_attn(x, x, x)[0])
        assert_same_bits(model.layers[1].linear1(x), reference.layers[1].linear1(x))


def test_codes_a_block_serves_are_taken_by_wrap_and_train_as_the_round_trip():
    def prequantized():
        model = _encoder()
        trainstream.quantize_model(model, "int8", blocks=list(model.layers))
        return model, _encoder_batch, _encoder_loss

    def reference():
        return _encoder("int8"), _encoder_batch, _encoder_loss

    # wrap() finds the same stack itself (the encoder's layers)
    ours = train(None, dict(RESIDENT, quantize="none"), steps=3, model_factory=prequantized)
    expected = train(None, RESIDENT, steps=3, model_factory=reference)
    assert_same_bits(ours, expected)
    assert "12 frozen weights arrived quantized as int8" in trainstream.memory_report(ours[2][0])["events"]


def test_a_quantized_model_saves_and_loads_whole_with_its_codes():
    import io

    model = _frozen("llama")
    trainstream.quantize_model(model, "nf4")
    ids = hf_models.batch(0)
    with torch.no_grad():
        expected = model(ids).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, as torch.save(model) users do
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    held, ours = _held(loaded), _held(model)
    assert sorted(held) == sorted(ours)
    for n, q in held.items():
        assert torch.equal(q.codes, ours[n].codes) and torch.equal(q.absmax, ours[n].absmax), n
    with torch.no_grad():
        assert_same_bits(loaded(ids).logits, expected)
    for k, v in model.state_dict().items():
        assert_same_bits(loaded.state_dict()[k], v)
    wrapped, _ = trainstream.wrap(loaded, device="cpu", offload=True, **RESIDENT)  # the loaded codes are taken
    assert "21 frozen weights arrived quantized as nf4" in trainstream.memory_report(wrapped)["events"]
    with torch.no_grad():
        assert_same_bits(wrapped(ids).logits, expected)


def test_a_failed_wrap_gives_the_codes_back_and_a_deep_copy_still_refuses():
    import copy

    from trainstream.engine.state import StateHooks

    model = _frozen("llama")
    trainstream.quantize_model(model)

    def failing(*args, **kwargs):
        raise RuntimeError("injected failure")

    with pytest.MonkeyPatch.context() as patch:  # after place(): the engine has taken every code
        patch.setattr(StateHooks, "install", failing)
        with pytest.raises(RuntimeError, match="injected failure"):
            trainstream.wrap(model, device="cpu", offload=True, **RESIDENT)
    assert len(_held(model)) == 21 and torch.isfinite(hf_models.loss_fn(model, hf_models.batch(0)))
    clone = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="lost its codes"):
        hf_models.loss_fn(clone, hf_models.batch(0))
    with pytest.raises(ValueError, match="lost its codes"):
        trainstream.wrap(clone, device="cpu", offload=True)


def test_wrap_refuses_codes_that_require_grad_outside_the_optimizer():
    model = _frozen("llama")
    trainstream.quantize_model(model)
    q_proj = model.model.layers[1].self_attn.q_proj.weight
    q_proj.requires_grad_(True)  # and not in the optimizer: autograd would give the codes a gradient
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    with pytest.raises(ValueError, match=r"layers.1.self_attn.q_proj.weight holds quantized codes and requires grad"):
        trainstream.wrap(model, torch.optim.AdamW(norms), device="cpu", offload=True)
    assert stored.codes_of(q_proj) is not None  # refused before anything moved


@pytest.mark.gpu
def test_gpu_a_weight_another_module_reads_is_dequantized_on_the_device():
    model, reference = _encoder().cuda(), _encoder().cuda()  # codes made on the device, for both
    _round_trip(reference, {n for n, _ in reference.named_parameters() if n.endswith(ENCODER_WEIGHTS)}, "nf4")
    trainstream.quantize_model(model, "nf4", blocks=list(model.layers))
    assert all(q.device.type == "cuda" for q in _held(model).values())
    x = _encoder_batch(0, "cuda")
    assert_same_bits(model(x), reference(x))
    with torch.no_grad():
        assert_same_bits(model.eval()(x), reference.eval()(x))
