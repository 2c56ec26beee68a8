"""Small models and a training loop shared by the engine tests (CPU path and GPU)."""

from __future__ import annotations

import contextlib

import torch

import trainstream
from trainstream.bench.models import GPT, GPTConfig, mlp, mlp_loss


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


def train(
    name: str,
    wrap_options: dict | None,
    *,
    steps: int = 10,
    device: str = "cpu",
    autocast=None,
    accumulation: int = 1,
    clip: float | None = None,
    lr: float = 1e-2,
    dtype=None,
    freeze=None,
    seed: int = 0,
    model_factory=None,
):
    """Train `name` for `steps` steps, stock (wrap_options None) or wrapped; return the
    losses, a host copy of the final state dict, and (model, optimizer)."""
    torch.manual_seed(seed)
    model, batch, loss_fn = (model_factory or MODELS[name])()
    if dtype is not None:
        model = model.to(dtype)
    if freeze is not None:
        for n, p in model.named_parameters():
            if freeze(n):
                p.requires_grad_(False)
    if wrap_options is None:
        model = model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01, foreach=False)
    if wrap_options is not None:
        # offload=True unless a test asks otherwise: "auto" would switch these small models to
        # stock training after two steps, and the tests are about the engine.
        opts = dict(device=device, accumulation_steps=accumulation, max_grad_norm=clip, offload=True)
        opts.update(wrap_options)
        model, opt = trainstream.wrap(model, opt, **opts)
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            ctx = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model, batch(step * accumulation + micro, device))
            (loss / accumulation).backward()
            losses.append(loss.item())
        if wrap_options is None and clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return losses, state, (model, opt)


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


PAGED = dict(param_offload=True, activation_offload=True, min_offload_bytes=0)
RESIDENT = dict(param_offload=False, activation_offload=False)


def assert_same_bits(a, b):
    la, sa = a[0], a[1]
    lb, sb = b[0], b[1]
    assert la == lb, f"losses differ: {la} vs {lb}"
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs (max {(sa[k].float() - sb[k].float()).abs().max()})"


def max_diff(sa, sb) -> float:
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)
