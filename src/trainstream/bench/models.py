"""The models the engine bench and tests train: the anchors' GPT and MLP, so our figures
and the peers' are measured on the same shapes."""

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
