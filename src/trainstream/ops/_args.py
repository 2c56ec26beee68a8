"""Argument checks the ops share, before anything reaches the native module.

A value of the wrong kind (not a tensor, not a number, not a sequence) is a TypeError, a
value of the right kind outside what the op accepts a ValueError; each message starts with
the op and names the argument and what is accepted. The bounds of `threads` and
`block_size` are those of the public options (:mod:`trainstream.options`), so an op never
accepts a value that only fails later, in the native allocator or the thread pool.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .. import options


def tensor(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def tensors(op: str, name: str, value) -> Sequence[torch.Tensor]:
    """A list or tuple of tensors (a single tensor is refused: iterating it would yield rows)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list or tuple of torch.Tensor, got {type(value).__name__}")
    for i, t in enumerate(value):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return value


_INT = {int}


def integers(op: str, name: str, value, n: int, low: int | None = None) -> list[int]:
    """A list or tuple of `n` integers (each >= `low` when given), as Python ints."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list or tuple of integers, got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{op}: {name} has {len(value)} entries, params has {n}")
    # Plain ints (a bool's type is bool), the common case, checked in C: a LoRA's update
    # passes a step count per adapter tensor, hundreds, at every step.
    if set(map(type, value)) <= _INT and (low is None or not value or min(value) >= low):
        return list(value)
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{op}: {name}[{i}] must be an integer, got {type(v).__name__}")
        if low is not None and v < low:
            raise ValueError(f"{op}: {name}[{i}] must be >= {low}, got {v}")
        out.append(int(v))
    return out


def out_buffer(op: str, name: str, value: torch.Tensor, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    """A tensor an op writes `numel` elements of `dtype` into at its address: contiguous,
    of exactly that dtype and element count, on `device` (any shape of that many
    elements). Anything else is a ValueError naming `name`: the native side would write
    past its end, between its elements, or read its bytes as another type."""
    if value.dtype != dtype or value.numel() != numel or value.device != device or not value.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be a contiguous {dtype} tensor of {numel} elements on {device}, got "
            f"{'a' if value.is_contiguous() else 'a non-contiguous'} {value.dtype} tensor of {value.numel()} "
            f"elements on {value.device}"
        )


def real(op: str, name: str, value) -> float:
    """A real number (not a bool), as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
    return float(value)


def integer(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an integer, got {type(value).__name__}")
    return int(value)


def flag(op: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be True or False, got {value!r}")
    return value


def shape(op: str, name: str, value) -> tuple[int, ...]:
    """A sequence of integer sizes >= 0 (a torch.Size, a list, a tuple), as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{op}: {name} must be a torch.Size, list or tuple of integers >= 0, got {value!r}")
    sizes = []
    for s in value:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise TypeError(f"{op}: {name} must hold integers >= 0, got {value!r}")
        if s < 0:
            raise ValueError(f"{op}: {name} must hold integers >= 0, got {tuple(value)!r}")
        sizes.append(int(s))
    return tuple(sizes)


def dtype(op: str, name: str, value, allowed: tuple) -> torch.dtype:
    if not isinstance(value, torch.dtype) or value not in allowed:
        raise ValueError(f"{op}: {name} must be one of {[str(d) for d in allowed]}, got {value!r}")
    return value


def block_size(op: str, value) -> int:
    """An even integer from 2 to options.MAX_QUANT_BLOCK_SIZE, as quant_block_size (and, as
    that option, any other value is a ValueError)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not (2 <= value <= options.MAX_QUANT_BLOCK_SIZE and value % 2 == 0)
    ):
        raise ValueError(
            f"{op}: block_size must be an even integer >= 2 and <= {options.MAX_QUANT_BLOCK_SIZE}, got {value!r}"
        )
    return int(value)


def threads(op: str, value) -> int | None:
    """None, or an integer from 1 to the cores this process may use, as the threads option
    (and, as that option, any other value is a ValueError)."""
    if value is None:
        return None
    cores = options.available_cores()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= cores:
        raise ValueError(
            f"{op}: threads must be None or an integer >= 1 and <= {cores} (the cores this process may use), "
            f"got {value!r}"
        )
    return int(value)
