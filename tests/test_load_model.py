"""load_model(): tiny transformers models written to .safetensors in a temporary folder, read
back one tensor at a time: unquantized, bit for bit; quantized, the codes of the ops on each
checkpoint tensor; trained under wrap() as the same model built directly; every bad argument;
and the memory bound of a quantized load, measured in a subprocess."""

import json
import os
import subprocess
import sys
import textwrap

import hf_models
import pytest
import torch
from helpers import PAGED, RESIDENT, assert_same_bits, train

import trainstream
from trainstream import ops
from trainstream.integrations.huggingface import load_model, loading
from trainstream.quant import QuantizedWeight, stored

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _checkpoint(tmp_path, kind="llama", shards=1, dtype=None, **overrides):
    model = hf_models.build(kind, **overrides)
    folder = tmp_path / f"{kind}-{shards}"
    tensors = hf_models.write_checkpoint(model, folder, shards=shards, dtype=dtype)
    return model, str(folder), tensors


def _held(model) -> dict:
    return {n: stored.codes_of(p) for n, p in model.named_parameters() if stored.codes_of(p) is not None}


@pytest.mark.parametrize("kind", hf_models.KINDS + hf_models.SEQ2SEQ)
@pytest.mark.parametrize("shards", [1, 3])
def test_unquantized_gives_the_checkpoint_bit_for_bit(tmp_path, kind, shards):
    built, folder, tensors = _checkpoint(tmp_path, kind, shards)
    model = load_model(folder, quantize="none", dtype=torch.float32)
    state = model.state_dict()
    for k, v in tensors.items():
        assert_same_bits(state[k], v)
    assert state.keys() == built.state_dict().keys()
    assert all(p.requires_grad for p in model.parameters())  # as transformers leaves them: a full fine-tune
    assert not _held(model) and not model.training
    out = model.get_output_embeddings().weight
    assert (out is model.get_input_embeddings().weight) == bool(built.config.tie_word_embeddings)
    ids = hf_models.batch(0)
    assert_same_bits(hf_models.loss_fn(model, ids), hf_models.loss_fn(built.eval(), ids))


def test_a_bfloat16_checkpoint_loads_bit_for_bit_in_bfloat16(tmp_path):
    _, folder, tensors = _checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16)
    model = load_model(folder, quantize=None)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    state = model.state_dict()
    for k, v in tensors.items():
        assert_same_bits(state[k], v)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("kind", hf_models.KINDS + hf_models.SEQ2SEQ)
def test_quantized_codes_are_the_ops_codes_of_the_checkpoint_tensors(tmp_path, kind, fmt):
    built, folder, tensors = _checkpoint(tmp_path, kind, shards=2)
    model = load_model(folder, quantize=fmt, dtype=torch.float32, quant_block_size=32)
    held = _held(model)
    # what wrap(quantize=fmt) quantizes in the same model with every parameter frozen
    assert sorted(held) == sorted(_quantized_names(kind)) and held
    quantize = ops.quantize_nf4 if fmt == "nf4" else ops.quantize_int8
    for n, q in held.items():
        codes, absmax = quantize(tensors[n], 32)
        assert torch.equal(q.codes, codes) and torch.equal(q.absmax, absmax), n
        assert (q.format, q.block_size, q.shape, q.dtype) == (fmt, 32, tensors[n].shape, torch.float32)
    assert not any(p.requires_grad for p in model.parameters())  # a frozen base
    state = model.state_dict()
    for k, v in tensors.items():  # the rest as it is; the quantized ones, their dequantized codes
        if k in held:
            assert_same_bits(state[k], held[k].dequantize())
        else:
            assert_same_bits(state[k], v)


def test_codes_of_a_bfloat16_checkpoint_are_made_from_its_tensors(tmp_path):
    _, folder, tensors = _checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    model = load_model(folder, quantize="nf4")
    for n, q in _held(model).items():
        assert torch.equal(q.codes, ops.quantize_nf4(tensors[n])[0]) and q.dtype == torch.bfloat16


def _quantized_names(kind) -> set:
    """The weights quantize_model (as wrap()) stores quantized in `kind` with every parameter frozen."""
    frozen = hf_models.build(kind).requires_grad_(False)
    trainstream.quantize_model(frozen)
    return set(_held(frozen))


def _train_loaded(folder, fmt, options, trained=lambda n: n.endswith("norm.weight")):
    def factory():
        model = load_model(folder, quantize=fmt, dtype=torch.float32)
        for n, p in model.named_parameters():
            p.requires_grad_(trained(n))
        return model.train(), hf_models.batch, hf_models.loss_fn

    return train("llama", options, steps=4, model_factory=factory)


def _train_built(kind, fmt, options, trained=lambda n: n.endswith("norm.weight")):
    def factory():
        model = hf_models.build(kind)
        for n, p in model.named_parameters():
            p.requires_grad_(trained(n))
        if fmt is not None:  # the values the loaded model's codes stand for
            names = _quantized_names(kind)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in names:
                        p.copy_(QuantizedWeight.quantize(p, fmt).dequantize())
        return model, hf_models.batch, hf_models.loss_fn

    return train("llama", options, steps=4, model_factory=factory)


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_a_loaded_model_trains_under_wrap_as_the_model_it_was_saved_from(tmp_path, fmt):
    _, folder, _ = _checkpoint(tmp_path, "llama", shards=2)
    loaded = _train_loaded(folder, fmt, dict(PAGED, quantize="none"))
    expected = _train_built("llama", fmt, RESIDENT)
    assert_same_bits(loaded, expected)
    norm = loaded[1]["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))  # it trained (the norms start at 1)
    if fmt is not None:
        events = trainstream.memory_report(loaded[2][0])["events"]
        assert "21 frozen weights arrived quantized as nf4" in events  # wrapped with its codes, not again


def test_lora_over_a_loaded_nf4_base_trains_as_over_its_round_trip(tmp_path):
    peft = pytest.importorskip("peft")
    _, folder, _ = _checkpoint(tmp_path, "llama")

    def with_lora(model):
        torch.manual_seed(1)  # the adapters' init, the same for both
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
        return peft.get_peft_model(model, config).train(), hf_models.batch, hf_models.loss_fn

    def loaded():
        return with_lora(load_model(folder, quantize="nf4", dtype=torch.float32))

    def reference():
        model = hf_models.build("llama")
        names = _quantized_names("llama")
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in names:
                    p.copy_(QuantizedWeight.quantize(p, "nf4").dequantize())
        return with_lora(model)

    ours = train("llama", PAGED, steps=4, model_factory=loaded)
    assert_same_bits(ours, train("llama", RESIDENT, steps=4, model_factory=reference))
    assert trainstream.memory_report(ours[2][0])["plan"]["quantized"]["tensors"] == 21
    lora_b = [v for k, v in ours[1].items() if "lora_B" in k]
    assert len(lora_b) == 9 and all(v.abs().sum() > 0 for v in lora_b)  # the adapters trained (they start at 0)


def test_a_full_fine_tune_of_an_unquantized_load_trains_as_the_built_model(tmp_path):
    _, folder, _ = _checkpoint(tmp_path, "llama")
    everything = lambda n: True  # noqa: E731
    assert_same_bits(
        _train_loaded(folder, "none", RESIDENT, trained=everything),
        _train_built("llama", None, RESIDENT, trained=everything),
    )


@pytest.mark.parametrize("kind", hf_models.KINDS)
def test_random_weights_need_only_the_config_and_are_initialized_by_the_model(tmp_path, kind):
    folder = tmp_path / kind
    hf_models.config(kind).save_pretrained(folder)  # no tensors at all
    model = load_model(str(folder), quantize="nf4", random_weights=True, dtype=torch.float32)
    held = _held(model)
    assert len(held) == 3 * {"gpt2": 4, "mixtral": 6}.get(kind, 7)  # Mixtral's router weight is kept exact
    std = model.config.initializer_range
    for n, q in held.items():
        values = q.dequantize()
        assert torch.isfinite(values).all() and 0.7 * std < values.std() < 1.3 * std, n
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() or n in held, n
        if n.endswith("norm.weight") or n.endswith("ln_1.weight"):
            assert torch.equal(p, torch.ones_like(p)), n
    loss = hf_models.loss_fn(model, hf_models.batch(0))
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(101.0)).item()) < 1.0


def test_random_weights_unquantized_are_the_models_own_init(tmp_path):
    folder = tmp_path / "cfg"
    hf_models.config("llama").save_pretrained(folder)
    model = load_model(str(folder), quantize="none", random_weights=True, dtype=torch.float32)
    assert all(p.requires_grad for p in model.parameters())
    w = model.model.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - model.config.initializer_range) < 0.003 and abs(w.mean().item()) < 0.003


@pytest.mark.parametrize(
    "ram, expect",
    [(1 << 40, None), ("bf16", "int8"), ("int8", "nf4")],
)
def test_auto_quantizes_only_when_the_model_would_not_fit(tmp_path, monkeypatch, ram, expect):
    _, folder, _ = _checkpoint(tmp_path, "llama")
    meta = loading.build_on_meta(loading.read_config(folder, False, {}), torch.float32, False)
    need = {"bf16": loading.model_bytes(meta, None, 64), "int8": loading.model_bytes(meta, "int8", 64)}
    available = ram if isinstance(ram, int) else need[ram]  # ram_fraction=0.85 of it holds less than that
    monkeypatch.setattr(loading, "available_ram", lambda: available)
    model = load_model(folder, dtype=torch.float32)
    formats = {q.format for q in _held(model).values()}
    assert formats == ({expect} if expect else set())


def test_auto_raises_does_not_fit_when_not_even_nf4_fits(tmp_path, monkeypatch):
    _, folder, _ = _checkpoint(tmp_path, "llama")
    monkeypatch.setattr(loading, "available_ram", lambda: 1000)
    with pytest.raises(trainstream.DoesNotFit, match="load_model\\(\\): this run does not fit") as e:
        load_model(folder, quantize="auto", ram_fraction=0.5)
    assert e.value.has["ram"] == 500 and e.value.needs["ram"] > 500
    assert "check_memory" not in str(e.value)  # an option of wrap(), not of load_model()


def test_config_overrides_apply_and_unknown_fields_are_named(tmp_path):
    _, folder, _ = _checkpoint(tmp_path, "llama")
    model = load_model(folder, quantize="none", dtype=torch.float32, num_hidden_layers=2, rms_norm_eps=1e-5)
    assert len(model.model.layers) == 2 and model.config.rms_norm_eps == 1e-5
    with pytest.raises(ValueError, match="unknown config field 'hiden_size' for LlamaConfig \\(close: hidden_size"):
        load_model(folder, hiden_size=32)


def test_checkpoint_errors_name_the_file_tensor_or_field(tmp_path):
    from safetensors.torch import save_file

    built, folder, tensors = _checkpoint(tmp_path, "llama", shards=2)
    bins = tmp_path / "bins"
    built.config.save_pretrained(bins)
    torch.save(built.state_dict(), bins / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"holds only PyTorch pickle files \(pytorch_model.bin\)"):
        load_model(str(bins))
    os.remove(bins / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no .safetensors file in"):
        load_model(str(bins))

    missing = tmp_path / "missing"
    built.config.save_pretrained(missing)
    gone = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != gone}, missing / "model.safetensors")
    with pytest.raises(ValueError, match=f"has no tensor '{gone}'"):
        load_model(str(missing))

    wrong = tmp_path / "wrong"
    built.config.save_pretrained(wrong)
    bad = dict(tensors, **{gone: tensors[gone][:, :64].contiguous()})
    save_file(bad, wrong / "model.safetensors")
    with pytest.raises(ValueError, match=f"tensor '{gone}' in model.safetensors has shape \\(64, 64\\).*\\(64, 128\\)"):
        load_model(str(wrong), quantize="nf4")

    index = json.loads((tmp_path / "llama-2" / loading.INDEX).read_text())
    os.remove(os.path.join(folder, sorted(set(index["weight_map"].values()))[1]))
    with pytest.raises(FileNotFoundError, match="lists model-00002-of-00002.safetensors, which is not in"):
        load_model(folder)
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_model(folder)


def _assert_same_parameters(got, want) -> None:
    got, want = dict(got.named_parameters()), dict(want.named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        assert_same_bits(got[name].detach(), want[name].detach())


def _per_expert_layout(tensors: dict, names=("w1", "w3", "w2"), path="block_sparse_moe.experts") -> dict:
    """A fused-expert checkpoint rewritten as the hub stores Mixtral: each expert's projections
    apart, gate_up_proj's rows split into gate then up."""
    gate, up, down = names
    layout = {}
    for k, v in tensors.items():
        if k.endswith("experts.gate_up_proj"):
            w1, w3 = v.chunk(2, dim=1)
            for e in range(v.shape[0]):
                base = k.replace("mlp.experts.gate_up_proj", f"{path}.{e}")
                layout[f"{base}.{gate}.weight"], layout[f"{base}.{up}.weight"] = w1[e].contiguous(), w3[e].contiguous()
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                layout[k.replace("mlp.experts.down_proj", f"{path}.{e}.{down}.weight")] = v[e].contiguous()
        else:  # the router too lives under the checkpoint's MoE module name
            layout[k.replace(".mlp.", f".{path.split('.')[0]}.")] = v
    return layout


def test_a_checkpoint_of_experts_one_by_one_is_fused_as_it_is_read(tmp_path):
    from safetensors.torch import save_file

    built, _, tensors = _checkpoint(tmp_path, "mixtral")
    per_expert = tmp_path / "per-expert"
    built.config.save_pretrained(per_expert)
    save_file(_per_expert_layout(tensors), per_expert / "model.safetensors")
    loaded = load_model(str(per_expert), quantize="none", dtype=torch.float32)
    _assert_same_parameters(loaded, built)
    quantized = _held(load_model(str(per_expert), quantize="nf4", dtype=torch.float32))
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    want = ops.quantize_nf4(tensors[fused], block_size=64)
    assert torch.equal(quantized[fused].codes, want[0]) and torch.equal(quantized[fused].absmax, want[1])


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_hub_moe_checkpoint_loads_as_transformers_loads_it(tmp_path, kind):
    """save_pretrained writes the hub's per-expert layout; from_pretrained is the reference."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=hf_models.VOCAB,
        max_position_embeddings=64,
    )
    config = {
        "mixtral": lambda: transformers.MixtralConfig(
            **common, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, head_dim=16
        ),
    }[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / kind)
    from safetensors import safe_open

    with safe_open(str(tmp_path / kind / "model.safetensors"), "pt") as f:
        assert any(loading._PER_EXPERT.search(k) for k in f.keys()), "save_pretrained wrote fused experts"
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind, dtype=torch.float32)
    got = load_model(str(tmp_path / kind), quantize="none", dtype=torch.float32)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in got.named_parameters())
    _assert_same_parameters(got, want)


def test_a_per_expert_layout_load_model_does_not_know_is_named_as_such(tmp_path):
    from safetensors.torch import save_file

    built, _, tensors = _checkpoint(tmp_path, "mixtral")
    per_expert = tmp_path / "per-expert"
    built.config.save_pretrained(per_expert)
    save_file(_per_expert_layout(tensors, names=("fc_a", "fc_b", "fc_c")), per_expert / "model.safetensors")
    with pytest.raises(
        ValueError,
        match="has no tensor 'model.layers.0.mlp.experts.gate_up_proj'.*stores experts one by one.*"
        "fuses that layout for model types .*'mixtral'.*not for model type 'mixtral' with these",
    ):
        load_model(str(per_expert))


def test_bad_arguments_name_themselves(tmp_path):
    _, folder, _ = _checkpoint(tmp_path, "llama")
    cases = [
        (dict(quantize="fp8"), r"quantize must be one of \['auto', 'none', 'int8', 'nf4'\], None or False"),
        (dict(quantize="NF4"), "quantize must be one of"),
        (dict(dtype="bfloat16"), "dtype must be one of"),
        (dict(dtype=torch.int8), "dtype must be one of"),
        (dict(quant_block_size=3), "quant_block_size must be an even integer >= 2 and <= 4096"),
        (dict(quant_block_size=True), "quant_block_size must be an even integer"),
        (dict(random_weights="yes"), "random_weights must be True or False"),
        (dict(trust_remote_code=1), "trust_remote_code must be True or False"),
        (dict(ram_fraction=0), r"ram_fraction must be a number in \(0, 1\]"),
        (dict(ram_fraction=1.5), "ram_fraction must be a number"),
        (dict(ram_fraction=True), "ram_fraction must be a number"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            load_model(folder, **kwargs)
    with pytest.raises(TypeError, match="name_or_path must be a folder or a hub id"):
        load_model(3)
    with pytest.raises(ValueError, match="is a file; pass the folder"):
        load_model(os.path.join(folder, "config.json"))
    with pytest.raises(FileNotFoundError, match="no folder './nowhere'"):
        load_model("./nowhere")


def test_a_hub_id_comes_from_the_hub_or_else_the_local_cache(tmp_path, monkeypatch):
    import huggingface_hub

    _, folder, _ = _checkpoint(tmp_path, "llama")
    calls = []

    def offline_with_cache(repo_id, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, local_files_only, tuple(allow_patterns)))
        if not local_files_only:
            raise ConnectionError("no network")
        return folder

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline_with_cache)
    model = load_model("org/tiny-llama", quantize="none", dtype=torch.float32)
    assert isinstance(model, torch.nn.Module)
    assert calls == [("org/tiny-llama", False, ("*.json", "*.safetensors")), ("org/tiny-llama", True, ("*.json", "*.safetensors"))]  # fmt: skip

    def nothing(repo_id, allow_patterns=None, local_files_only=False):
        raise (OSError("not in the cache") if local_files_only else ConnectionError("no network"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", nothing)
    with pytest.raises(FileNotFoundError, match="'org/tiny-llama' is not a local folder, the hub did not serve it"):
        load_model("org/tiny-llama")


_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch
    import transformers
    from safetensors import safe_open
    from transformers.models.llama import modeling_llama
    from trainstream import ops
    from trainstream.integrations.huggingface import load_model

    # What a first load imports and sets up (transformers, the model's module, the native
    # thread pool) is there before the baseline: only the load itself is measured.
    transformers.AutoConfig, transformers.AutoModelForCausalLM, modeling_llama.LlamaForCausalLM, safe_open
    ops.quantize_nf4(torch.zeros(64))

    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

    peak, running = [0], [True]
    def sample():
        while running[0]:
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    before = anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    model = load_model(sys.argv[1], quantize="nf4", dtype=torch.bfloat16)
    running[0] = False
    thread.join()
    after = anon()
    print(json.dumps({"before": before, "peak": max(peak[0], after), "after": after}))
    """
)


def test_a_quantized_load_holds_far_less_than_the_bfloat16_blocks(tmp_path):
    from safetensors.torch import save_file

    # ~218 MB of bf16 block weights: 8 blocks of 13.6M parameters; random values, written
    # tensor by tensor, so this process never holds the model either.
    config = hf_models.config(
        "llama", hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=512,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    meta = loading.build_on_meta(config, torch.bfloat16, False)
    block_bytes, tensors = 0, {}
    for n, p in meta.named_parameters():
        tensors[n] = (torch.randn(p.shape) * 0.02).to(torch.bfloat16)
        if ".layers." in n:
            block_bytes += tensors[n].numel() * 2
    save_file(tensors, tmp_path / "model.safetensors")
    del tensors
    assert block_bytes > 200e6
    probe = tmp_path / "probe.py"
    probe.write_text(_MEMORY_PROBE)
    out = subprocess.run([sys.executable, str(probe), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    grown = rss["peak"] - rss["before"]
    assert grown < 0.6 * block_bytes, (
        f"anonymous RSS grew by {grown / 1e6:.0f} MB for {block_bytes / 1e6:.0f} MB of bf16 blocks"
    )


@pytest.mark.gpu
def test_gpu_a_loaded_nf4_base_wraps_and_steps_on_cuda(tmp_path):
    from safetensors.torch import save_file

    # ~300 MB of bf16 weights, written with random values
    config = hf_models.config(
        "llama", hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=1024,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    meta = loading.build_on_meta(config, torch.bfloat16, False)
    tensors = {n: (torch.randn(p.shape) * 0.02).to(torch.bfloat16) for n, p in meta.named_parameters()}
    save_file(tensors, tmp_path / "model.safetensors")
    model = load_model(str(tmp_path), quantize="nf4")
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith("norm.weight"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = trainstream.wrap(model.train(), optimizer, device="cuda", offload=True, param_offload=True)
    ids = torch.randint(0, 1024, (2, 64), device="cuda")
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    report = trainstream.memory_report(model)
    assert report["plan"]["quantized"]["tensors"] == 8 * 7 and report["params"]["paged_blocks"]
