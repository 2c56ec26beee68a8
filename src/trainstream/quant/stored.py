"""Parameters that hold quantized codes instead of their values, before wrap().

quantize_model() and load_model() leave such a parameter with its QuantizedWeight attached
(``codes_of(p)``) and a placeholder as its data: a one-element NaN expanded to the
parameter's shape and dtype, so the full-precision weight never exists in host memory.
wrap() takes the codes as they are (``take``) and streams them like the weights it
quantizes itself; it never quantizes them a second time.

Outside wrap() the model still computes and saves correctly: hooks on each owning module
put a dequantized tensor in the module's parameter table for the length of its forward (a
fresh tensor, so autograd keeps exactly what backward needs and frees it after), and
``state_dict()`` holds the dequantized values. Assigning to such a parameter's data
(``load_state_dict``, ``p.copy_``) fails on the expanded placeholder instead of writing
one element.
"""

from __future__ import annotations

import weakref

import torch

from .weight import QuantizedWeight

_ATTR = "_trainstream_codes"  # on the parameter: its QuantizedWeight
_OWNER = "_trainstream_codes_owner"  # on the parameter: (weak reference to its module, its name there)
# On the module: the names of its parameters that hold codes. It travels with copy.deepcopy,
# which does not carry a parameter's attributes: a copy's parameter without its codes is
# then found (lost_codes) instead of computing with the placeholder's NaN.
_NAMES = "_trainstream_quantized"
_hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its hook handles


def codes_of(param: torch.Tensor) -> QuantizedWeight | None:
    """The codes `param` holds in place of its values, or None."""
    return getattr(param, _ATTR, None)


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """One NaN expanded to `shape`: what a parameter holding codes has as its data (a read by
    anything that bypasses the hooks gives NaN, never stale numbers)."""
    return torch.full((1,), float("nan"), dtype=dtype, device=device).expand(shape)


def store(module: torch.nn.Module, name: str, q: QuantizedWeight) -> None:
    """Make `module`'s parameter `name` hold `q` instead of its values (the parameter object
    stays the same, so optimizers and peft keep referring to it)."""
    param = module._parameters[name]
    if param.requires_grad:
        raise ValueError(f"a parameter that requires grad cannot hold quantized codes ({name})")
    if tuple(q.shape) != tuple(param.shape) or q.dtype != param.dtype:
        raise ValueError(
            f"codes for {name} are {tuple(q.shape)} {q.dtype}, the parameter is {tuple(param.shape)} {param.dtype}"
        )
    param.data = placeholder(param.shape, param.dtype, q.device)
    setattr(param, _ATTR, q)
    setattr(param, _OWNER, (weakref.ref(module), name))
    module.__dict__.setdefault(_NAMES, set()).add(name)
    if module not in _hooked:
        _hooked[module] = (
            module.register_forward_pre_hook(_dequantize_for_forward),
            module.register_forward_hook(_put_back, always_call=True),  # a forward that raised too
            module.register_state_dict_post_hook(_dequantize_in_state_dict),
        )


def take(param: torch.Tensor) -> QuantizedWeight:
    """Hand the codes to their new owner (the engine at wrap()): the parameter no longer
    holds them, and its module's hooks leave it alone from now on."""
    q = getattr(param, _ATTR)
    owner, name = getattr(param, _OWNER)
    module = owner()
    if module is not None:
        module.__dict__.get(_NAMES, set()).discard(name)
    delattr(param, _ATTR)
    delattr(param, _OWNER)
    return q


def lost_codes(module) -> list:
    """Names of `module`'s parameters that were stored as codes and no longer hold them
    (a copy.deepcopy of the model); the engine taking them (take) does not count."""
    names = module.__dict__.get(_NAMES)
    if not names:
        return []
    return [
        n for n in sorted(names) if module._parameters.get(n) is not None and codes_of(module._parameters[n]) is None
    ]


def _check(module) -> None:
    lost = lost_codes(module)
    if lost:
        raise RuntimeError(
            f"trainstream: {type(module).__name__}.{lost[0]} was stored quantized, and this copy of it lost its "
            "codes (copy.deepcopy does not carry them): copy the model before quantizing it, or quantize the copy"
        )


def _held(module) -> list:
    _check(module)
    return [(n, p, q) for n, p in module._parameters.items() if p is not None and (q := codes_of(p)) is not None]


# The parameters a module's forward replaced, restored by its forward hook (a module may
# run again inside its own forward, say under reentrant checkpointing: one list per call).
_swapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _dequantize_for_forward(module, args):
    held = _held(module)
    if not held:
        return None
    for n, _, q in held:
        module._parameters[n] = q.dequantize()
    _swapped.setdefault(module, []).append([(n, p) for n, p, _ in held])
    return None


def _put_back(module, args, output):
    stack = _swapped.get(module)
    if stack:
        for n, p in stack.pop():
            module._parameters[n] = p
    return None


def _dequantize_in_state_dict(module, state_dict, prefix, local_metadata):
    for n, _, q in _held(module):
        if prefix + n in state_dict:
            state_dict[prefix + n] = q.dequantize().detach()
