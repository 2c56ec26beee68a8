"""Property-based fuzzing (hypothesis) of every public entry point's arguments: wrap()'s
options, OffloadAdamW's constructor and load_state_dict, the ops in trainstream.ops,
QuantizedWeight, profile_hardware, memory_report and unwrap.

Every failure must be a ValueError or TypeError that names the argument; nothing may crash,
hang or be silently accepted. Which values are accepted is decided here from
../shared/SPEC.md, written apart from the option table (options.py), so the two must agree:
a value outside the specification's accepted set that passes is a failure too. The runs are
derandomized (the same examples every time, as the seeded suite) and small enough for CI.
"""

from __future__ import annotations

import atexit
import math
import numbers
import re
import shutil
import tempfile

import numpy as np
import pytest
import torch
from helpers import assert_same_bits
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from models import mlp

import trainstream
from trainstream import OffloadAdamW, QuantizedWeight, ops, options
from trainstream.planner import HardwareProfile
from trainstream.planner import profile as profile_mod

# Hypothesis keeps what it learns under .hypothesis/ in the working directory: not in the
# checkout, where other work goes on.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="trainstream-hypothesis-")
set_hypothesis_home_dir(_HYPOTHESIS_HOME)
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)
FEW = settings(FUZZ, max_examples=12)  # each example wraps and trains a model


# -- values of every kind ---------------------------------------------------------------------

SPELLINGS = [
    "auto", "cpu", "gpu", "none", "int8", "nf4", "exact", "speed", "float32", "fp32", "bfloat16", "bf16",
    "cuda", "cuda:0", "cuda:1", "cpu:0", "skip", "raise", "ignore",
    # near misses
    "AUTO", "Auto", " cpu", "gpu ", "float16", "fp16", "cuda:999", "cuda:-1", "cuda:01", "nf8", "", "True", "1",
    "0.5", "meta", "mps", "None",
]  # fmt: skip
_MODULE = torch.nn.Linear(2, 2)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 4, 6, 63, 64, 4096, 4098, 2**31, 2**40, -1, -64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.5, 1e-3, 0.15, 2.0, float("nan"), float("inf")]),
    st.text(max_size=6),
    st.sampled_from(SPELLINGS),
    st.sampled_from([np.float32(0.5), np.float64(0.1), np.int64(2), np.int32(64), np.True_, np.float64("nan")]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 1), torch.device("meta")]),
    st.floats(-1.0, 2.0).map(torch.tensor),
    st.sampled_from([torch.zeros(2), torch.tensor([1e-3]), torch.tensor(1 + 0j), torch.tensor(True), torch.tensor(3)]),
    st.complex_numbers(max_magnitude=2),
    st.just(_MODULE),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.tuples(SCALARS, SCALARS),
    st.lists(st.integers(-2, 5), max_size=4),
    st.dictionaries(st.text(max_size=3), SCALARS, max_size=2),
    st.just(torch.nn.ModuleList([torch.nn.Linear(2, 2)])),
    st.just([]),
)


# -- the specification's accepted values, written from SPEC.md ---------------------------------


def _bool(v) -> bool:
    return v is True or v is False


def _int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _fraction(v) -> bool:
    return _real(v) and 0.0 <= v <= 1.0


def _str_in(v, *choices) -> bool:
    return isinstance(v, str) and v in choices


def _tensor_value(v):
    """The value of a one-element real tensor (torch takes one for lr and betas), else None."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_meta and not v.is_complex():
        if v.dtype != torch.bool:
            return v.item()
    return None


def _device(v) -> bool:
    if v is None:
        return True
    if isinstance(v, str):  # torch holds a device index in 8 bits
        m = re.fullmatch(r"(cpu|cuda)(?::(0|[1-9][0-9]*))?", v)
        return m is not None and (m.group(2) is None or int(m.group(2)) <= 127)
    return isinstance(v, torch.device) and v.type in ("cpu", "cuda") and (v.index is None or v.index >= 0)


def _lr(v) -> bool:
    value = _tensor_value(v) if isinstance(v, torch.Tensor) else v
    return _real(value) and value >= 0


WRAP_ACCEPTS = {
    "optimizer_mode": lambda v: _str_in(v, "cpu", "gpu", "auto"),
    "offload": lambda v: _str_in(v, "auto") or v is True,
    "activation_offload": lambda v: _str_in(v, "auto") or _bool(v) or _fraction(v),
    "param_offload": lambda v: (
        _str_in(v, "auto")
        or _bool(v)
        or _fraction(v)
        or (isinstance(v, (list, tuple)) and all(_int(i) and i >= 0 for i in v) and len(set(v)) == len(v))
    ),
    "quantize": lambda v: v is None or v is False or _str_in(v, "auto", "none", "int8", "nf4"),
    "quant_block_size": lambda v: _int(v) and 2 <= v <= options.MAX_QUANT_BLOCK_SIZE and v % 2 == 0,
    "prefer": lambda v: _str_in(v, "exact", "speed"),
    "moment_dtype": lambda v: (
        _str_in(v, "auto", "float32", "fp32", "bfloat16", "bf16") or v is torch.float32 or v is torch.bfloat16
    ),
    "device": _device,
    "blocks": lambda v: (
        v is None
        or (
            isinstance(v, (list, tuple, torch.nn.ModuleList))
            and len(v) > 0
            and all(isinstance(m, torch.nn.Module) for m in v)
        )
    ),
    "distributed": lambda v: v is None or _bool(v),
    "guard_params": _bool,
    "max_grad_norm": lambda v: v is None or (_real(v) and v > 0),
    "accumulation_steps": lambda v: _int(v) and v >= 1,
    "vram_headroom": _fraction,
    "check_memory": _bool,
    "max_inflight_bytes": lambda v: v is None or (_int(v) and v > 0),
    "max_activation_slowdown": lambda v: _real(v) and v >= 0,
    "prefetch_depth": lambda v: _int(v) and v >= 1,
    "min_offload_bytes": lambda v: _int(v) and v >= 0,
    "threads": lambda v: v is None or (_int(v) and 1 <= v <= options.available_cores()),
    "profile": lambda v: _bool(v) or isinstance(v, HardwareProfile),
    "lr": _lr,
    "verbose": _bool,
    "nonfinite": lambda v: _str_in(v, "skip", "raise", "ignore"),
}

WRAP_NAMES = sorted(options.WRAP_OPTIONS)


def test_the_fuzz_knows_every_wrap_option():
    assert set(options.WRAP_OPTIONS) <= set(WRAP_ACCEPTS)


def _model_state(model) -> list:
    """What a refused wrap() must leave as it was: every parameter's object, data, device,
    dtype, and the hooks."""
    return [
        (name, p, p.data_ptr(), p.device, p.dtype, p.requires_grad, p.detach().clone())
        for name, p in model.named_parameters()
    ] + [
        (name, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks), m.forward)
        for name, m in model.named_modules()
    ]


def _assert_unchanged(model, before) -> None:
    after = _model_state(model)
    assert len(after) == len(before)
    for a, b in zip(after, before):
        for x, y in zip(a, b):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert getattr(model, "_trainstream_engine", None) is None


# -- wrap() -----------------------------------------------------------------------------------


@FUZZ
@given(name=st.sampled_from(WRAP_NAMES), value=VALUES)
def test_each_wrap_option_accepts_exactly_what_the_specification_says(name, value):
    expect = WRAP_ACCEPTS[name](value)
    try:
        options.check(name, value)
    except ValueError as e:
        assert not expect, f"{name}={value!r} is in the specification's accepted set, refused: {e}"
        assert str(e).startswith(f"wrap(): option {name!r} got "), e
        return
    assert expect, f"{name}={value!r} is outside the specification's accepted set, and was accepted"


@FUZZ
@given(name=st.sampled_from(WRAP_NAMES), value=VALUES)
def test_wrap_refuses_a_value_outside_the_specification_and_leaves_the_model_as_it_was(name, value):
    assume(not WRAP_ACCEPTS[name](value))
    model = mlp(2, 8)
    before = _model_state(model)
    with pytest.raises(ValueError, match=rf"^wrap\(\): option '{name}' got "):
        trainstream.wrap(model, **{name: value})
    _assert_unchanged(model, before)


@FUZZ
@given(name=st.text(min_size=1, max_size=12))
def test_wrap_refuses_an_unknown_option_by_name(name):
    assume(name not in options.WRAP_OPTIONS)
    model = mlp(2, 8)
    with pytest.raises(ValueError, match=r"^wrap\(\): unknown option "):
        trainstream.wrap(model, **{name: 1})
    assert getattr(model, "_trainstream_engine", None) is None


@FUZZ
@given(value=VALUES)
def test_wrap_refuses_what_is_not_a_model_or_an_optimizer(value):
    assume(not isinstance(value, torch.nn.Module))
    with pytest.raises((ValueError, TypeError), match=r"model must be a torch.nn.Module"):
        trainstream.wrap(value)
    assume(value is not None)
    model = mlp(2, 8)
    before = _model_state(model)
    with pytest.raises((ValueError, TypeError), match=r"optimizer must be one of"):
        trainstream.wrap(model, value, device="cpu", profile=False)
    _assert_unchanged(model, before)


# Options a CPU run can take, each with values inside the specification, to train with.
CPU_RUN = {
    "offload": st.sampled_from(["auto", True]),
    "optimizer_mode": st.sampled_from(["cpu", "auto"]),
    "activation_offload": st.one_of(st.sampled_from(["auto", True, False]), st.floats(0.0, 1.0)),
    "param_offload": st.one_of(
        st.sampled_from(["auto", True, False]), st.floats(0.0, 1.0), st.lists(st.integers(0, 2), unique=True)
    ),
    "quantize": st.sampled_from(["auto", "none", None, False]),
    "moment_dtype": st.sampled_from(["auto", "float32", "fp32", torch.float32, "bfloat16", "bf16", torch.bfloat16]),
    "guard_params": st.booleans(),
    "max_grad_norm": st.one_of(st.none(), st.floats(1e-3, 10.0)),
    "accumulation_steps": st.integers(1, 3),
    "vram_headroom": st.floats(0.0, 0.5),
    "max_inflight_bytes": st.one_of(st.none(), st.integers(1 << 16, 1 << 30)),
    "max_activation_slowdown": st.floats(0.0, 1.0),
    "prefetch_depth": st.integers(1, 3),
    "min_offload_bytes": st.integers(0, 1 << 20),
    "threads": st.one_of(st.none(), st.integers(1, options.available_cores())),
    # 0, or large enough to move a float32 weight in one step
    "lr": st.one_of(st.just(0.0), st.floats(1e-3, 0.1), st.floats(1e-3, 0.1).map(torch.tensor)),
}


@FEW
@given(chosen=st.fixed_dictionaries({}, optional=CPU_RUN))
def test_wrap_with_accepted_options_trains(chosen):
    torch.manual_seed(0)
    model = mlp(3, 16)
    start = [p.detach().clone() for p in model.parameters()]
    model, opt = trainstream.wrap(model, device="cpu", profile=False, **chosen)
    for _ in range(chosen.get("accumulation_steps", 1)):
        model(torch.randn(4, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    model = trainstream.unwrap(model)
    now = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in now)
    lr = chosen.get("lr", 1e-3)
    if float(lr) > 0:
        assert any(not torch.equal(a, b.detach()) for a, b in zip(start, now))


@FUZZ
@given(value=VALUES)
def test_memory_report_and_unwrap_of_an_unwrapped_model_name_it(value):
    for target in (value, mlp(2, 4)):
        with pytest.raises(ValueError, match=r"this model is not wrapped"):
            trainstream.memory_report(target)
        with pytest.raises(ValueError, match=r"this model is not wrapped"):
            trainstream.unwrap(target)


# -- OffloadAdamW -----------------------------------------------------------------------------


def _betas(v) -> bool:
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        return False
    values = [_tensor_value(b) if isinstance(b, torch.Tensor) else b for b in v]
    return all(_real(b) and 0.0 <= b < 1.0 for b in values)


OFFLOAD_ACCEPTS = {
    "lr": _lr,
    "betas": _betas,
    "eps": lambda v: _real(v) and v >= 0,
    "weight_decay": lambda v: _real(v) and v >= 0,
    "mode": lambda v: _str_in(v, "cpu"),  # "gpu" needs a GPU: checked apart
    "max_grad_norm": WRAP_ACCEPTS["max_grad_norm"],
    "accumulation_steps": WRAP_ACCEPTS["accumulation_steps"],
    "moment_dtype": lambda v: (
        _str_in(v, "float32", "fp32", "bfloat16", "bf16") or v is torch.float32 or v is torch.bfloat16
    ),
    "threads": WRAP_ACCEPTS["threads"],
    "seed": lambda v: v is None or _int(v),
    "decoupled_weight_decay": _bool,
    "amsgrad": lambda v: v is False,
    "maximize": lambda v: v is False,
    "capturable": lambda v: v is False,
    "differentiable": lambda v: v is False,
    "foreach": lambda v: v is None or _bool(v),
    "fused": lambda v: v is None or _bool(v),
}


@FUZZ
@given(name=st.sampled_from(sorted(OFFLOAD_ACCEPTS)), value=VALUES)
def test_offload_adamw_accepts_exactly_what_torch_and_the_specification_say(name, value):
    assume(not (name == "mode" and _str_in(value, "gpu")))
    expect = OFFLOAD_ACCEPTS[name](value)
    params = list(torch.nn.Linear(3, 3).parameters())
    try:
        opt = OffloadAdamW(params, **{name: value})
    except ValueError as e:
        assert not expect, f"OffloadAdamW({name}={value!r}) is accepted by the specification, refused: {e}"
        assert name in str(e), e
        return
    assert expect, f"OffloadAdamW({name}={value!r}) is outside what is accepted, and was accepted"
    params[0].grad = torch.ones_like(params[0])
    opt.step()  # an accepted value runs
    assert torch.isfinite(params[0]).all() or not math.isfinite(float(opt.param_groups[0]["lr"]))


def test_offload_adamw_mode_gpu_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match=r"OffloadAdamW\(mode='gpu'\) needs a CUDA GPU"):
        OffloadAdamW(torch.nn.Linear(2, 2).parameters(), mode="gpu")


@FUZZ
@given(params=VALUES)
def test_offload_adamw_refuses_params_that_are_not_parameters(params):
    assume(not (isinstance(params, (list, tuple)) and params and all(isinstance(p, torch.Tensor) for p in params)))
    with pytest.raises((ValueError, TypeError), match=r"(?i)param"):
        OffloadAdamW(params)


@FUZZ
@given(key=st.sampled_from(["lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"]), value=VALUES)
def test_offload_adamw_checks_each_param_group(key, value):
    accepts = OFFLOAD_ACCEPTS[key](value)
    group = {"params": list(torch.nn.Linear(2, 2).parameters()), key: value}
    try:
        OffloadAdamW([group])
    except ValueError as e:
        assert not accepts, e
        assert key in str(e), e
        return
    assert accepts, f"a param group with {key}={value!r} was accepted"


def _stepped():
    model = torch.nn.Linear(3, 2)
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


@FUZZ
@given(
    which=st.integers(0, 1),
    key=st.sampled_from(["exp_avg", "exp_avg_sq"]),
    replacement=st.one_of(
        st.lists(st.integers(0, 4), min_size=0, max_size=3).map(lambda s: torch.zeros(s)),
        VALUES,
    ),
)
def test_load_state_dict_checks_each_moment_against_its_parameter(which, key, replacement):
    model, opt = _stepped()
    sd = opt.state_dict()
    param = list(model.parameters())[which]
    shape_ok = isinstance(replacement, torch.Tensor) and replacement.shape == param.shape
    before = {k: v.clone() for k, v in opt.state[param].items()}
    sd["state"][which] = {**sd["state"][which], key: replacement}  # torch's dict is the live state's
    if shape_ok:
        opt.load_state_dict(sd)
        return
    with pytest.raises((ValueError, TypeError), match=rf"state\[{which}\]\['{key}'\]"):
        opt.load_state_dict(sd)
    for k, v in opt.state[param].items():  # refused before anything was replaced
        assert torch.equal(v, before[k])


@FUZZ
@given(state_dict=VALUES)
def test_load_state_dict_refuses_what_is_not_a_state_dict(state_dict):
    _, opt = _stepped()
    with pytest.raises((ValueError, TypeError), match=r"state_dict"):
        opt.load_state_dict(state_dict)


# -- the ops ----------------------------------------------------------------------------------

TENSOR_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8, torch.bool]


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(0, 40), max_size=3))
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    t = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
    if draw(st.booleans()) and t.dim() == 2:
        t = t.t()  # not contiguous
    if draw(st.integers(0, 9)) == 0:
        t = torch.empty(shape, dtype=dtype, device="meta")
    return t


TENSOR_OR_NOT = st.one_of(tensors(), VALUES)
QUANT = {
    "nf4": (ops.quantize_nf4, ops.dequantize_nf4, ops.reference.dequantize_nf4),
    "int8": (ops.quantize_int8, ops.dequantize_int8, ops.reference.dequantize_int8),
}
VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _block_size_ok(v) -> bool:
    return _int(v) and 2 <= v <= options.MAX_QUANT_BLOCK_SIZE and v % 2 == 0


@FUZZ
@given(fmt=st.sampled_from(sorted(QUANT)), x=TENSOR_OR_NOT, block_size=st.one_of(st.sampled_from([2, 64, 6]), VALUES))
def test_quantize_accepts_value_tensors_and_names_anything_else(fmt, x, block_size):
    quantize = QUANT[fmt][0]
    expect = (
        isinstance(x, torch.Tensor)
        and x.dtype in VALUE_DTYPES
        and x.device.type == "cpu"
        and _block_size_ok(block_size)
    )
    try:
        codes, absmax = quantize(x, block_size)
    except (ValueError, TypeError) as e:
        assert not expect, e
        assert re.search(r"\b(x|block_size)\b", str(e)), e
        return
    assert expect, f"quantize_{fmt}({x!r}, {block_size!r}) was accepted"
    n = x.numel()
    assert codes.numel() == (-(-n // 2) if fmt == "nf4" else n)
    assert absmax.numel() == -(-n // block_size)


@FUZZ
@given(
    fmt=st.sampled_from(sorted(QUANT)),
    n=st.integers(0, 300),
    shape=st.one_of(st.none(), st.lists(st.integers(-3, 300), max_size=3), VALUES),
    dtype=st.one_of(st.sampled_from(VALUE_DTYPES), VALUES),
    block_size=st.one_of(st.sampled_from([64, 2, 6]), VALUES),
    out=st.one_of(st.none(), tensors(), VALUES),
    codes_or_not=st.one_of(st.none(), TENSOR_OR_NOT),
)
def test_dequantize_is_right_or_names_the_argument(fmt, n, shape, dtype, block_size, out, codes_or_not):
    quantize, dequantize, reference = QUANT[fmt]
    codes, absmax = quantize(torch.randn(n), 64)
    if codes_or_not is not None:
        codes = codes_or_not
    if shape is None and n % 3:
        shape = (n,)
    try:
        got = dequantize(codes, absmax, shape, dtype, block_size, out=out)
    except (ValueError, TypeError) as e:
        assert re.search(r"\b(packed|codes|absmax|shape|dtype|block_size|out)\b", str(e)), e
        return
    assert got.shape == torch.Size(shape) and got.dtype == dtype
    assert_same_bits(got, reference(codes, absmax, shape, dtype, block_size))


ADAMW_ARGS = ["params", "grads", "exp_avgs", "exp_avg_sqs", "steps", "lr", "beta1", "eps", "grad_scale", "seeds",
              "param_copies", "threads", "priority", "decoupled"]  # fmt: skip


@FUZZ
@given(arg=st.sampled_from(ADAMW_ARGS), value=st.one_of(VALUES, st.lists(tensors(), max_size=2)))
def test_adamw_step_runs_or_names_the_argument(arg, value):
    args = dict(
        params=[torch.zeros(4)],
        grads=[torch.ones(4)],
        exp_avgs=[torch.zeros(4)],
        exp_avg_sqs=[torch.zeros(4)],
        steps=[1],
        lr=1e-3,
    )
    args[arg] = value
    try:
        positional = [args.pop(k) for k in ("params", "grads", "exp_avgs", "exp_avg_sqs", "steps")]
        ops.adamw_step(*positional, **args).wait()
    except (ValueError, TypeError) as e:
        assert arg in str(e) or (arg in ("params", "grads", "exp_avgs", "exp_avg_sqs", "param_copies", "steps",
                                         "seeds") and "params" in str(e)), e  # fmt: skip
        return


@FUZZ
@given(dsts=st.one_of(st.lists(tensors(), max_size=2), VALUES), srcs=st.one_of(st.lists(tensors(), max_size=2), VALUES))
def test_accumulate_runs_or_names_the_argument(dsts, srcs):
    try:
        ops.accumulate_(dsts, srcs).wait()
    except (ValueError, TypeError) as e:
        assert re.search(r"\b(dsts|srcs|destinations|sources)\b", str(e)), e
        return
    for d, s in zip(dsts, srcs):
        assert d.dtype == torch.float32 and d.numel() == s.numel()


@FUZZ
@given(values=st.one_of(st.lists(tensors(), max_size=3), VALUES))
def test_grad_sq_norms_is_the_reference_or_names_the_argument(values):
    try:
        got = ops.grad_sq_norms(values)
    except (ValueError, TypeError) as e:
        assert "tensors" in str(e), e
        return
    assert torch.equal(got, ops.reference.grad_sq_norms(values)) if values else got.numel() == 0


@FUZZ
@given(threads=VALUES)
def test_get_pool_bounds_threads_as_the_option(threads):
    expect = WRAP_ACCEPTS["threads"](threads)
    try:
        ops.get_pool(threads)
    except ValueError as e:
        assert not expect and "threads" in str(e), e
        return
    assert expect, f"get_pool({threads!r}) was accepted"


# -- QuantizedWeight --------------------------------------------------------------------------


@FUZZ
@given(
    fmt=st.one_of(st.sampled_from(["nf4", "int8"]), VALUES),
    block_size=st.one_of(st.sampled_from([64, 32]), VALUES),
    shape=st.one_of(st.sampled_from([(6, 10), [60], (60,), (3, 4, 5)]), VALUES),
    dtype=st.one_of(st.sampled_from(VALUE_DTYPES), VALUES),
)
def test_quantized_weight_takes_consistent_parts_or_names_the_argument(fmt, block_size, shape, dtype):
    q = QuantizedWeight.quantize(torch.randn(6, 10), "nf4" if fmt != "int8" else "int8", 64)
    try:
        w = QuantizedWeight(q.codes, q.absmax, shape, dtype, fmt, block_size)
    except (ValueError, TypeError) as e:
        assert re.search(r"\b(format|block_size|shape|dtype|codes|absmax)\b", str(e)), e
        return
    assert fmt == q.format and block_size == 64 and math.prod(w.shape) == 60 and dtype in VALUE_DTYPES
    out = torch.empty(w.shape, dtype=w.dtype)
    w.dequantize_into(out)
    assert torch.equal(out, q.dequantize(dtype=w.dtype).reshape(w.shape))


@FUZZ
@given(out=st.one_of(tensors(), VALUES))
def test_dequantize_into_writes_only_a_matching_out(out):
    q = QuantizedWeight.quantize(torch.randn(6, 10), "nf4")
    ok = (
        isinstance(out, torch.Tensor)
        and out.shape == q.shape
        and out.dtype in VALUE_DTYPES
        and out.device.type == "cpu"
        and out.is_contiguous()
    )
    try:
        q.dequantize_into(out)
    except (ValueError, TypeError) as e:
        assert not ok and "out" in str(e), e
        return
    assert ok, f"dequantize_into accepted {out!r}"
    assert torch.equal(out, q.dequantize(dtype=out.dtype))


# -- profile_hardware -------------------------------------------------------------------------


@pytest.fixture
def no_measuring(monkeypatch):
    """Accepted calls read the memory figures but do not measure the links (fixed rates)."""
    monkeypatch.setattr(profile_mod, "_measure_rates", lambda device, quick: dict(profile_mod.CONSERVATIVE_RATES))


@FUZZ
@given(device=VALUES, quick=st.one_of(st.booleans(), VALUES), force=st.one_of(st.booleans(), VALUES))
def test_profile_hardware_takes_its_arguments_or_names_them(no_measuring, device, quick, force):
    cuda = isinstance(device, (str, torch.device)) and _device(device) and torch.device(device).type == "cuda"
    expect = _device(device) and _bool(quick) and _bool(force) and not (cuda and not torch.cuda.is_available())
    try:
        p = trainstream.profile_hardware(device, quick=quick, force=force)
    except ValueError as e:
        assert not expect and re.search(r"'(device|quick|force)'", str(e)), e
        return
    except RuntimeError as e:  # a CUDA device on a machine without one
        assert cuda and not torch.cuda.is_available() and "needs a CUDA GPU" in str(e), e
        return
    assert expect, f"profile_hardware({device!r}, quick={quick!r}, force={force!r}) was accepted"
    assert isinstance(p, HardwareProfile) and p.ram_available_bytes > 0


# -- cases found while fuzzing, each a test of its own ------------------------------------------


@pytest.mark.parametrize("seed", ["x", 1.5, True, None, [1]])
def test_offload_adamw_seed_is_an_integer(seed):
    if seed is None:
        assert OffloadAdamW(torch.nn.Linear(2, 2).parameters(), seed=seed).seed == torch.initial_seed()
        return
    with pytest.raises(ValueError, match=rf"^OffloadAdamW\(\): option 'seed' got {re.escape(repr(seed))}; accepted"):
        OffloadAdamW(torch.nn.Linear(2, 2).parameters(), seed=seed)


def test_offload_adamw_seed_takes_any_integer():
    assert OffloadAdamW(torch.nn.Linear(2, 2).parameters(), seed=-1).seed == 2**64 - 1
    assert OffloadAdamW(torch.nn.Linear(2, 2).parameters(), seed=np.int64(7)).seed == 7


def test_load_state_dict_refuses_a_moment_of_another_shape_before_step():
    model, opt = _stepped()
    sd = opt.state_dict()
    sd["state"][0] = {**sd["state"][0], "exp_avg": torch.zeros(3, 2)}  # the weight is (2, 3)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has shape \(3, 2\), its parameter \(2, 3\)"):
        opt.load_state_dict(sd)


def test_wrap_without_trainable_parameters_says_so():
    model = mlp(2, 8).requires_grad_(False)
    with pytest.raises(ValueError, match=r"^wrap\(\): optimizer is None and no parameter requires grad"):
        trainstream.wrap(model, device="cpu", profile=False)


def test_optimizer_mode_gpu_needs_a_cuda_device(monkeypatch):
    # The suite lets the host AdamW stand in for the kernel on the CPU backend (conftest.py);
    # a user gets the error.
    monkeypatch.setattr(options, "CPU_STANDS_IN_FOR_GPU_OPTIMIZER", False)
    model = mlp(2, 8)
    before = _model_state(model)
    with pytest.raises(ValueError, match=r"^wrap\(\): option 'optimizer_mode' got 'gpu', which needs a CUDA device"):
        trainstream.wrap(model, device="cpu", optimizer_mode="gpu", profile=False)
    _assert_unchanged(model, before)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"no GPU is visible"):
            trainstream.wrap(model, optimizer_mode="gpu", profile=False)


@pytest.mark.parametrize("device", ["cuda:999", "cuda:128", torch.device("cuda", 200)])
def test_a_device_index_torch_cannot_hold_is_refused(device):
    # torch keeps a device index in 8 bits: "cuda:999" parses as cuda:-25.
    with pytest.raises(ValueError, match=r"^wrap\(\): option 'device' got "):
        options.check("device", device)


@pytest.mark.parametrize("lr", [torch.tensor(1e-3, device="meta"), torch.tensor(1 + 0j), torch.tensor(True)])
def test_an_lr_tensor_without_a_real_value_is_refused(lr):
    with pytest.raises(ValueError, match=r"^wrap\(\): option 'lr' got "):
        options.check("lr", lr)
