"""Parameters that hold quantized codes instead of their values, before wrap().

quantize_model() and load_model() leave such a parameter with its QuantizedWeight attached
(``codes_of(p)``) and a placeholder as its data: a one-element NaN expanded to the
parameter's shape and dtype, so the full-precision weight never exists in host memory.
wrap() takes the codes as they are (``take``) and streams them like the weights it
quantizes itself; it never quantizes them a second time.

Outside wrap() the model still computes and saves correctly. A module's forward may read a
parameter it does not own (nn.MultiheadAttention hands ``self.out_proj.weight`` to
F.multi_head_attention_forward, and out_proj's own forward never runs), so the hooks sit on
the block of the stack holding the parameter and on every module between it and the owner:
the outermost one running puts a dequantized tensor in the owner's parameter table for the
length of its forward, the inner ones then find it there (a module called on its own, say
recomputed by checkpointing inside the block, serves its own part). The tensor is fresh and
only the table refers to it besides autograd, so autograd keeps exactly what backward needs
and frees it after; the block's weights exist dequantized only during its forward.
``state_dict()`` holds the dequantized values. Assigning to such a parameter's data
(``load_state_dict``, ``p.copy_``) fails on the expanded placeholder instead of writing one
element.

Everything this needs lives in the modules' and parameters' own attributes, so it travels
with torch.save(model) / torch.load and with copy.deepcopy (which drops a parameter's
attributes, the codes among them: the copy's module still names them, and refuses to compute
with the placeholder).
"""

from __future__ import annotations

import weakref

import torch

from .weight import QuantizedWeight

_ATTR = "_trainstream_codes"  # on the parameter: its QuantizedWeight
_OWNER = "_trainstream_codes_owner"  # on the parameter: an _Owner (its module, its name there)
# On the owning module: the names of its parameters that hold codes (the engine taking them
# removes them). It travels with copy.deepcopy, which does not carry a parameter's
# attributes: a copy's parameter without its codes is then found (lost_codes) instead of
# computing with the placeholder's NaN.
_NAMES = "_trainstream_quantized"
# On each hooked module (a block and the modules down to each owner): the (owner, name) of
# every parameter holding codes below it, which its forward pre-hook dequantizes.
_SERVES = "_trainstream_serves"


class _Owner:
    """The module that holds a parameter storing codes, and the parameter's name there. A
    weak reference in memory (the parameter does not keep its module alive), pickled as the
    module itself (torch.save of the model: the module is in the same pickle)."""

    __slots__ = ("ref", "name")

    def __init__(self, module, name: str):
        self.ref = weakref.ref(module) if module is not None else None
        self.name = name

    def module(self):
        return self.ref() if self.ref is not None else None

    def __reduce__(self):
        return (_Owner, (self.module(), self.name))


def codes_of(param: torch.Tensor) -> QuantizedWeight | None:
    """The codes `param` holds in place of its values, or None."""
    return getattr(param, _ATTR, None)


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """One NaN expanded to `shape`: what a parameter holding codes has as its data (a read by
    anything that bypasses the hooks gives NaN, never stale numbers)."""
    return torch.full((1,), float("nan"), dtype=dtype, device=device).expand(shape)


def _path(block: torch.nn.Module, module: torch.nn.Module) -> list:
    """The modules from `block` down to `module`, both included."""
    for name, m in block.named_modules():
        if m is module:
            chain, here = [block], block
            for part in name.split(".") if name else []:
                here = here.get_submodule(part)
                chain.append(here)
            return chain
    raise ValueError(f"the module holding the codes is not inside the block given ({type(block).__name__})")


def store(module: torch.nn.Module, name: str, q: QuantizedWeight, *, block: torch.nn.Module) -> None:
    """Make `module`'s parameter `name` hold `q` instead of its values (the parameter object
    stays the same, so optimizers and peft keep referring to it). `block`: the block of the
    stack that holds `module` (or `module` itself): its forward serves the parameter, since
    any module in it may read it."""
    param = module._parameters[name]
    if param.requires_grad:
        raise ValueError(f"a parameter that requires grad cannot hold quantized codes ({name})")
    if tuple(q.shape) != tuple(param.shape) or q.dtype != param.dtype:
        raise ValueError(
            f"codes for {name} are {tuple(q.shape)} {q.dtype}, the parameter is {tuple(param.shape)} {param.dtype}"
        )
    chain = _path(block, module)
    param.data = placeholder(param.shape, param.dtype, q.device)
    setattr(param, _ATTR, q)
    setattr(param, _OWNER, _Owner(module, name))
    if _NAMES not in module.__dict__:
        module.__dict__[_NAMES] = set()
        module.register_state_dict_post_hook(_dequantize_in_state_dict)
    module.__dict__[_NAMES].add(name)
    for m in chain:
        if _SERVES not in m.__dict__:
            m.__dict__[_SERVES] = []
            # First among the pre-hooks, so that its frame is pushed before any other can raise
            # (the forward hook, called even then, pops it).
            m.register_forward_pre_hook(_dequantize_for_forward, prepend=True)
            m.register_forward_hook(_put_back, always_call=True)  # a forward that raised too
        if not any(o is module and n == name for o, n in m.__dict__[_SERVES]):
            m.__dict__[_SERVES].append((module, name))


def take(param: torch.Tensor) -> QuantizedWeight:
    """Hand the codes to their new owner (the engine at wrap()): the parameter no longer
    holds them, and the hooks leave it alone from now on."""
    q = getattr(param, _ATTR)
    owner = getattr(param, _OWNER)
    module = owner.module()
    if module is not None:
        module.__dict__.get(_NAMES, set()).discard(owner.name)
    delattr(param, _ATTR)
    delattr(param, _OWNER)
    return q


def taken_back(param: torch.Tensor) -> None:
    """`param` holds its codes again (its attributes were put back: a wrap() that failed after
    take): its module names it again, so that a copy of the model that loses them refuses to
    compute (lost_codes)."""
    owner = getattr(param, _OWNER)
    module = owner.module()
    if module is not None and _NAMES in module.__dict__:
        module.__dict__[_NAMES].add(owner.name)


def _is_lost(module, name: str) -> bool:
    # A Parameter without codes under a name the module still holds codes for. A plain tensor
    # there is the dequantized weight an enclosing module's forward put in (not lost).
    p = module._parameters.get(name)
    return isinstance(p, torch.nn.Parameter) and codes_of(p) is None


def lost_codes(module) -> list:
    """Names of `module`'s parameters that were stored as codes and no longer hold them
    (a copy.deepcopy of the model); the engine taking them (take) does not count."""
    names = module.__dict__.get(_NAMES)
    if not names:
        return []
    return [n for n in sorted(names) if _is_lost(module, n)]


def _refuse_lost(module, name: str) -> None:
    raise RuntimeError(
        f"trainstream: {type(module).__name__}.{name} was stored quantized, and this copy of it lost its "
        "codes (copy.deepcopy does not carry them): copy the model before quantizing it, or quantize the copy"
    )


def _check(module) -> None:
    lost = lost_codes(module)
    if lost:
        _refuse_lost(module, lost[0])


def _held(module) -> list:
    _check(module)
    return [(n, p, q) for n, p in module._parameters.items() if p is not None and (q := codes_of(p)) is not None]


# The parameters a module's forward replaced, restored by its forward hook (a module may
# run again inside its own forward, say under reentrant checkpointing: one frame per call,
# pushed even when empty so that every forward hook pops its own).
_swapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _dequantize_for_forward(module, args):
    frame = []
    _swapped.setdefault(module, []).append(frame)
    for owner, n in module.__dict__.get(_SERVES, ()):
        if n not in owner.__dict__.get(_NAMES, ()):  # taken by the engine
            continue
        p = owner._parameters.get(n)
        q = codes_of(p) if p is not None else None
        if q is None:
            if _is_lost(owner, n):
                _refuse_lost(owner, n)
            continue  # already dequantized by an enclosing module's forward
        frame.append((owner, n, p))
        owner._parameters[n] = q.dequantize()
    return None


def _put_back(module, args, output):
    stack = _swapped.get(module)
    if stack:
        for owner, n, p in stack.pop():
            owner._parameters[n] = p
    return None


def _dequantize_in_state_dict(module, state_dict, prefix, local_metadata):
    for n, _, q in _held(module):
        if prefix + n in state_dict:
            state_dict[prefix + n] = q.dequantize().detach()
