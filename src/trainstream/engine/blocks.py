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


def _stacks(model: torch.nn.Module) -> list:
    """(name, parameters, children) of every nn.ModuleList / nn.Sequential of two or more
    modules of one class holding parameters, in module order."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        params = _numel(module)
        if len(children) < 2 or len({type(c) for c in children}) != 1 or params == 0:
            continue
        found.append((name, params, children))
    return found


def _inside(name: str, other: str) -> bool:
    return other == "" or name == other or name.startswith(other + ".")


# A second stack of the same block class joins the first when it holds at least this share of
# the first's parameters (T5's encoder blocks lack the decoder's cross-attention: about 2/3).
SIBLING_SHARE = 0.25


def find_blocks(model: torch.nn.Module) -> BlockStack:
    """The nn.ModuleList / nn.Sequential of two or more modules of one class that holds the
    most parameters (ties: the longer one, then the first in module order), joined by every
    other such stack of the same block class, not inside it nor around it (an encoder-decoder's
    encoder and decoder stacks, both T5Block in T5).

    Ranking by parameters rather than length alone picks a transformer's layers over, say,
    the 64 experts inside each layer of a mixture-of-experts model. The joined stacks'
    blocks are in module order, which the engine takes as the order they run in (T5 runs
    its encoder before its decoder); pass blocks=[...] where a model runs them otherwise.
    Only block classes defined outside torch.nn join: two lists of plain nn.Linear layers
    are no evidence of one model's repeated layers."""
    total = _numel(model)
    stacks = _stacks(model)
    if not stacks:
        return BlockStack("", [], 0, total)
    index = {name: i for i, (name, _, _) in enumerate(stacks)}
    best = max(stacks, key=lambda st: (st[1], len(st[2]), -index[st[0]]))
    kind = type(best[2][0])
    joined = [best]
    if not kind.__module__.startswith("torch.nn"):
        for st in stacks:
            name, params, children = st
            if (
                type(children[0]) is kind
                and params >= SIBLING_SHARE * best[1]
                and not any(_inside(name, n) or _inside(n, name) for n, _, _ in joined)
            ):
                joined.append(st)
    joined.sort(key=lambda st: index[st[0]])
    blocks = [b for _, _, children in joined for b in children]
    return BlockStack(" + ".join(st[0] for st in joined), blocks, sum(st[1] for st in joined), total)


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
