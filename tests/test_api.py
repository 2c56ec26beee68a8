"""wrap()'s arguments: bad options, an optimizer it cannot take, options not delivered yet."""

import pytest
import torch
from models import tiny_mlp

import trainstream


@pytest.mark.parametrize(
    "option, value",
    [
        ("quantize", "fp4"),
        ("param_offload", [0, 99]),
        ("prefetch_depth", 0),
        ("device", "tpu"),
        ("optimiser_mode", "cpu"),
    ],
)
def test_bad_options_name_themselves(option, value):
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match=option):
        trainstream.wrap(model, None, device="cpu", **{option: value}) if option != "device" else trainstream.wrap(
            model, None, device=value
        )


def test_lr_with_an_optimizer_is_an_error():
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="'lr' applies only when optimizer is None"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", lr=0.1)


def test_distributed_true_without_a_process_group_says_so():
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="distributed=True but no torch.distributed process group is initialized"):
        trainstream.wrap(model, None, device="cpu", distributed=True)


def test_wrong_optimizer_and_double_wrap():
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="optimizer must be one of"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
    model, _ = trainstream.wrap(model, None, device="cpu")
    with pytest.raises(ValueError, match="already wrapped"):
        trainstream.wrap(model, None, device="cpu")


def test_gpu_mode_refuses_non_contiguous_parameters():
    model, _, _ = tiny_mlp()
    first = model[0]
    first.weight = torch.nn.Parameter(first.weight.detach().t().contiguous().t())
    with pytest.raises(ValueError, match="optimizer_mode='gpu' needs contiguous parameters"):
        trainstream.wrap(model, None, device="cpu", optimizer_mode="gpu")


def test_an_offload_adamw_brings_its_clipping():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, trainstream.OffloadAdamW(model.parameters(), max_grad_norm=1e-3), device="cpu")
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()
    assert model._trainstream_engine.last_grad_norm is not None
    model, _, _ = tiny_mlp()
    with pytest.raises(ValueError, match="max_grad_norm"):
        trainstream.wrap(
            model, trainstream.OffloadAdamW(model.parameters(), max_grad_norm=1.0), device="cpu", max_grad_norm=2.0
        )
    with pytest.raises(ValueError, match="accumulation_steps"):
        trainstream.wrap(model, trainstream.OffloadAdamW(model.parameters(), accumulation_steps=2), device="cpu")
