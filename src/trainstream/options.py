"""Every option a public call takes: accepted values, defaults, normalization, meaning and
the error a bad value gets. The table is the public contract (../shared/SPEC.md), written
once for every caller, so ``wrap()`` and ``OffloadAdamW`` cannot drift apart. wrap()
validates all of its options up front, including those whose behaviour later stages
deliver, so a typo never silently does nothing.

``python -m trainstream.options > docs/options.md`` writes the reference from this table.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .sizes import MiB

WRAP = "wrap"
OFFLOAD_ADAMW = "OffloadAdamW"
# Every caller that validates through this table. A new caller (load_model, quantize_model)
# joins by adding its name here and to the `used_by` of each option it takes.
CALLERS = (WRAP, OFFLOAD_ADAMW)

# The largest quant_block_size: one scale per 4096 values is already the coarsest format
# in use (bitsandbytes' range); larger blocks only lose precision and allocate per block.
MAX_QUANT_BLOCK_SIZE = 4096


class _Reject(Exception):
    """A normalizer's refusal; its text, when it has one, is a detail for the error."""


@dataclass(frozen=True)
class Option:
    default: Any
    accepted: str
    normalize: Callable[[Any], Any]  # returns the normalized value, or raises _Reject
    meaning: str  # one line, from SPEC.md
    used_by: tuple[str, ...] = (WRAP,)
    # caller -> the fields (default, accepted, normalize, meaning) that differ for it
    differs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def for_caller(self, caller: str) -> Option:
        return dataclasses.replace(self, **self.differs.get(caller, {}))


# -- normalizers ------------------------------------------------------------------------------


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


def _check(pred):
    def normalize(v):
        if pred(v):
            return v
        raise _Reject

    return normalize


def _optional(pred):
    return _check(lambda v: v is None or pred(v))


def _integer(pred):
    """An integer (of any integral type) for which `pred` holds, as a Python int."""

    def normalize(v):
        if _is_int(v) and pred(v):
            return int(v)
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


def _quant_block_size(v):
    if _is_int(v) and 2 <= v <= MAX_QUANT_BLOCK_SIZE and v % 2 == 0:
        return int(v)
    raise _Reject


_MOMENT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _moment_dtype_exact(v):
    """A moment dtype named outright: a spelling of float32 or bfloat16."""
    if v is torch.float32 or v is torch.bfloat16:
        return v
    if isinstance(v, str) and v in _MOMENT_DTYPES:
        return _MOMENT_DTYPES[v]
    raise _Reject


def _moment_dtype(v):
    return "auto" if isinstance(v, str) and v == "auto" else _moment_dtype_exact(v)


def _device(v):
    if v is None:
        return None
    if isinstance(v, str):
        try:
            parsed = torch.device(v)
        except RuntimeError:
            raise _Reject from None
        # torch holds the index in 8 bits: "cuda:999" parses as cuda:-25. Only a string that
        # reads back as itself names the device it says.
        if str(parsed) != v:
            raise _Reject
        v = parsed
    if isinstance(v, torch.device) and v.type in ("cpu", "cuda") and (v.index is None or v.index >= 0):
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


def available_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def default_threads() -> int:
    """What threads=None means: every core, less two on a host of 8 or more, which the
    Python and autograd threads need to keep the host AdamW fed."""
    cores = available_cores()
    return cores - 2 if cores >= 8 else cores


def _threads(v):
    if v is None:
        return None
    cores = available_cores()
    if _is_int(v) and 1 <= v <= cores:
        return int(v)
    raise _Reject(f"{cores} here")


def _scalar(v):
    """A real number, or the value of a one-element real tensor (torch takes both for lr,
    betas); None for anything else, a meta tensor (no value) or a complex one included."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_meta or v.is_complex() or v.dtype == torch.bool:
            return None
        return v.item()
    return v if _is_real(v) else None


def _lr(v):
    # torch keeps a tensor lr as given (a scheduler may update it in place): only checked here.
    value = _scalar(v)
    if value is not None and value >= 0:
        return v
    raise _Reject


def _non_negative(v):
    if _is_real(v) and v >= 0:
        return v
    raise _Reject


def _clip_norm(v):
    if v is None:
        return None
    if _is_real(v) and v > 0:
        return float(v)
    raise _Reject


def _betas(v):
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise _Reject
    values = tuple(_scalar(b) for b in v)
    if all(b is not None and 0.0 <= b < 1.0 for b in values):
        return tuple(float(b) for b in values)
    raise _Reject


# -- the table --------------------------------------------------------------------------------

_TORCH = "as torch.optim.AdamW"
_BOTH = (WRAP, OFFLOAD_ADAMW)

OPTIONS: dict[str, Option] = {
    "optimizer_mode": Option(
        "cpu",
        "'cpu', 'gpu', 'auto'",
        _one_of("cpu", "gpu", "auto"),
        "host AdamW; the CUDA AdamW with the moments kept in pinned host memory (copied through VRAM region "
        "by region where that stays under the peak, read in place otherwise); or picked from the hardware profile",
    ),
    "offload": Option(
        "auto",
        "'auto', True",
        _one_of("auto", True),
        '`"auto"` measures two steps and switches to fused GPU AdamW when everything fits',
    ),
    "activation_offload": Option(
        "auto",
        "'auto', True, False, a float in [0, 1]",
        _fraction_or("auto", True, False),
        "share of blocks whose saved activations are paged to RAM",
    ),
    "param_offload": Option(
        "auto",
        "'auto', True, False, a float in [0, 1], a list of distinct block indices >= 0",
        _param_offload,
        'which blocks\' weights live in RAM and stream in; `"auto"`: the planner',
    ),
    "quantize": Option(
        "auto",
        "'auto', 'none', None, False, 'int8', 'nf4'",
        _quantize,
        'frozen weights only; `"auto"` quantizes only when the run would not fit otherwise, int8 before NF4',
    ),
    "quant_block_size": Option(
        64, f"an even integer >= 2 and <= {MAX_QUANT_BLOCK_SIZE}", _quant_block_size, "values per fp32 scale"
    ),
    "prefer": Option(
        "exact",
        "'exact', 'speed'",
        _one_of("exact", "speed"),
        '`"speed"` lets `quantize="auto"` pick NF4 when that keeps every block in VRAM',
    ),
    "moment_dtype": Option(
        "auto",
        "'auto', 'float32', 'fp32', torch.float32, 'bfloat16', 'bf16', torch.bfloat16",
        _moment_dtype,
        "fp32 unless RAM can't hold it; bf16 uses stochastic rounding (its seed is part of the optimizer's state_dict)",
        used_by=_BOTH,
        differs={
            OFFLOAD_ADAMW: dict(
                default="float32",
                accepted="'float32', 'fp32', torch.float32, 'bfloat16', 'bf16', torch.bfloat16",
                normalize=_moment_dtype_exact,
                meaning="bf16 halves the moments' memory, with stochastic rounding (its seed is part of the "
                "state_dict)",
            )
        },
    ),
    "device": Option(
        None,
        "None, 'cuda', 'cuda:N', 'cpu', a torch.device",
        _device,
        'target when the model is on the CPU; `"cpu"` runs the engine with CPU compute',
    ),
    "blocks": Option(
        None, "None, a non-empty list of modules", _blocks, "the repeated layer stack; found automatically"
    ),
    "distributed": Option(
        None,
        "None, True, False",
        _one_of(None, True, False),
        "data parallel when a process group of more than one rank exists",
    ),
    "guard_params": Option(
        True, "True, False", _one_of(True, False), "a read of a weight waits for its own in-flight update"
    ),
    "max_grad_norm": Option(
        None,
        "None, a float > 0",
        _clip_norm,
        "global-norm clipping inside the optimizer",
        used_by=_BOTH,
    ),
    "accumulation_steps": Option(
        1,
        "an integer >= 1",
        _integer(lambda v: v >= 1),
        "backward passes per `step()`",
        used_by=_BOTH,
        differs={
            OFFLOAD_ADAMW: dict(
                meaning="`step()` calls per update, which reads the mean of their gradients (pass each "
                "micro-batch's un-divided loss)"
            )
        },
    ),
    "nonfinite": Option(
        "skip",
        "'skip', 'raise', 'ignore'",
        _one_of("skip", "raise", "ignore"),
        'a gradient that is not finite: `"skip"` updates nothing from it (the whole step when updates wait for '
        "the end of backward, as with `max_grad_norm` or accumulation; otherwise that block and every block after "
        'it in the pass) and says so in the events and `optimizer.skipped_steps`; `"raise"` raises '
        'FloatingPointError naming the parameter; `"ignore"` is torch\'s behaviour',
    ),
    "vram_headroom": Option(
        0.10,
        "a float in [0, 1]",
        _check(lambda v: _is_real(v) and 0.0 <= v <= 1.0),
        "share of usable VRAM the planner leaves free",
    ),
    "check_memory": Option(True, "True, False", _one_of(True, False), "MemoryError at `wrap()` when the run can't fit"),
    "max_inflight_bytes": Option(
        None,
        "None, an integer number of bytes > 0",
        _optional(lambda v: _is_int(v) and v > 0),
        "VRAM held by transfers in flight; `None`: 1 GiB or 10% of VRAM, the smaller",
    ),
    "max_activation_slowdown": Option(
        0.15,
        "a float >= 0",
        _check(lambda v: _is_real(v) and v >= 0),
        'how much slower `"auto"` activation paging may make a step',
    ),
    "prefetch_depth": Option(
        1, "an integer >= 1", _integer(lambda v: v >= 1), "blocks of activations fetched ahead in backward"
    ),
    "min_offload_bytes": Option(
        MiB,
        "an integer number of bytes >= 0",
        _integer(lambda v: v >= 0),
        "smaller saved tensors stay on the GPU",
    ),
    "threads": Option(
        None,
        "None, an integer from 1 to the number of cores this process may use",
        _threads,
        "host AdamW threads; `None`: all cores, less two on a host with 8 or more (the Python and autograd "
        "threads need them)",
        used_by=_BOTH,
    ),
    "profile": Option(
        True,
        "True, False, a HardwareProfile",
        _profile,
        "measure (or load cached) hardware figures; an instance is used as given",
    ),
    "lr": Option(
        1e-3,
        "a float >= 0, or a one-element tensor holding one",
        _lr,
        "only when `optimizer` is `None`",
        used_by=_BOTH,
        differs={OFFLOAD_ADAMW: dict(meaning=f"the learning rate, {_TORCH}")},
    ),
    "verbose": Option(False, "True, False", _one_of(True, False), "print decisions as they are made"),
    "mode": Option(
        "cpu",
        "'cpu', 'gpu'",
        _one_of("cpu", "gpu"),
        '`"cpu"`: the host AdamW, for parameters in host memory or on a GPU (an fp32 master in host memory, '
        'gradients and weights streamed); `"gpu"`: the CUDA AdamW for float32 GPU parameters, the moments in '
        "pinned host memory",
        used_by=(OFFLOAD_ADAMW,),
    ),
    "betas": Option(
        (0.9, 0.999),
        "a pair of floats in [0, 1), or of one-element tensors holding them",
        _betas,
        f"the moments' decay rates, {_TORCH}",
        used_by=(OFFLOAD_ADAMW,),
    ),
    "eps": Option(1e-8, "a float >= 0", _non_negative, f"added to the denominator, {_TORCH}", used_by=(OFFLOAD_ADAMW,)),
    "weight_decay": Option(
        1e-2, "a float >= 0", _non_negative, f"decoupled weight decay, {_TORCH}", used_by=(OFFLOAD_ADAMW,)
    ),
}


_BY_CALLER = {
    caller: {name: option.for_caller(caller) for name, option in OPTIONS.items() if caller in option.used_by}
    for caller in CALLERS
}
WRAP_OPTIONS = _BY_CALLER[WRAP]


def options_of(caller: str) -> dict[str, Option]:
    """The options `caller` takes, as it takes them, in table order."""
    return dict(_BY_CALLER[caller])


def check(name: str, value, *, caller: str = WRAP, where: str | None = None):
    """`value` of option `name` normalized as `caller` takes it; a bad value raises ValueError
    naming `where` (default ``"<caller>()"``), the option, the value and what is accepted.
    KeyError when `caller` does not take `name`: a caller's bug, not a user's."""
    option = _BY_CALLER[caller][name]
    try:
        return option.normalize(value)
    except _Reject as reject:
        detail = f" ({reject})" if str(reject) else ""
        raise ValueError(
            f"{where or caller + '()'}: option {name!r} got {value!r}; accepted: {option.accepted}{detail}"
        ) from None


@dataclass(frozen=True)
class Options:
    """The validated, normalized options of one wrap() call. `given` names the options the
    caller set explicitly (the planner treats those as constraints)."""

    values: dict = field(default_factory=dict)
    given: frozenset = frozenset()

    def __getattr__(self, name: str):
        # Only option names: a copy or an unpickling asks for special names (and for `values`
        # itself) before the fields exist.
        if name.startswith("__") or name in ("values", "given"):
            raise AttributeError(name)
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def parse(options: dict) -> Options:
    """Validate and normalize wrap()'s keyword options; ValueError names the first bad one."""
    unknown = [k for k in options if k not in WRAP_OPTIONS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, WRAP_OPTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"wrap(): unknown option {name!r}{hint}; accepted options: {', '.join(WRAP_OPTIONS)}")
    values = {name: check(name, options.get(name, spec.default)) for name, spec in WRAP_OPTIONS.items()}
    return Options(values, frozenset(options))


# optimizer_mode="gpu" without a GPU: the engine can lay the moments out as the device update
# does (regions, copies) with the host AdamW standing in for the kernel, which is how the
# test suite covers that layout on a machine without one (tests/conftest.py sets this).
# A user who asks for the GPU AdamW on the CPU backend gets an error instead.
CPU_STANDS_IN_FOR_GPU_OPTIMIZER = False


def check_for_device(opts: Options, device) -> None:
    """The options that need a CUDA device, against the torch.device wrap() runs on (its
    `device=` option, or where the model is); ValueError naming the option otherwise."""
    if opts.optimizer_mode == "gpu" and device.type != "cuda" and not CPU_STANDS_IN_FOR_GPU_OPTIMIZER:
        why = "device='cpu' was passed" if "device" in opts.given else "the model is on the CPU and no GPU is visible"
        raise ValueError(
            f"wrap(): option 'optimizer_mode' got 'gpu', which needs a CUDA device, but this run computes on "
            f"{device} ({why}); accepted on {device}: 'cpu', 'auto'"
        )


# -- docs/options.md --------------------------------------------------------------------------


def _shown(value) -> str:
    """A default as the user writes it."""
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def options_markdown() -> str:
    """docs/options.md: one table per caller, from the option table."""
    lines = [
        "# Options",
        "",
        "Generated from `src/trainstream/options.py` by `python -m trainstream.options > docs/options.md`;",
        "a test fails when this file differs from what the table generates.",
    ]
    for caller in CALLERS:
        lines += [
            "",
            f"## `trainstream.{caller}()`",
            "",
            "| option | accepted | default | meaning |",
            "|---|---|---|---|",
        ]
        for name, option in options_of(caller).items():
            cells = (f"`{name}`", option.accepted, _shown(option.default), option.meaning)
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
