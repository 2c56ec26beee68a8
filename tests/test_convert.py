"""Converting the optimizer wrap() is given into an OffloadAdamW, state included."""

import copy
import inspect

import pytest
import torch
from test_offload_adamw import OddModel, batches, groups_of, max_diff, train

from trainstream import OffloadAdamW, options
from trainstream.optim import convert_optimizer

TOL = 1e-6


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, foreach=False),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, fused=True),
    ],
)
def test_conversion_continues_exactly_where_torch_left_off(make):
    model = OddModel()
    data = batches(16)
    groups = groups_of(model)
    original = make(groups)
    train(model, original, data[:8])
    twin = copy.deepcopy(model)
    reference_opt = make(groups_of(twin))
    reference_opt.load_state_dict(copy.deepcopy(original.state_dict()))
    converted = convert_optimizer(original, None)
    assert isinstance(converted, OffloadAdamW)
    assert [g["lr"] for g in converted.param_groups] == [g["lr"] for g in original.param_groups]
    assert [g["weight_decay"] for g in converted.param_groups] == [g["weight_decay"] for g in original.param_groups]
    assert converted.state[model.a.weight]["step"].item() == 8
    train(model, converted, data[8:])
    train(twin, reference_opt, data[8:])
    assert max_diff(model, twin) <= TOL


def test_none_builds_one_with_lr():
    model = OddModel()
    opt = convert_optimizer(None, model.parameters(), lr=3e-4, moment_dtype="bfloat16", max_grad_norm=1.0)
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.moment_dtype == torch.bfloat16 and opt.max_grad_norm == 1.0


def test_an_offload_adamw_keeps_its_state_and_takes_new_options():
    model = OddModel()
    data = batches(6)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, decoupled_weight_decay=False, weight_decay=0.05)
    train(model, opt, data[:3])
    converted = convert_optimizer(opt, None, accumulation_steps=2)
    assert converted.accumulation_steps == 2
    assert converted.param_groups[0]["decoupled_weight_decay"] is False
    assert torch.equal(converted.state[model.a.weight]["exp_avg"], opt.state[model.a.weight]["exp_avg"])


def test_unsupported_optimizers_and_options_are_refused():
    model = OddModel()
    with pytest.raises(
        ValueError,
        match=r"optimizer must be one of torch.optim.AdamW, torch.optim.Adam, "
        r"trainstream.OffloadAdamW, None; got torch.optim.sgd.SGD",
    ):
        convert_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), None)
    with pytest.raises(ValueError, match=r"does not support amsgrad=True"):
        convert_optimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), None)


def test_conversion_defaults_are_offload_adamws_in_the_option_table():
    table = options.options_of(options.OFFLOAD_ADAMW)
    signature = inspect.signature(convert_optimizer).parameters
    taken = [name for name in signature if name in table]
    assert taken == ["lr", "mode", "moment_dtype", "threads", "max_grad_norm", "accumulation_steps"]
    assert {name: signature[name].default for name in taken} == {name: table[name].default for name in taken}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="auto"), r"option 'mode' got 'auto'; accepted: 'cpu', 'gpu'$"),
        (dict(moment_dtype="auto"), r"option 'moment_dtype' got 'auto'; accepted: 'float32', 'fp32', torch.float32"),
        (dict(threads=0), r"option 'threads' got 0; accepted: None, an integer from 1 to the number of cores"),
        (dict(max_grad_norm=-1.0), r"option 'max_grad_norm' got -1.0; accepted: None, a float > 0$"),
        (dict(accumulation_steps=0), r"option 'accumulation_steps' got 0; accepted: an integer >= 1$"),
        (dict(lr=-1.0), r"option 'lr' got -1.0; accepted: a float >= 0"),
    ],
)
def test_conversion_checks_its_options_under_its_own_name(kwargs, match):
    torch_opt = torch.optim.AdamW(OddModel().parameters())
    with pytest.raises(ValueError, match=r"^convert_optimizer\(\): " + match):
        convert_optimizer(torch_opt, None, **kwargs)
    with pytest.raises(ValueError, match=r"^convert_optimizer\(\): " + match):
        convert_optimizer(None, OddModel().parameters(), **kwargs)


def test_conversion_takes_every_moment_spelling_of_offload_adamw():
    for spelling in ("fp32", torch.float32, "bf16", torch.bfloat16):
        opt = convert_optimizer(None, OddModel().parameters(), moment_dtype=spelling)
        assert opt.moment_dtype == options.check("moment_dtype", spelling, caller=options.OFFLOAD_ADAMW)
