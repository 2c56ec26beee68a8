"""Finding the repeated block stack: the layers whose weights, gradients and activations the
engine streams one block at a time. Everything outside the stack (embeddings, final norm,
head) stays resident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockStack:
    name: str  # qualified name in the model, "" when no stack was found
    blocks: list  # the block modules, in order
    params_in_blocks: int  # parameters inside the stack
    params_total: int  # parameters in the whole model

    def describe(self) -> str:
        if not self.blocks:
            return (
                "no repeated block stack found: every parameter is treated as outside the stack "
                "(pass blocks=[...] to name it)"
            )
        kind = type(self.blocks[0]).__name__
        share = self.params_in_blocks / max(self.params_total, 1)
        return (
            f"block stack '{self.name}': {len(self.blocks)} x {kind}, "
            f"{self.params_in_blocks:,} of {self.params_total:,} parameters ({share:.0%})"
        )


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: torch.nn.Module) -> BlockStack:
    """The nn.ModuleList / nn.Sequential of two or more modules of one class that holds the
    most parameters (ties: the longer one, then the first in module order).

    Ranking by parameters rather than length alone picks a transformer's layers over, say,
    the 64 experts inside each layer of a mixture-of-experts model."""
    total = _numel(model)
    best = BlockStack("", [], 0, total)
    best_key = (0, 0)
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        params = _numel(module)
        key = (params, len(children))
        if params > 0 and key > best_key:
            best, best_key = BlockStack(name, children, params, total), key
    return best


def named_stack(model: torch.nn.Module, blocks: list) -> BlockStack:
    """The stack a caller named with blocks=[...]: each must be a submodule of `model`,
    and no block may contain another."""
    names = {id(m): n for n, m in model.named_modules()}
    missing = [i for i, b in enumerate(blocks) if id(b) not in names]
    if missing:
        raise ValueError(f"blocks[{missing[0]}] is not a submodule of the model")
    ids = {id(b) for b in blocks}
    if len(ids) != len(blocks):
        raise ValueError("blocks lists the same module twice")
    for i, b in enumerate(blocks):
        inner = [m for m in b.modules() if m is not b and id(m) in ids]
        if inner:
            raise ValueError(f"blocks[{i}] ('{names[id(b)]}') contains another listed block ('{names[id(inner[0])]}')")
    first = names[id(blocks[0])]
    parent = first.rsplit(".", 1)[0] if "." in first else ""
    return BlockStack(parent, list(blocks), sum(_numel(b) for b in blocks), _numel(model))
