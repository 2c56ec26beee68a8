"""The models the engine bench and tests train: the anchors' GPT and MLP, so our figures
and the peers' are measured on the same shapes; and the published sizes of the hub models the
hf suite and examples/ stand in for (PUBLISHED, hub_config)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    dim: int = 2048
    layers: int = 36
    heads: int = 16
    vocab: int = 32000


GPT_1_9B = GPTConfig()


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.dim
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        # q, k and v are views of one projection: a real test of storage-level paging.
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPT_1_9B):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm, self.head = nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for blk in self.layers:
            x = blk(x)
        return F.cross_entropy(self.head(self.norm(x)).float().flatten(0, 1), tgt.flatten())


def mlp(layers: int = 24, dim: int = 4096) -> nn.Sequential:
    """The anchors' 402M-parameter MLP: a stack of bias-free square Linear layers."""
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def mlp_loss(model, x):
    return model(x).float().pow(2).mean()


def _shape(hidden, intermediate, layers, heads, kv_heads, vocab, eps, tied, rope=1000000.0, positions=131072) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        rope_theta=rope,
        rms_norm_eps=eps,
        tie_word_embeddings=tied,
    )


# name -> (transformers model_type, the config.json fields that set the shapes), as published
# on the hub (random weights stand in for the real ones).
PUBLISHED = {
    "qwen2.5-1.5b": ("qwen2", _shape(1536, 8960, 28, 12, 2, 151936, 1e-6, True)),
    "qwen2.5-7b": ("qwen2", _shape(3584, 18944, 28, 28, 4, 152064, 1e-6, False)),
    "qwen2.5-14b": ("qwen2", _shape(5120, 13824, 48, 40, 8, 152064, 1e-5, False)),
    "qwen2.5-32b": ("qwen2", _shape(5120, 27648, 64, 40, 8, 152064, 1e-5, False)),
    "llama-3-70b": ("llama", _shape(8192, 28672, 80, 64, 8, 128256, 1e-5, False, rope=500000.0, positions=8192)),
}
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def hub_config(name: str) -> dict:
    """The config.json of PUBLISHED[name], as load_model(random_weights=True) reads it."""
    model_type, shape = PUBLISHED[name]
    return dict(architectures=[_ARCHITECTURES[model_type]], model_type=model_type, hidden_act="silu", **shape)
