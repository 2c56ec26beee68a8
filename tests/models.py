"""The small models the tests train: a GPT (its blocks under torch.utils.checkpoint too), a
stack of Linear layers, and tiny Hugging Face Llama and Qwen2 models. Each factory returns
(model, batch(i, device), loss_fn(model, batch))."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    dim: int = 64
    layers: int = 4
    heads: int = 4
    vocab: int = 97


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
    """A pre-norm GPT: embedding, a stack of Blocks, final norm and head; forward(idx, tgt)
    returns the cross-entropy loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm, self.head = nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for blk in self.layers:
            x = blk(x)
        return F.cross_entropy(self.head(self.norm(x)).float().flatten(0, 1), tgt.flatten())


def mlp(layers: int, dim: int) -> nn.Sequential:
    """A stack of bias-free square Linear layers."""
    return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])


def mlp_loss(model, x):
    return model(x).float().pow(2).mean()


def tiny_gpt(dim=64, layers=4, heads=4, vocab=97):
    model = GPT(GPTConfig(dim=dim, layers=layers, heads=heads, vocab=vocab))
    vocab_ = vocab

    def batch(i, device):
        g = torch.Generator().manual_seed(1000 + i)
        idx = torch.randint(0, vocab_, (4, 16), generator=g)
        return (idx.to(device), torch.roll(idx, -1, 1).to(device))

    return model, batch, lambda m, b: m(*b)


def tiny_mlp(layers=6, dim=256, rows=8):
    model = mlp(layers, dim)

    def batch(i, device):
        return torch.randn(rows, dim, generator=torch.Generator().manual_seed(2000 + i)).to(device)

    return model, batch, mlp_loss


def _hf(kind: str):
    transformers = __import__("pytest").importorskip("transformers")
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=64,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    model.config.use_cache = False

    def batch(i, device):
        g = torch.Generator().manual_seed(3000 + i)
        return torch.randint(0, 101, (2, 12), generator=g).to(device)

    return model, batch, lambda m, ids: m(input_ids=ids, labels=ids).loss


MODELS = {"gpt": tiny_gpt, "mlp": tiny_mlp, "llama": lambda: _hf("llama"), "qwen2": lambda: _hf("qwen2")}


def checkpointed_gpt(reentrant: bool, forwards: list | None = None, shared_gain: bool = False):
    """A factory for tiny_gpt's model (the same weights) with every block run under
    torch.utils.checkpoint. `forwards` collects each block forward, recomputes included;
    `shared_gain` adds a parameter that every checkpointed segment uses."""
    from torch.utils.checkpoint import checkpoint

    class CheckpointedGPT(GPT):
        def __init__(self, config):
            super().__init__(config)
            if shared_gain:
                self.norm.gain = torch.nn.Parameter(torch.ones(config.dim))

        def forward(self, idx, tgt):
            x = self.emb(idx)
            for blk in self.layers:
                segment = (lambda x, blk=blk: blk(x) * self.norm.gain) if shared_gain else blk
                x = checkpoint(segment, x, use_reentrant=reentrant)
            return torch.nn.functional.cross_entropy(self.head(self.norm(x)).float().flatten(0, 1), tgt.flatten())

    def factory():
        model, batch, loss_fn = tiny_gpt()
        checkpointed = CheckpointedGPT(GPTConfig(dim=64, layers=4, heads=4, vocab=97))
        checkpointed.load_state_dict(model.state_dict(), strict=False)
        if forwards is not None:
            for blk in checkpointed.layers:
                blk.register_forward_pre_hook(lambda m, a: forwards.append(m))
        return checkpointed, batch, loss_fn

    return factory
