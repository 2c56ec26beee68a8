"""Turning the optimizer a user hands to wrap() into an OffloadAdamW, keeping its
hyper-parameters, param groups and any state it has built up."""

from __future__ import annotations

import torch

from .. import options
from .offload_adamw import OffloadAdamW

WHERE = "convert_optimizer()"

ACCEPTED = "torch.optim.AdamW, torch.optim.Adam, trainstream.OffloadAdamW, None"


def convert_optimizer(
    optimizer,
    params,
    *,
    lr: float = 1e-3,
    mode: str = "cpu",
    moment_dtype="float32",
    threads=None,
    max_grad_norm=None,
    accumulation_steps: int = 1,
    optimizer_class=OffloadAdamW,
    where: str = WHERE,
) -> OffloadAdamW:
    """An OffloadAdamW that continues exactly where `optimizer` left off.

    `optimizer` None builds one over `params` with `lr` (and torch AdamW's other defaults).
    torch.optim.Adam converts with its L2 weight decay (or decoupled decay when it was built
    with decoupled_weight_decay=True). The old optimizer should not be stepped afterwards;
    create LR schedulers on the returned one. `optimizer_class` (OffloadAdamW or a subclass)
    is what gets built. The options are checked as OffloadAdamW takes them
    (:mod:`trainstream.options`), under this function's name; `where` names the caller in
    the error for an empty `params` with `optimizer` None.
    """
    common = _checked(
        lr=lr,
        mode=mode,
        moment_dtype=moment_dtype,
        threads=threads,
        max_grad_norm=max_grad_norm,
        accumulation_steps=accumulation_steps,
    )
    lr = common.pop("lr")
    if optimizer is None:
        params = list(params)
        if not params:  # torch's own error ("empty parameter list") would not say why
            raise ValueError(
                f"{where}: optimizer is None and no parameter requires grad, so there is nothing to train; "
                "accepted: a model with at least one parameter that requires grad (requires_grad_(True))"
            )
        return optimizer_class(params, lr=lr, **common)
    if isinstance(optimizer, torch.optim.AdamW):
        decoupled = True
    elif isinstance(optimizer, torch.optim.Adam):
        decoupled = bool(optimizer.defaults.get("decoupled_weight_decay", False))
    elif isinstance(optimizer, OffloadAdamW):
        decoupled = bool(optimizer.defaults["decoupled_weight_decay"])
    else:
        raise ValueError(
            f"optimizer must be one of {ACCEPTED}; got {type(optimizer).__module__}.{type(optimizer).__qualname__}"
        )
    if isinstance(optimizer, OffloadAdamW):
        optimizer._synchronize()  # its gpu-mode kernels may still be writing the state
    groups = [
        {
            "params": list(g["params"]),
            "lr": g["lr"],
            "betas": g["betas"],
            "eps": g["eps"],
            "weight_decay": g["weight_decay"],
        }
        for g in optimizer.param_groups
    ]
    defaults = optimizer.defaults
    converted = optimizer_class(
        groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        decoupled_weight_decay=decoupled,
        **common,
    )
    # Through the state dict: unsupported options (amsgrad, ...) are refused there, and the
    # moments move into host memory one tensor at a time.
    converted.load_state_dict(optimizer.state_dict())
    if isinstance(optimizer, OffloadAdamW):
        optimizer._stop_streaming()  # its gradient hooks would take the gradients from the new one
    return converted


def _checked(**given) -> dict:
    """The options, checked as OffloadAdamW takes them, before the old optimizer is touched."""
    return {
        name: options.check(name, value, caller=options.OFFLOAD_ADAMW, where=WHERE) for name, value in given.items()
    }
