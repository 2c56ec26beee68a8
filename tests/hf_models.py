"""Tiny Hugging Face models of each layer kind the engine must serve, and a writer of their
checkpoints as transformers lays them out (config.json plus one or more .safetensors shards
with model.safetensors.index.json). Each factory returns (model, batch(i, device),
loss_fn(model, batch)) as tests/models.py's do."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 101


def _config(kind: str, **overrides):
    transformers = __import__("pytest").importorskip("transformers")
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**{**common, **overrides})
    if kind == "qwen2":
        return transformers.Qwen2Config(**{**common, **overrides})
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **{**common, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96, **overrides}
        )
    if kind == "gpt2":  # Conv1D layers: weights stored (in, out); no dropout, so runs compare bit for bit
        gpt2 = dict(n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0)
        dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2Config(**{**gpt2, **dropout, **overrides})
    if kind == "t5":  # an encoder-decoder: two stacks of T5Block
        t5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=3, num_heads=4)
        return transformers.T5Config(**{**t5, "dropout_rate": 0.0, "decoder_start_token_id": 0, **overrides})
    raise ValueError(f"unknown tiny model kind {kind!r}")


KINDS = ("llama", "qwen2", "gpt2", "mixtral")  # causal LMs
SEQ2SEQ = ("t5",)  # trained by the same batch and loss: labels become the decoder's inputs, shifted


def config(kind: str, **overrides):
    """The tiny config of `kind` (one of KINDS or SEQ2SEQ), with `overrides`."""
    cfg = _config(kind, **overrides)
    cfg.use_cache = False
    return cfg


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny model of `kind` (KINDS or SEQ2SEQ), initialized by transformers from `seed`."""
    transformers = __import__("pytest").importorskip("transformers")
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSeq2SeqLM if kind in SEQ2SEQ else transformers.AutoModelForCausalLM
    model = auto.from_config(config(kind, **overrides))
    model.config.use_cache = False
    return model


def batch(i: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + i)
    return torch.randint(0, VOCAB, (2, 12), generator=g).to(device)


def loss_fn(model, ids):
    return model(input_ids=ids, labels=ids).loss


def factory(kind: str, **overrides):
    """A tests/models.py-style factory for helpers.train (model, batch, loss_fn)."""
    return lambda: (build(kind, **overrides), batch, loss_fn)


def checkpoint_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict:
    """What a transformers checkpoint of `model` holds: its state dict without the tied copies
    (a tied output layer is not saved), contiguous, in `dtype` when given (floats only)."""
    tied = set()
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(model.config, "tie_word_embeddings", False) and out is not None:
        tied = {k for k, v in model.state_dict(keep_vars=True).items() if v is out.weight and k.startswith("lm_head")}
    tensors = {}
    for k, v in model.state_dict().items():
        if k in tied:
            continue
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        tensors[k] = v.contiguous().clone()
    return tensors


def write_checkpoint(model: torch.nn.Module, folder, *, shards: int = 1, dtype: torch.dtype | None = None) -> dict:
    """Write `model` as a transformers checkpoint into `folder`: config.json and `shards`
    .safetensors files (an index json when more than one). Returns the tensors written."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    tensors = checkpoint_tensors(model, dtype)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return tensors
    weight_map = {}
    per = -(-len(names) // shards)
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i * per : (i + 1) * per]}
        save_file(part, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return tensors
