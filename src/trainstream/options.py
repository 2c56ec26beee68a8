"""Every option of ``trainstream.wrap()``: accepted values, defaults, normalization and the
error a bad value gets. The table is the public contract (../shared/SPEC.md); wrap()
validates all of it up front, including options whose behaviour later stages deliver, so
a typo never silently does nothing.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class _Spec:
    def __init__(self, default: Any, accepted: str, normalize: Callable[[Any], Any]):
        self.default = default
        self.accepted = accepted
        self.normalize = normalize  # returns the normalized value, or raises _Reject


class _Reject(Exception):
    pass


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not _is_bool(v)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not _is_bool(v)


def _one_of(*choices):
    def normalize(v):
        for c in choices:
            if v is c or (type(v) is type(c) and v == c):
                return v
        raise _Reject

    return normalize


def _fraction_or(*choices):
    """One of `choices`, or a float in [0, 1]."""
    pick = _one_of(*choices)

    def normalize(v):
        if _is_real(v):
            if 0.0 <= float(v) <= 1.0:
                return float(v)
            raise _Reject
        return pick(v)

    return normalize


def _param_offload(v):
    if isinstance(v, (list, tuple)):
        if not all(_is_int(i) and i >= 0 for i in v) or len(set(v)) != len(v):
            raise _Reject
        return sorted(int(i) for i in v)
    return _fraction_or("auto", True, False)(v)


def _quantize(v):
    if v is None or v is False or v == "none":
        return "none"
    return _one_of("auto", "int8", "nf4")(v)


def _moment_dtype(v):
    if v is torch.bfloat16 or v in ("bfloat16", "bf16"):
        return torch.bfloat16
    if v == "float32":
        return torch.float32
    return _one_of("auto")(v)


def _device(v):
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = torch.device(v)
        except RuntimeError:
            raise _Reject from None
    if isinstance(v, torch.device) and v.type in ("cpu", "cuda"):
        return v
    raise _Reject


def _blocks(v):
    if v is None:
        return None
    if (
        isinstance(v, (list, tuple, torch.nn.ModuleList))
        and len(v) > 0
        and all(isinstance(m, torch.nn.Module) for m in v)
    ):
        return list(v)
    raise _Reject


def _profile(v):
    if _is_bool(v):
        return v
    try:
        from .planner import HardwareProfile  # the memory planner's class (its own issue)
    except ImportError:
        raise _Reject from None
    if isinstance(v, HardwareProfile):
        return v
    raise _Reject


def _check(pred):
    def normalize(v):
        if pred(v):
            return v
        raise _Reject

    return normalize


def _optional(pred):
    return _check(lambda v: v is None or pred(v))


SPECS: dict[str, _Spec] = {
    "optimizer_mode": _Spec("cpu", "'cpu', 'gpu', 'auto'", _one_of("cpu", "gpu", "auto")),
    "offload": _Spec("auto", "'auto', True", _one_of("auto", True)),
    "activation_offload": _Spec("auto", "'auto', True, False, a float in [0, 1]", _fraction_or("auto", True, False)),
    "param_offload": _Spec(
        "auto", "'auto', True, False, a float in [0, 1], a list of distinct block indices >= 0", _param_offload
    ),
    "quantize": _Spec("auto", "'auto', 'none', None, False, 'int8', 'nf4'", _quantize),
    "quant_block_size": _Spec(64, "an even integer >= 2", _check(lambda v: _is_int(v) and v >= 2 and v % 2 == 0)),
    "prefer": _Spec("exact", "'exact', 'speed'", _one_of("exact", "speed")),
    "moment_dtype": _Spec("auto", "'auto', 'float32', 'bfloat16', 'bf16', torch.bfloat16", _moment_dtype),
    "device": _Spec(None, "None, 'cuda', 'cuda:N', 'cpu', a torch.device", _device),
    "blocks": _Spec(None, "None, a non-empty list of modules", _blocks),
    "distributed": _Spec(None, "None, True, False", _one_of(None, True, False)),
    "guard_params": _Spec(True, "True, False", _one_of(True, False)),
    "max_grad_norm": _Spec(None, "None, a float > 0", _optional(lambda v: _is_real(v) and v > 0)),
    "accumulation_steps": _Spec(1, "an integer >= 1", _check(lambda v: _is_int(v) and v >= 1)),
    "vram_headroom": _Spec(0.10, "a float in [0, 1]", _check(lambda v: _is_real(v) and 0.0 <= v <= 1.0)),
    "check_memory": _Spec(True, "True, False", _one_of(True, False)),
    "max_inflight_bytes": _Spec(
        None, "None, an integer number of bytes > 0", _optional(lambda v: _is_int(v) and v > 0)
    ),
    "max_activation_slowdown": _Spec(0.15, "a float >= 0", _check(lambda v: _is_real(v) and v >= 0)),
    "prefetch_depth": _Spec(1, "an integer >= 1", _check(lambda v: _is_int(v) and v >= 1)),
    "min_offload_bytes": _Spec(1 << 20, "an integer number of bytes >= 0", _check(lambda v: _is_int(v) and v >= 0)),
    "threads": _Spec(None, "None, an integer >= 1", _optional(lambda v: _is_int(v) and v >= 1)),
    "profile": _Spec(True, "True, False, a HardwareProfile", _profile),
    "lr": _Spec(1e-3, "a float >= 0", _check(lambda v: _is_real(v) and v >= 0)),
    "verbose": _Spec(False, "True, False", _one_of(True, False)),
}


@dataclass(frozen=True)
class Options:
    """The validated, normalized options of one wrap() call. `given` names the options the
    caller set explicitly (the planner treats those as constraints)."""

    values: dict = field(default_factory=dict)
    given: frozenset = frozenset()

    def __getattr__(self, name: str):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def parse(options: dict) -> Options:
    """Validate and normalize wrap()'s keyword options; ValueError names the first bad one."""
    unknown = [k for k in options if k not in SPECS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, SPECS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"wrap(): unknown option {name!r}{hint}; accepted options: {', '.join(SPECS)}")
    values = {}
    for name, spec in SPECS.items():
        value = options.get(name, spec.default)
        try:
            values[name] = spec.normalize(value)
        except _Reject:
            raise ValueError(f"wrap(): option {name!r} got {value!r}; accepted: {spec.accepted}") from None
    return Options(values, frozenset(options))
