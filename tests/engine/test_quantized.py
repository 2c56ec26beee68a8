"""wrap(quantize=...): frozen Linear weights of the blocks stored as int8 or NF4 codes and
dequantized for each use, on the CPU path (tests marked gpu: on CUDA).

The reference for a quantized run is the same model whose frozen weights were replaced,
before training, by their quantize-dequantize round trip: training computes with exactly
those values. Paging on or off must not change a bit, as without quantization."""

import warnings

import pytest
import torch
from helpers import PAGED, RESIDENT, assert_same_bits, machine_bytes, max_diff, train
from models import MODELS, checkpointed_gpt, tiny_gpt, tiny_mlp

import trainstream
from trainstream.engine.adapt import Replan
from trainstream.quant import QuantizedWeight

FROZEN = lambda n: n.startswith("layers.") and n.endswith(("qkv.weight", "fc.weight", "out.weight"))  # noqa: E731


HF_FROZEN = lambda n: ".layers." in n and n.endswith(("q_proj.weight", "up_proj.weight"))  # noqa: E731


def _round_tripped_factory(factory, fmt, frozen):
    """`factory`'s model with the weights `frozen` names holding their quantize-dequantize
    values: what a quantized run computes with (the reference)."""

    def build():
        model, batch, loss_fn = factory()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if frozen(n):
                    p.copy_(QuantizedWeight.quantize(p, fmt).dequantize())
        return model, batch, loss_fn

    return build


def _round_tripped(name: str, fmt: str, frozen):
    return _round_tripped_factory(MODELS[name], fmt, frozen)


def _frozen_names(state, frozen):
    names = [k for k in state if frozen(k)]
    assert names
    return names


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
@pytest.mark.parametrize("name, frozen", [("gpt", FROZEN), ("llama", HF_FROZEN)], ids=["gpt", "llama"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_quantized_training_is_the_round_tripped_model(fmt, name, frozen, autocast):
    resident = train(name, dict(RESIDENT, quantize=fmt), steps=6, autocast=autocast, freeze=frozen)
    paged = train(name, dict(PAGED, quantize=fmt), steps=6, autocast=autocast, freeze=frozen)
    assert_same_bits(resident, paged)  # paging stays bit-exact with quantized weights
    reference = train(
        name, RESIDENT, steps=6, autocast=autocast, freeze=frozen, model_factory=_round_tripped(name, fmt, frozen)
    )
    assert_same_bits(resident, reference)  # the same host AdamW, the same weights: the same bits
    for k in _frozen_names(reference[1], frozen):  # saved dequantized: the values training used
        assert torch.equal(resident[1][k], reference[1][k]), k
    assert resident[0][-1] < resident[0][0]
    if autocast is None:  # and against torch's AdamW, within float rounding (as test_engine does unquantized)
        stock = train(name, None, steps=6, freeze=frozen, model_factory=_round_tripped(name, fmt, frozen))
        assert max_diff(stock[1], resident[1]) < 5e-5


def _peft_llama(fmt=None):
    """A tiny Llama with peft's LoRA on every block Linear (the base frozen by peft); `fmt`:
    its block weights round-tripped through that format first (the reference)."""
    peft = pytest.importorskip("peft")

    base = MODELS["llama"]
    if fmt is not None:
        base = _round_tripped_factory(base, fmt, lambda n: ".layers." in n and n.endswith("proj.weight"))

    def build():
        model, batch, loss_fn = base()
        config = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            bias="none",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        return peft.get_peft_model(model, config), batch, loss_fn

    return build


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_peft_lora_over_a_quantized_base(fmt):
    resident = train("llama", dict(RESIDENT, quantize=fmt), steps=4, model_factory=_peft_llama())
    paged = train("llama", dict(PAGED, quantize=fmt), steps=4, model_factory=_peft_llama())
    assert_same_bits(resident, paged)
    reference = train("llama", RESIDENT, steps=4, model_factory=_peft_llama(fmt))
    assert_same_bits(resident, reference)
    report = trainstream.memory_report(resident[2][0])
    assert report["plan"]["quantized"]["tensors"] == 3 * 7  # every base Linear of the 3 blocks; no adapter
    lora_b = [v for k, v in resident[1].items() if "lora_B" in k]
    assert len(lora_b) == 21 and all(v.abs().sum() > 0 for v in lora_b)  # the adapters trained (they start at 0)


def test_merging_adapters_into_a_quantized_base_needs_the_plain_model():
    """docs/semantics.md, "Reading a quantized weight": peft's merge into a wrapped quantized
    base raises (nothing is written into it), and unwrap() then merge gives the same model."""
    _, batch, loss_fn = MODELS["llama"]()
    _, _, (model, _) = train("llama", dict(RESIDENT, quantize="nf4"), steps=3, model_factory=_peft_llama())
    with pytest.raises(RuntimeError, match="refers to a single memory location"):
        model.merge_and_unload()
    plain = trainstream.unwrap(model)
    with torch.no_grad():
        unmerged = loss_fn(plain, batch(7, "cpu"))
        merged_model = plain.merge_and_unload()
        merged = loss_fn(merged_model, batch(7, "cpu"))
    assert not any(torch.isnan(p).any() for p in merged_model.parameters())
    assert torch.isfinite(merged) and abs(merged.item() - unmerged.item()) < 1e-4


@pytest.mark.parametrize("placement", ["resident", "paged"])
@pytest.mark.parametrize(
    "write",
    [
        lambda w: w.zero_(),
        lambda w: torch.nn.init.constant_(w, 0.5),
        lambda w: w.masked_fill_(torch.arange(w.numel()).view(w.shape) % 2 == 0, 0.0),  # a pruning mask
    ],
    ids=["zero_", "nn.init.constant_", "masked_fill_"],
)
def test_a_write_to_a_quantized_weight_is_refused_at_its_next_use_until_values_are_loaded(placement, write):
    """[Note: quantized edits]: the writes that succeed on the placeholder write one element,
    which cannot say what was meant: the weight's next forward refuses them, naming it; the
    codes and state_dict() are untouched; new values loaded through the state dict are
    quantized again and training goes on."""
    opts = dict(RESIDENT if placement == "resident" else PAGED, quantize="nf4")
    _, _, (model, opt) = train("gpt", opts, steps=1, freeze=FROZEN)
    _, batch, loss_fn = MODELS["gpt"]()
    key, w = "layers.1.fc.weight", model.layers[1].fc.weight
    before = model.state_dict()[key]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: masked_fill_ on an expanded tensor is deprecated
        write(w)
    with pytest.raises(ValueError, match=r"layers\.1\.fc\.weight is held as nf4 codes, and an in-place write"):
        loss_fn(model, batch(0, "cpu"))
    assert torch.equal(model.state_dict()[key], before)  # the codes stand
    new = before.flip(0)
    model.load_state_dict({key: new}, strict=False)
    assert torch.isnan(w).all()  # the placeholder again
    assert torch.equal(model.state_dict()[key], QuantizedWeight.quantize(new, "nf4").dequantize())
    for i in range(2):
        loss = loss_fn(model, batch(i, "cpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(loss)


def test_quantized_weights_are_stored_as_codes_and_reported():
    _, _, (model, _) = train(
        "gpt", dict(param_offload=[1, 3], activation_offload=False, quantize="nf4"), steps=1, freeze=FROZEN
    )
    engine = model._trainstream_engine
    slots = {s.name: s for u in engine.units for s in u.slots}
    quantized = [s for s in slots.values() if s.quant is not None]
    assert sorted(s.name for s in quantized) == sorted(n for n in slots if FROZEN(n))
    for s in quantized:
        assert s.quant.format == "nf4" and s.quant.codes.dtype == torch.uint8
        assert torch.isnan(s.param).all() and s.param.stride() == (0,) * s.param.dim()  # a placeholder between uses
        assert s.dtype not in s.host  # no full-precision copy kept anywhere
    # the NaNs behind the placeholders come from one allocation (no device allocation nor kernel
    # per weight), an element each: a write that succeeds on an expanded tensor spoils only its own
    assert len({s.param.untyped_storage().data_ptr() for s in quantized}) == 1
    assert len({s.param.data_ptr() for s in quantized}) == len(quantized)
    quantized[0].param.data.zero_()
    assert all(torch.isnan(s.param).all() for s in quantized[1:])
    assert slots["layers.0.ln1.weight"].quant is None and slots["layers.0.qkv.weight"].quant is not None
    report = trainstream.memory_report(model)
    assert report["params"]["quantize"] == "nf4"
    q = report["plan"]["quantized"]
    numel = sum(s.param.numel() for s in quantized)
    assert q["tensors"] == 12 and q["bytes_before"] == 4 * numel
    assert q["bytes_after"] == numel // 2 + 4 * (numel // 64)
    assert "12 frozen weights as nf4" in report["events"]


def test_trainable_weights_are_never_quantized():
    _, _, (model, _) = train("gpt", dict(RESIDENT, quantize="int8"), steps=1)
    report = trainstream.memory_report(model)
    assert report["params"]["quantize"] == "none"
    assert "no frozen weight matrix in the blocks to quantize" in report["events"]


def test_state_dict_load_requantizes_and_unwrap_gives_dequantized_weights():
    _, _, (model, opt) = train("gpt", dict(PAGED, quantize="int8", param_offload=[0, 1]), steps=2, freeze=FROZEN)
    state = model.state_dict()
    new = {k: (v.flip(-1) * 0.5 if FROZEN(k) else v).clone() for k, v in state.items()}
    model.load_state_dict(new)
    after = model.state_dict()
    for k in _frozen_names(after, FROZEN):
        expect = QuantizedWeight.quantize(new[k], "int8").dequantize()
        assert torch.equal(after[k], expect), k
        assert not torch.equal(after[k], state[k])
    engine = model._trainstream_engine
    assert all(torch.isnan(s.param).all() for u in engine.units for s in u.slots if s.quant is not None)
    plain = trainstream.unwrap(model)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, after[k]), k
    assert not any(torch.isnan(p).any() for p in plain.parameters())


def test_a_partial_load_leaves_the_other_quantized_weights_alone():
    _, _, (model, _) = train("gpt", dict(RESIDENT, quantize="nf4"), steps=1, freeze=FROZEN)
    engine = model._trainstream_engine
    quant = {
        s.name: (s.quant.codes.clone(), s.quant.absmax.clone())
        for u in engine.units
        for s in u.slots
        if s.quant is not None
    }
    slots = {s.name: s for u in engine.units for s in u.slots}
    requantized = []
    import trainstream.engine.state as state_module

    original = state_module.QuantizedWeight.quantize

    def counting(w, *a, **k):
        requantized.append(w.shape)
        return original(w, *a, **k)

    state_module.QuantizedWeight.quantize = counting
    try:
        new_ln = torch.full_like(model.state_dict()["layers.0.ln1.weight"], 0.5)
        new_qkv = torch.ones(192, 64)
        model.load_state_dict({"layers.0.ln1.weight": new_ln, "layers.1.qkv.weight": new_qkv}, strict=False)
    finally:
        state_module.QuantizedWeight.quantize = original
    assert requantized == [torch.Size([192, 64])]  # only the quantized weight the dict held
    for name, (codes, _absmax) in quant.items():
        changed = name == "layers.1.qkv.weight"
        assert torch.equal(slots[name].quant.codes, codes) != changed, name
    after = model.state_dict()
    assert torch.equal(after["layers.0.ln1.weight"], new_ln) and torch.equal(after["layers.1.qkv.weight"], new_qkv)
    assert not any(torch.isnan(v).any() for v in after.values())


def test_quantized_blocks_measure_the_same_activations_paged_or_resident():
    # Under bf16 autocast a paged block's measured activations add the copies autocast would
    # have made of its fp32 weights, resident. A quantized weight is dequantized per use
    # either way and never copied: counting it would price residency twice.
    _, _, (model, _) = train(
        "gpt",
        dict(param_offload=[0, 1], activation_offload=False, quantize="nf4"),
        steps=2,
        autocast=torch.bfloat16,
        freeze=FROZEN,
    )
    engine = model._trainstream_engine
    assert [u.paged for u in engine.block_units] == [True, True, False, False]
    assert engine.activation_bytes[0] == engine.activation_bytes[2] > 0
    assert engine.activation_cast[0] == engine.activation_cast[2]


def test_weights_that_require_grad_are_not_quantized():
    # Frozen in the optimizer's eyes only: autograd would still make their full-size gradient.
    torch.manual_seed(0)
    model, _, _ = tiny_gpt()
    in_optimizer = [p for n, p in model.named_parameters() if not FROZEN(n)]
    model, _ = trainstream.wrap(
        model, torch.optim.AdamW(in_optimizer, lr=1e-2), device="cpu", offload=True, quantize="nf4", **RESIDENT
    )
    assert trainstream.memory_report(model)["params"]["quantize"] == "none"


@pytest.mark.parametrize(
    "base", [RESIDENT, dict(param_offload=True, activation_offload=False)], ids=["resident", "paged"]
)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_recomputes_quantized_blocks_and_releases_them(reentrant, base, monkeypatch):
    from trainstream.engine.params import WeightPager

    forwards, held = [], []
    fetch = WeightPager.fetch

    def counting_fetch(self, unit, **kw):
        fetch(self, unit, **kw)
        held.append(sum(u.fetched is not None for u in self.units if u.block is not None))

    monkeypatch.setattr(WeightPager, "fetch", counting_fetch)
    opts = dict(base, quantize="nf4")
    checkpointed = train("ckpt", opts, steps=3, freeze=FROZEN, model_factory=checkpointed_gpt(reentrant, forwards))
    assert len(forwards) == 3 * 4 * 2  # every block's forward ran again in backward
    assert max(held) <= 3  # the block recomputing, the one after it, the one fetched ahead
    assert_same_bits(checkpointed, train("gpt", opts, steps=3, freeze=FROZEN))  # the same run without checkpoints
    reference = train(
        "ckpt",
        base,
        steps=3,
        freeze=FROZEN,
        model_factory=_round_tripped_factory(checkpointed_gpt(reentrant, []), "nf4", FROZEN),
    )
    assert_same_bits(checkpointed, reference)


@pytest.mark.parametrize("base, most", [(RESIDENT, 1), (PAGED, 2)], ids=["resident", "paged"])
def test_resident_quantized_blocks_are_dequantized_when_they_run_one_at_a_time(base, most, monkeypatch):
    """[Note: dequantized where used]: a resident unit's weights are dequantized when its
    block runs (forward, or backward), never fetched ahead, so one unit's are held at a time;
    a paged unit's next one comes ahead of use, as before."""
    from trainstream.engine.params import WeightPager

    held, ahead = [], []
    fetch = WeightPager.fetch

    def counting_fetch(self, unit, **kw):
        fetch(self, unit, **kw)
        held.append(sum(u.fetched is not None for u in self.units if u.block is not None))
        ahead.append(kw.get("ahead", False) and unit.fetched is not None)

    monkeypatch.setattr(WeightPager, "fetch", counting_fetch)
    run = train("gpt", dict(base, quantize="nf4"), steps=3, freeze=FROZEN)
    assert max(held) == most
    assert any(ahead) == (most > 1)
    assert_same_bits(run, train("gpt", dict(PAGED if most == 1 else RESIDENT, quantize="nf4"), steps=3, freeze=FROZEN))


def test_the_guard_reads_the_allocation_after_a_resident_blocks_weights_are_dequantized(monkeypatch):
    """A resident block's dequantized weights are held while it runs, so they are on the device when the guard reads what is allocated at the block's
    start, as a paged block's weights are (fetched ahead). Dequantized after the read, the
    guard's projection missed them: the 7B LoRA under 8 GiB kept the last blocks' activations
    and ran out of memory in the head's backward (H100, f128c0e)."""
    from trainstream.engine.adapt import Adapter

    seen = []
    block_starts = Adapter.block_starts

    def recording(self, unit, fetched_bytes):
        seen.append((unit.block, unit.fetched is not None))
        return block_starts(self, unit, fetched_bytes)

    monkeypatch.setattr(Adapter, "block_starts", recording)
    train("gpt", dict(RESIDENT, quantize="nf4"), steps=2, freeze=FROZEN)
    assert seen and all(fetched for _, fetched in seen), seen


@pytest.mark.parametrize("placement", ["resident", "paged"])
def test_only_a_paged_last_block_keeps_its_weights_from_its_forward_for_its_backward(placement):
    """The head and the loss run after the stack, where a LoRA step peaks: a resident last
    block's dequantized weights are released at the end of its forward and dequantized again
    when its backward starts (bitsandbytes holds no weight there); a paged one keeps its
    fetched weights rather than cross PCIe twice."""
    from trainstream.engine.layout import Fetch

    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    for n, p in model.named_parameters():
        p.requires_grad_(not FROZEN(n))
    opts = RESIDENT if placement == "resident" else PAGED
    model, opt = trainstream.wrap(model, None, lr=1e-2, device="cpu", offload=True, quantize="nf4", **opts)
    engine = model._trainstream_engine
    last = engine.block_units[-1]
    assert last.streamed and last.paged == (placement == "paged")
    for i in range(2):
        loss = loss_fn(model, batch(i, "cpu"))
        held = last.fetch
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert held is (Fetch.ATTACHED if last.paged else Fetch.RELEASED), held
        assert last.fetch is Fetch.RELEASED  # after backward, either way


def test_blocks_moved_between_paged_and_resident_keep_their_bits():
    def run(move: bool):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        for n, p in model.named_parameters():
            p.requires_grad_(not FROZEN(n))
        model, opt = trainstream.wrap(model, None, lr=1e-2, device="cpu", offload=True, quantize="nf4", **RESIDENT)
        engine = model._trainstream_engine
        losses = []
        for i in range(6):
            if move and i in (2, 4):  # between steps, where the engine applies the adapter's replans
                engine.apply(Replan([0, 2] if i == 2 else [2], []))
            loss = loss_fn(model, batch(i, "cpu"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if move:
            assert [u.paged for u in engine.block_units] == [False, False, True, False]
        return losses, {k: v.clone() for k, v in model.state_dict().items()}

    assert_same_bits(run(False), run(True))


def _frozen_mlp():
    model, batch, loss_fn = tiny_mlp(layers=6, dim=256)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model[-1].parameters():  # the last block trains, the five before it are frozen
        p.requires_grad_(True)
    return model, batch, loss_fn


def _host_need(fmt):
    """Host bytes wrap() needs for _frozen_mlp with every block paged, by quantize format."""
    model, _, _ = _frozen_mlp()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_weights = 5 * 256 * 256
    per = {
        None: 4 * frozen_weights,
        "int8": frozen_weights + 4 * frozen_weights // 64,
        "nf4": frozen_weights // 2 + 4 * frozen_weights // 64,
    }[fmt]
    # master, landing buffer, two fp32 moments and the bf16 copy a paged Linear keeps
    return per + 4 * (frozen - frozen_weights) + 18 * trained


@pytest.mark.parametrize("ram_for, expect", [(None, "none"), ("int8", "int8"), ("nf4", "nf4")])
def test_auto_quantizes_only_when_the_run_would_not_fit(ram_for, expect):
    model, batch, loss_fn = _frozen_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = trainstream.wrap(
            model,
            None,
            device="cpu",
            offload=True,
            param_offload=True,
            moment_dtype="float32",
            profile=machine_bytes(_host_need(ram_for) + 1024),
        )
    report = trainstream.memory_report(model)
    assert report["params"]["quantize"] == expect, report["events"]
    said = [str(w.message) for w in caught if "quantize='auto' stores" in str(w.message)]
    assert len(said) == (expect != "none") and all(f"as {expect}, because the run does not fit" in m for m in said)
    if expect != "none":
        assert "because it does not fit with no quantization (host RAM" in report["events"]
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()


def test_a_run_that_fits_in_no_format_says_what_was_tried():
    model, _, _ = _frozen_mlp()
    with pytest.raises(
        MemoryError,
        match=r"host RAM.*quantize='auto' tried, and it did not fit either with "
        r"no quantization \(host RAM.*int8 \(host RAM",
    ):
        trainstream.wrap(
            model,
            None,
            device="cpu",
            offload=True,
            param_offload=True,
            moment_dtype="float32",
            profile=machine_bytes(_host_need("nf4") - 4096),
        )
    model, _, _ = _frozen_mlp()
    with pytest.raises(MemoryError, match=r"quantize='int8' or quantize='nf4' \(frozen weights\)"):
        trainstream.wrap(
            model,
            None,
            device="cpu",
            offload=True,
            param_offload=True,
            quantize="none",
            moment_dtype="float32",
            profile=machine_bytes(_host_need("nf4") + 1024),
        )


def test_prefer_speed_takes_nf4_when_it_keeps_every_block_resident():
    # 6 blocks of 256 KiB each (fp32, 5 frozen) on a 3 MiB card: half the usable memory is
    # held back for the activations not yet measured, so unquantized some blocks are paged;
    # NF4 (an eighth of the size, plus two blocks dequantized in flight) keeps them all.
    # prefer="exact" leaves the weights as they are.
    def wrap(prefer):
        model, _, _ = _frozen_mlp()
        model, _ = trainstream.wrap(
            model, None, device="cpu", offload=True, prefer=prefer, profile=machine_bytes(1 << 34, vram_bytes=3 << 20)
        )
        return trainstream.memory_report(model)

    exact, speed = wrap("exact"), wrap("speed")
    assert exact["params"]["quantize"] == "none" and exact["params"]["paged_blocks"], exact["events"]
    assert speed["params"]["quantize"] == "nf4" and not speed["params"]["paged_blocks"], speed["events"]


def test_offload_auto_does_not_switch_a_quantized_model():
    _, _, (model, _) = train(
        "gpt",
        dict(quantize="nf4", offload="auto", param_offload="auto", activation_offload="auto"),
        steps=4,
        freeze=FROZEN,
    )
    report = trainstream.memory_report(model)
    assert report["mode"] == "offload"
    assert "frozen weights are quantized" in report["events"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gpu_quantized_training_is_the_round_tripped_model(fmt, autocast):
    kw = dict(steps=6, autocast=autocast, freeze=HF_FROZEN, device="cuda")
    resident = train("llama", dict(RESIDENT, quantize=fmt), **kw)
    paged = train("llama", dict(PAGED, quantize=fmt), **kw)
    assert_same_bits(resident, paged)
    reference = train("llama", RESIDENT, model_factory=_round_tripped("llama", fmt, HF_FROZEN), **kw)
    assert_same_bits(resident, reference)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "base", [RESIDENT, dict(param_offload=True, activation_offload=False)], ids=["resident", "paged"]
)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gpu_checkpointing_with_quantized_blocks_gives_the_same_bits(reentrant, base):
    opts = dict(base, quantize="nf4")
    forwards = []
    checkpointed = train(
        "ckpt", opts, steps=3, freeze=FROZEN, device="cuda", model_factory=checkpointed_gpt(reentrant, forwards)
    )
    assert len(forwards) == 3 * 4 * 2
    assert_same_bits(checkpointed, train("gpt", opts, steps=3, freeze=FROZEN, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "placement", [RESIDENT, dict(param_offload=True, activation_offload=False)], ids=["resident", "paged"]
)
def test_gpu_codes_made_on_the_device_are_ready_before_the_first_dequantize(placement):
    """A model already on the GPU is quantized there, on the compute stream; a paged unit's
    codes go to host memory and its first dequantize runs on the copy-in stream (a resident
    unit's, on compute: in order). With compute held up by a long kernel, a missing wait
    would read codes not written yet. The first loss must be the stock model's on the same
    (round-tripped) weights, bit for bit."""

    def model_on_gpu():
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt(dim=512, layers=4, heads=8)
        for n, p in model.named_parameters():
            p.requires_grad_(not FROZEN(n))
        return model.cuda(), batch, loss_fn

    reference, batch, loss_fn = model_on_gpu()
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if FROZEN(n):
                p.copy_(QuantizedWeight.quantize(p, "int8").dequantize())
    expect = loss_fn(reference, batch(0, "cuda")).item()
    model, _, _ = model_on_gpu()
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # about a second of compute-stream work ahead of the quantization
    model, _ = trainstream.wrap(model, None, lr=1e-2, device="cuda", offload=True, quantize="int8", **placement)
    assert loss_fn(model, batch(0, "cuda")).item() == expect


@pytest.mark.gpu
def test_gpu_codes_the_engine_writes_are_waited_for_on_another_stream():
    """[Note: dequantized where used]: a resident unit's dequantize runs on whatever stream
    computes. Codes the engine writes on the device (a load's re-quantize: here the same
    in-place write, behind about a second of other work on the default stream) and a first
    forward on another stream, which nothing else orders after that write: the dequantize
    waits for the codes, so the loss is the stock model's on the new round-tripped weights."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt(dim=512, layers=4, heads=8)
    for n, p in model.named_parameters():
        p.requires_grad_(not FROZEN(n))
    reference = tiny_gpt(dim=512, layers=4, heads=8)[0]
    reference.load_state_dict(model.state_dict())
    model, _ = trainstream.wrap(model.cuda(), None, lr=1e-2, device="cuda", offload=True, quantize="int8", **RESIDENT)
    slots = {s.name: s for u in model._trainstream_engine.weights.units for s in u.slots}
    new_codes = {}
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if FROZEN(n):
                q = QuantizedWeight.quantize(p * 1.5, "int8")
                p.copy_(q.dequantize())
                new_codes[n] = (q.codes.cuda(), q.absmax.cuda())
    x = batch(0, "cuda")
    expect = loss_fn(reference.cuda(), x).item()
    with torch.no_grad():
        assert loss_fn(model, x).item() != expect  # the old codes give another loss
    torch.cuda.synchronize()
    other = torch.cuda.Stream()
    torch.cuda._sleep(1 << 30)  # on the default stream, ahead of the write
    for n, (codes, absmax) in new_codes.items():
        slots[n].quant.codes.copy_(codes)
        slots[n].quant.absmax.copy_(absmax)
    model._trainstream_engine.weights.codes_written()
    with torch.cuda.stream(other), torch.no_grad():
        got = loss_fn(model, x).item()
    assert got == expect


@pytest.mark.gpu
def test_gpu_quantized_weights_lower_the_peak():
    """A bf16 model whose block Linear weights are frozen but the last: NF4 codes on the
    device take about a quarter of the bf16 weights, and the step's peak drops accordingly."""

    def peak(quantize):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_mlp(layers=24, dim=2048, rows=16)
        model = model.to(torch.bfloat16)
        for p in model.parameters():
            p.requires_grad_(False)
        for p in model[-1].parameters():
            p.requires_grad_(True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model, opt = trainstream.wrap(model, None, device="cuda", offload=True, quantize=quantize, **RESIDENT)
        for i in range(3):
            loss_fn(model, batch(i, "cuda").to(torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()
        opt._synchronize()
        torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated() - base
        trainstream.unwrap(model)
        return out

    full, nf4 = peak("none"), peak("nf4")
    weights = 23 * 2048 * 2048 * 2  # the frozen bf16 weights; as NF4 codes and scales about 0.28 of that,
    assert nf4 < full - weights // 2, (full, nf4)  # plus one block dequantized at a time
