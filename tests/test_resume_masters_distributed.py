"""Data parallel resume of a bf16 model is exact: each rank keeps its shard of every fp32
master (Slot.master_shard), the optimizer's state_dict() gathers them whole on every rank
under "master", and a load gives each rank its shard back where the weights round to the
master (engine/optimizer.py, [Note: masters in state dicts]). Two gloo processes, spawned
by test_distributed.py's harness; rank 0 pages every block's weights and rank 1 none, and
rank 0 loads the model's state dict first, rank 1 the optimizer's."""

from __future__ import annotations

import io

import torch
from helpers import assert_same_bits
from models import tiny_gpt
from test_distributed import _batch, _ok, _optimizer, _spawn

import trainstream

SPLIT, STEPS = 3, 6  # the checkpoint is taken after SPLIT of STEPS steps


def _wrapped(rank: int, seed: int):
    torch.manual_seed(seed)
    model, _, _ = tiny_gpt()
    model = model.to(torch.bfloat16)
    return trainstream.wrap(
        model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True, param_offload=rank == 0
    )


def _steps(model, opt, rank, world, first, last) -> list:
    losses = []
    for step in range(first, last):
        loss = model(*_batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _uninterrupted_and_resumed(rank, world):
    model, opt = _wrapped(rank, 0)
    _steps(model, opt, rank, world, 0, SPLIT)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)  # a collective: every rank asks
    whole = _steps(model, opt, rank, world, SPLIT, STEPS)
    out = {"whole": whole, "whole weights": _weights(model)}
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    out["masters"] = {i: st["master"] for i, st in saved["optim"]["state"].items()}
    out["shapes"] = [tuple(p.shape) for g in opt.param_groups for p in g["params"]]
    model, opt = _wrapped(rank, 1)  # other initial weights: the checkpoint's are loaded
    if rank == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
    else:
        opt.load_state_dict(saved["optim"])
        model.load_state_dict(saved["model"])
    out["resumed"] = _steps(model, opt, rank, world, SPLIT, STEPS)
    out["resumed weights"] = _weights(model)
    out["events"] = trainstream.memory_report(model)["events"]
    return out


def test_a_bf16_model_resumes_bit_for_bit_on_two_ranks(tmp_path):
    results = _ok(_spawn(2, tmp_path, _uninterrupted_and_resumed))
    for res in results:
        # Every param has its master, whole (the param's shape), the same on both ranks.
        assert len(res["masters"]) == len(res["shapes"])
        for i, shape in enumerate(res["shapes"]):
            master = res["masters"][i]
            assert master.dtype == torch.float32 and tuple(master.shape) == shape
            assert_same_bits(master, results[0]["masters"][i])
        assert res["resumed"] == res["whole"]
        assert res["resumed weights"].keys() == res["whole weights"].keys()
        for k, v in res["whole weights"].items():
            assert_same_bits(res["resumed weights"][k], v)
        assert f"resume: {len(res['shapes'])} loaded fp32 master(s) taken\n" in res["events"] + "\n"


def _masters_before_and_after_unwrap(rank, world):
    model, opt = _wrapped(rank, 0)
    _steps(model, opt, rank, world, 0, SPLIT)
    wrapped = {i: st["master"] for i, st in opt.state_dict()["state"].items()}  # a collective
    trainstream.unwrap(model)  # a collective: the moments and the masters gathered whole
    return {"wrapped": wrapped, "unwrapped": {i: st.get("master") for i, st in opt.state_dict()["state"].items()}}


def test_the_masters_gathered_at_unwrap_stay_in_the_state_dict(tmp_path):
    """train -> unwrap() -> checkpoint on two ranks: each rank's optimizer keeps every fp32
    master whole (gathered at unwrap), the ones a state_dict() gave while wrapped."""
    for res in _ok(_spawn(2, tmp_path, _masters_before_and_after_unwrap)):
        assert res["wrapped"] and res["unwrapped"].keys() == res["wrapped"].keys()
        for i, master in res["wrapped"].items():
            assert_same_bits(res["unwrapped"][i], master)
