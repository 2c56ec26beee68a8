"""When a block may be recomputed in backward, and the checkpoint call that recomputes it.

A recompute runs the block's forward a second time, in backward, and autograd takes the
second run's saved tensors for the first's. That is exact only when the forward is a function
of its inputs, its weights and the RNG state alone. Two kinds of block break that, and the
planner's choice must give way to paging for them (a block the user checkpoints is not ours to
judge: it is never checkpointed again):
- a call that carries a key/value cache (Hugging Face decoder layers get one whenever
  use_cache is on, the configs' default): the recompute appends its keys and values to the
  same cache a second time, so the recomputed attention sees twice the keys (a shape error in
  backward, or with a kernel that aligns the causal mask to the end, wrong gradients);
- a module that updates its own state in forward (BatchNorm's running statistics and its
  batch count in training): the second forward updates them again.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

# Keyword arguments through which a decoder layer receives its cache (transformers and
# older GPT-style blocks); a non-None value is a cache to update.
CACHE_ARGUMENTS = ("past_key_value", "past_key_values", "layer_past", "cache", "cache_params")


def _is_cache(x) -> bool:
    # A transformers Cache (DynamicCache, StaticCache, ...) without importing transformers.
    return hasattr(x, "update") and hasattr(x, "get_seq_length")


def state_in_forward(block: torch.nn.Module) -> str | None:
    """Why `block`'s forward changes the block's own state (so a recompute would change it
    twice), or None: a normalization layer tracking running statistics in training."""
    for name, m in block.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats:
            where = f" ({name})" if name else ""
            return f"{type(m).__name__}{where} updates its running statistics in forward"
    return None


def cache_in_call(args: tuple, kwargs: dict) -> str | None:
    """Why this call of a block updates a key/value cache (so a recompute would update it
    twice), or None."""
    if kwargs.get("use_cache"):
        return "its call has use_cache=True (the recompute would add to the cache again)"
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return f"its call carries {name} (the recompute would add to the cache again)"
    if any(_is_cache(v) for v in (*args, *kwargs.values())):
        return "its call carries a key/value cache (the recompute would add to it again)"
    return None


def why_not_recompute(block: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this call of `block` must not be recomputed in backward, or None."""
    return state_in_forward(block) or cache_in_call(args, kwargs)


def _drop_anchor(fn, anchor, *args):
    return fn(*args)


def recompute_call(fn, args: tuple, kwargs: dict, device: torch.device):
    """fn(*args, **kwargs) under a non-reentrant checkpoint: its activations are recomputed in
    backward, with the RNG state of its forward. torch's checkpoint stashes a device's RNG
    state only for devices its positional tensors are on, and it reads some keyword names as
    its own (preserve_rng_state, context_fn, determinism_check, debug, use_reentrant): so the
    call's keywords travel bound to fn, and a zero-size tensor on `device` goes first."""
    anchor = torch.empty(0, device=device)
    return checkpoint(
        functools.partial(_drop_anchor, functools.partial(fn, **kwargs)), anchor, *args, use_reentrant=False
    )
