"""The device-state update (a LoRA's adapters and their AdamW state on the compute device) and
the host path answer a non-finite gradient alike (docs/semantics.md): the same parameter named
when several are not finite, the same exception when backward itself raises with one found
before; and OffloadAdamW refuses a saved state without its step count, as torch's AdamW does."""

from __future__ import annotations

import pytest
import torch

import trainstream


def test_offload_adamw_refuses_a_state_without_its_step_count_as_torch_does():
    """torch's AdamW refuses a param's state without "step" at load_state_dict (a KeyError);
    OffloadAdamW refuses it there too, naming the param's index and the key, before anything
    is replaced. An empty state (a param never stepped) loads, as in torch."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = trainstream.OffloadAdamW([p], lr=1e-2)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    fresh = torch.nn.Parameter(torch.randn(4, 3))
    target = trainstream.OffloadAdamW([fresh], lr=1e-2)
    before = target.state_dict()
    for state in (
        {"master": saved["state"][0]["exp_avg"].clone()},
        {k: v for k, v in saved["state"][0].items() if k != "step"},
    ):
        broken = dict(saved, state={0: state})
        with pytest.raises(KeyError, match="step"):
            reference = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 3))])
            reference.load_state_dict(dict(broken, state={0: dict(state)}))
        with pytest.raises(ValueError, match=r"state\[0\] has no 'step'"):
            target.load_state_dict(broken)
        assert target.state_dict()["state"] == before["state"]  # nothing replaced
    target.load_state_dict(dict(saved, state={}))  # a param never stepped
    assert target.state_dict()["state"] == {}
