"""Data parallel (engine/distributed.py): 2 and 3 CPU processes over gloo, each spawned with
a FileStore and a short group timeout, joined under a deadline so a failure never hangs.

The reference for "matches one process training on the whole batch" is torch's own DDP,
run in the same processes on the same batches: a rank's mean gradient differs from the
whole batch's by reduction-order rounding, which Adam turns into lr-sized steps on
near-zero gradients, so the engine must be within three times DDP's distance."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_bits, run_ranks
from models import tiny_gpt

import trainstream
from trainstream.api import _engine_of
from trainstream.engine import distributed as engine_dist
from trainstream.engine.distributed import StockGradients, UnitShards, order_with_unseen
from trainstream.engine.switch import stock_bytes

GLOBAL_ROWS = 6  # sequences per step, split evenly over 1, 2 or 3 ranks
LR = 1e-2
JOIN_S = 90  # every spawned group is killed past this: a hang fails the test, not CI


def _batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 97, (GLOBAL_ROWS, 16), generator=g)
    tgt = torch.roll(idx, -1, 1)
    per = GLOBAL_ROWS // world
    return idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def _model():
    torch.manual_seed(0)
    model, _, _ = tiny_gpt()
    return model


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)


def _train(
    model, opt, rank, world, steps, accumulation=1, clip=None, stock=False, poison=None, autocast=False, last=None
):
    """`steps` optimizer steps on this rank's share of each global batch; `poison`: the step
    at which this rank's loss is NaN; `autocast`: forward under bf16 autocast; `last`: the
    passes of the last step, if fewer than `accumulation` (an epoch's last partial batch)."""
    norms = []
    for step in range(steps):
        passes = last if last is not None and step == steps - 1 else accumulation
        for micro in range(passes):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(*_batch(step * accumulation + micro, rank, world)) / accumulation
            if step == poison:
                loss = loss * float("nan")
            loss.backward()
        if stock and clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        if not stock and clip is not None:
            norms.append(opt.last_grad_norm)
    return norms


def _host_state(model) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert_same_bits(a[k], b[k])


def _same_values(a, b) -> None:
    """Two state dicts (or any values in them) alike: the same keys, tensors bit for bit,
    everything else equal."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same_values(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert_same_bits(a, b)
    else:
        assert a == b


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# -- spawning ---------------------------------------------------------------------------------


def _entry(rank, world, root, timeout_s, fn, args, backend):
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
    store = os.path.join(root, "store")
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world, *args)
    except BaseException as e:  # the parent reads what each rank raised
        result = {"error": f"{type(e).__name__}: {e}"}
    torch.save(result, os.path.join(root, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawn(world: int, root, fn, *args, timeout_s: float = 30, backend: str = "gloo") -> list:
    """Run fn(rank, world, *args) on `world` processes; each one's return value (or
    {"error": ...}). A process still running past JOIN_S is killed and reads as None."""
    root = str(root)
    return run_ranks(_entry, world, root, lambda r: (r, world, root, timeout_s, fn, args, backend), JOIN_S)


def _ok(results: list) -> list:
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} did not finish"
        assert "error" not in res, f"rank {r}: {res['error']}"
    return results


# -- what the ranks run -----------------------------------------------------------------------


def _step_counts(opt) -> list:
    """Each parameter's AdamW step count (a collective with data parallel: every rank asks)."""
    return [float(st["step"]) for _, st in sorted(opt.state_dict()["state"].items())]


def _wrapped_and_ddp(rank, world, steps, options, accumulation, clip, checkpoint, last=None, make=_model):
    """The engine data parallel, then torch's DDP on the same batches (same processes), each
    on a model from `make`."""
    model = make()
    opt = _optimizer(model)
    model, opt = trainstream.wrap(
        model,
        opt,
        device="cpu",
        threads=1,
        profile=False,
        accumulation_steps=accumulation,
        max_grad_norm=clip,
        **options,
    )
    norms = _train(model, opt, rank, world, steps, accumulation, clip, last=last)
    out = {
        "state": _host_state(model),
        "norms": norms,
        "report": trainstream.memory_report(model),
        "skipped": opt.skipped_steps,
        "step counts": _step_counts(opt),
    }
    if checkpoint is not None:
        osd = opt.state_dict()  # a collective: every rank asks
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": osd}, checkpoint)
    ddp_model = torch.nn.parallel.DistributedDataParallel(make())
    ddp_opt = _optimizer(ddp_model)
    _train(ddp_model, ddp_opt, rank, world, steps, accumulation, clip, stock=True, last=last)
    out["ddp"] = {k.removeprefix("module."): v for k, v in _host_state(ddp_model).items()}
    return out


def _two_runs(rank, world, checkpoint):
    """Eager updates (rank 0 saves a checkpoint), then accumulation with clipping."""
    eager = _wrapped_and_ddp(rank, world, STEPS, {"offload": True}, 1, None, checkpoint)
    held = _wrapped_and_ddp(rank, world, HELD_STEPS, {"offload": True}, ACCUMULATION, CLIP, None)
    switched = _wrapped_and_ddp(rank, world, SWITCHED_STEPS, {}, 1, None, None)  # offload="auto"
    # The last window ends at step() after 1 of its 2 passes, without clipping.
    partial = _wrapped_and_ddp(rank, world, PARTIAL_STEPS, {"offload": True}, ACCUMULATION, None, None, last=1)
    placements = _placements_differ(rank, world, 2)
    bf16 = _bf16_model(rank, world)
    repaged = _repaged(rank, world)
    rank0_only = _gathered_to_rank_zero(rank, world, _checkpoint(checkpoint, rank0_only=True))
    return {
        "rank0_only": rank0_only,
        "repaged": repaged,
        "eager": eager,
        "held": held,
        "switched": switched,
        "partial": partial,
        "placements": placements,
        "bf16": bf16,
    }


def _paged_with_a_nan(rank, world, steps, poison_rank, poison_step):
    model, opt = _wrap_on_cpu(_model(), param_offload=True, activation_offload=True, moment_dtype="bfloat16")
    # Under bf16 autocast a paged block keeps a bf16 copy of its weights, which the update
    # writes beside the master: both are gathered.
    _train(model, opt, rank, world, steps, poison=poison_step if rank == poison_rank else None, autocast=True)
    return {"state": _host_state(model), "skipped": opt.skipped_steps, "report": trainstream.memory_report(model)}


def _placements_differ(rank, world, steps):
    """Rank 0 pages every block's weights, rank 1 none, under bf16 autocast: rank 0's paged
    blocks keep a bf16 copy beside the master, rank 1's do not."""
    model = _model()
    model, opt = trainstream.wrap(
        model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True, param_offload=rank == 0
    )
    _train(model, opt, rank, world, steps, autocast=True)
    return {"state": _host_state(model), "report": trainstream.memory_report(model)}


def _bf16_model(rank, world):
    """A bf16 model, rank 0 paging every block's weights and rank 1 none: the weights after 2
    steps, this rank's shards of the fp32 masters, then the weights after a step at lr 0 (it
    writes each master back as it is, and the weights gathered from it) that follows a load,
    and one that follows an in-place edit."""
    model = _model().to(torch.bfloat16)
    model, opt = trainstream.wrap(
        model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True, param_offload=rank == 0
    )
    _train(model, opt, rank, world, 2)
    out = {"state": _host_state(model), "report": trainstream.memory_report(model)}
    engine = _engine_of(model)
    out["masters"] = {s.name: (s.shard, s.master_shard.clone()) for u in engine.units for s in u.trainable}
    for group in opt.param_groups:
        group["lr"] = 0.0
    out["loaded"] = {k: v * 0.5 for k, v in out["state"].items()}  # exact in bf16
    model.load_state_dict(out["loaded"])
    _train(model, opt, rank, world, 1)
    out["after the load"] = _host_state(model)
    with torch.no_grad():
        model.layers[0].fc.weight.mul_(2)  # paged on rank 0, resident on rank 1
        model.head.weight.mul_(2)
    out["edited"] = _host_state(model)
    _train(model, opt, rank, world, 1)
    out["after the edit"] = _host_state(model)
    return out


def _repaged(rank, world, optimizer_mode="cpu"):
    """Block 0 paged before the second step and resident again before the third, moved as
    Engine.apply moves the adapter's replans, beside the same steps without moves (placement
    given by hand: the adapter itself moves nothing)."""
    out = {}
    for moves in (False, True):
        model, opt = _wrapped_in_mode(optimizer_mode, {"param_offload": False, "activation_offload": False})
        engine = _engine_of(model)
        block = engine.block_units[0]
        for step in range(STEPS):
            if moves and step in (1, 2):
                engine.synchronize()
                engine.weights.repage({block})
                engine.state_hooks.remove()
                engine.state_hooks.install()
                out[f"paged at step {step}"] = block.paged
            model(*_batch(step, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        out["moved" if moves else "still"] = _host_state(model)
    out["host weights of the resident block"] = sum(len(s.host) for s in block.trainable)
    out["master bytes"] = trainstream.memory_report(model)["host_master_bytes"]
    return out


# state_dict(rank0_only=True)'s cases: the model's dtype and wrap()'s options.
GATHER_CASES = {
    "fp32": (torch.float32, {"offload": True}),
    "bf16 model": (torch.bfloat16, {"offload": True}),  # fp32 masters, gathered under "master"
    "bf16 moments": (torch.float32, {"offload": True, "moment_dtype": "bfloat16"}),
    "stock": (torch.float32, {}),  # offload="auto" switches to stock training after 2 steps
}


def _checkpoint(checkpoint: str, rank0_only: bool) -> str:
    """Where rank 0 saves the eager run's checkpoint (its optimizer state from state_dict() on
    every rank), or the fp32 case's of GATHER_CASES (from state_dict(rank0_only=True))."""
    return os.path.splitext(checkpoint)[0] + "-rank0-only.pt" if rank0_only else checkpoint


def _gathered_to_rank_zero(rank, world, checkpoint=None):
    """Each of GATHER_CASES: STEPS steps, state_dict() on every rank and then
    state_dict(rank0_only=True), and one step more; beside it the same run without the
    second call. `checkpoint`: rank 0 saves the fp32 case's model and rank-0 dict there."""
    out = {}
    for case, (dtype, options) in GATHER_CASES.items():
        out[case] = {}
        for asks in (True, False):
            model = _model().to(dtype)
            model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, **options)
            _train(model, opt, rank, world, STEPS)
            run = {"mode": trainstream.memory_report(model)["mode"], "every rank": copy.deepcopy(opt.state_dict())}
            if asks:
                with _gathers_recorded() as run["gathers"]:
                    run["rank 0 only"] = copy.deepcopy(opt.state_dict(rank0_only=True))  # a collective too
                if checkpoint is not None and case == "fp32" and rank == 0:
                    torch.save({"model": model.state_dict(), "optim": run["rank 0 only"]}, checkpoint)
            _train(model, opt, rank, world, 1)
            run["after"] = {"state": _host_state(model), "optim": copy.deepcopy(opt.state_dict())}
            out[case]["asked" if asks else "not asked"] = run
    return out


@contextlib.contextmanager
def _gathers_recorded():
    """The gathers the engine issues inside the block, in order: ("all-gather", True) or
    ("gather", whether this rank receives)."""
    from trainstream.engine import distributed as engine_dist

    issued = []
    real_gather, real_all_gather = dist.gather, engine_dist._all_gather

    def gather(tensor, gather_list=None, *args, **kwargs):
        issued.append(("gather", gather_list is not None))
        return real_gather(tensor, gather_list, *args, **kwargs)

    def all_gather(*args, **kwargs):
        issued.append(("all-gather", True))
        return real_all_gather(*args, **kwargs)

    dist.gather, engine_dist._all_gather = gather, all_gather
    try:
        yield issued
    finally:
        dist.gather, engine_dist._all_gather = real_gather, real_all_gather


def _resume(rank, world, checkpoint, make=_model):
    """Load a checkpoint into a model from `make`, give back both state dicts (the optimizer's
    also as gathered to rank 0 alone), then take one step."""
    model = make()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
    saved = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    loaded = {"model": _host_state(model), "optim": copy.deepcopy(opt.state_dict())}  # steps write the live one
    loaded["optim rank 0 only"] = copy.deepcopy(opt.state_dict(rank0_only=True))
    _train(model, opt, rank, world, 1)
    return {"loaded": loaded, "after": _host_state(model), "report": trainstream.memory_report(model)}


def _dropped_windows(rank, world, poison_rank, make=_model):
    """A held window (2 accumulated passes, or clipping) dropped by zero_grad() after one pass
    whose loss is NaN on `poison_rank`: optimizer.skipped_steps for each (a model from `make`)."""
    out = {}
    for name, options in (("accumulated", {"accumulation_steps": 2}), ("clipped", {"max_grad_norm": 1.0})):
        model = make()
        model, opt = trainstream.wrap(
            model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True, **options
        )
        loss = model(*_batch(0, rank, world))
        (loss * float("nan") if rank == poison_rank else loss).backward()
        opt.zero_grad()
        out[name] = opt.skipped_steps
        out[f"{name} device state"] = bool(_engine_of(model).plan.device_state)
    return out


def _nan_in_the_embedding(rank, world, poison_rank):
    """One window of 2 accumulated passes in which only the embedding's gradient is NaN, on
    `poison_rank`'s second pass (the embedding is reduced last): the whole window is skipped."""
    model = _model()
    model, opt = trainstream.wrap(
        model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True, accumulation_steps=2
    )
    for micro in range(2):
        hook = None
        if rank == poison_rank and micro == 1:
            hook = model.emb.weight.register_hook(lambda g: g * float("nan"))
        model(*_batch(micro, rank, world)).backward()
        if hook is not None:
            hook.remove()
    opt.step()
    opt.zero_grad()
    return {"state": _host_state(model), "skipped": opt.skipped_steps}


def _nan_in_the_last_block(rank, world, poison_rank):
    """Eager updates: at step 1 only the last block's gradient is NaN, on `poison_rank`. The
    parameters that step 1 changed: those of the units backward handed on before that block
    (the head and the final norm), as one process leaves them updated."""
    model = _model()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
    _train(model, opt, rank, world, 1)
    before = _host_state(model)
    hook = None
    if rank == poison_rank:
        hook = model.layers[3].fc.weight.register_hook(lambda g: g * float("nan"))
    model(*_batch(1, rank, world)).backward()
    opt.step()
    opt.zero_grad()
    if hook is not None:
        hook.remove()
    after = _host_state(model)
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    return {"changed": changed, "skipped": opt.skipped_steps}


def _group_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)  # torch's registry of live process groups


def _groups_given_back(rank, world):
    """Live process groups around wrap()s and unwrap()s: after 5 wrap/train/unwrap rounds, a
    wrap() refused after its groups were made, and a run switched to stock (which keeps
    only the reduction group for the gradients' averaging) and then unwrapped."""
    before = _group_count()
    for _ in range(5):
        model = _model()
        model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
        _train(model, opt, rank, world, 1)
        trainstream.unwrap(model)
    out = {"before": before, "after 5 unwraps": _group_count()}
    model = _model()
    try:
        trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, param_offload=[99])
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    out["after a refused wrap"] = _group_count()
    model = _model()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False)
    _train(model, opt, rank, world, SWITCHED_STEPS - 2)  # offload="auto" switches after 2 steps
    out["mode"] = trainstream.memory_report(model)["mode"]
    out["in stock mode"] = _group_count()
    trainstream.unwrap(model)
    out["after unwrapping the stock run"] = _group_count()
    return out


def _failures(rank, world):
    """Models and options that differ (refused on every rank), nonfinite="raise", a model
    already in DDP, then a rank that raises after wrap()."""
    out = {}
    torch.manual_seed(0)
    model, _, _ = tiny_gpt(dim=64 if rank == 0 else 32)
    try:
        trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
        out["differ"] = None
    except ValueError as e:
        out["differ"] = str(e)
    model = _model()
    try:
        clip = 1.0 if rank == 0 else None
        trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, max_grad_norm=clip)
        out["options differ"] = None
    except ValueError as e:
        out["options differ"] = str(e)
    # offload='auto' agrees on the switch with a collective; the moments' dtype is what
    # state_dict() gathers.
    for key, value in (("offload", "auto" if rank == 0 else True), ("moment_dtype", ("float32", "bfloat16")[rank])):
        model = _model()
        try:
            trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, **{key: value})
            out[f"{key} differs"] = None
        except ValueError as e:
            out[f"{key} differs"] = str(e)
    model = _model()
    model, opt = trainstream.wrap(
        model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True, nonfinite="raise"
    )
    try:
        _train(model, opt, rank, world, 1, poison=0 if rank == 1 else None)
        out["nonfinite raised"] = None
    except FloatingPointError as e:
        out["nonfinite raised"] = str(e)
    before = _host_state(model)
    _train(model, opt, rank, world, 1)  # the next window goes on, every rank in step
    out["after the raise"] = (before, _host_state(model))
    out["dropped"] = _dropped_windows(rank, world, poison_rank=1)
    out["groups"] = _groups_given_back(rank, world)
    out["nan in the embedding"] = _nan_in_the_embedding(rank, world, poison_rank=1)
    out["nan in the last block"] = _nan_in_the_last_block(rank, world, poison_rank=1)
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    try:
        trainstream.wrap(ddp, _optimizer(ddp), device="cpu", threads=1, profile=False)
        out["ddp"] = None
    except ValueError as e:
        out["ddp"] = str(e)
    model = _model()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
    _train(model, opt, rank, world, 1)
    trainstream.unwrap(model)  # a collective: the optimizer gathers its moments back
    out["moments after unwrap"] = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    model = _model()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
    if rank == 1:
        out["raised"] = "rank 1 fails before its first backward"
        return out
    try:
        _train(model, opt, rank, world, 2)
        out["raised"] = None
    except Exception as e:  # the others' collectives time out
        out["raised"] = f"{type(e).__name__}: {e}"
    return out


# -- single-process references ----------------------------------------------------------------


def _wrap_on_cpu(model, accumulation=1, clip=None, **options):
    """wrap() on the CPU, one host thread, no machine profile, with _optimizer(model)."""
    return trainstream.wrap(
        model,
        _optimizer(model),
        device="cpu",
        threads=1,
        profile=False,
        accumulation_steps=accumulation,
        max_grad_norm=clip,
        **options,
    )


def _alone(steps, accumulation=1, clip=None, wrapped=True, offload=True, last=None, make=_model):
    model = make()
    if wrapped:
        model, opt = _wrap_on_cpu(model, accumulation, clip, offload=offload, distributed=False)
    else:
        opt = _optimizer(model)
    norms = _train(model, opt, 0, 1, steps, accumulation, clip, stock=not wrapped, last=last)
    return model, opt, norms


def _as_close_as_ddp(run: dict, steps: int, **options) -> tuple:
    """The weights a data-parallel run of _wrapped_and_ddp ended with are within three times
    DDP's own distance (its "ddp" weights) from one process training on the whole batch, wrapped
    and stock, with _alone's `options`. Returns that one wrapped process's (model, optimizer,
    norms)."""
    alone = _alone(steps, **options)
    stock, _, _ = _alone(steps, wrapped=False, **{k: v for k, v in options.items() if k != "offload"})
    ours = _max_diff(run["state"], _host_state(alone[0]))
    ddp = _max_diff(run["ddp"], _host_state(stock))
    assert ours <= 3 * max(ddp, 1e-7), (ours, ddp)
    return alone


STEPS = 3
HELD_STEPS, ACCUMULATION, CLIP = 2, 2, 0.05
SWITCHED_STEPS = 5  # offload="auto" switches to stock training after 2 measured steps
PARTIAL_STEPS = 2  # of ACCUMULATION passes, the last one of 1


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two ranks train 3 eager steps (rank 0 saves a checkpoint), then 2 steps of 2
    accumulated passes with clipping; DDP beside each. Then the other runs of _two_runs,
    among them GATHER_CASES (rank 0 saves the fp32 case's rank-0 dict as a second checkpoint)."""
    root = tmp_path_factory.mktemp("dp2")
    checkpoint = str(root / "ckpt.pt")
    results = _ok(_spawn(2, root, _two_runs, checkpoint))
    return (
        [r["eager"] for r in results],
        checkpoint,
        [r["held"] for r in results],
        [r["switched"] for r in results],
        [r["partial"] for r in results],
        [r["placements"] for r in results],
        [r["bf16"] for r in results],
        [r["repaged"] for r in results],
        [r["rank0_only"] for r in results],
    )


@pytest.fixture(scope="module")
def three_ranks(two_ranks, tmp_path_factory):
    """Three ranks resume the two ranks' checkpoints, then train paged with a NaN on rank 2, then
    the rest of _three_runs."""
    _, checkpoint, *_ = two_ranks
    return _ok(_spawn(3, tmp_path_factory.mktemp("dp3"), _three_runs, checkpoint))


def _three_runs(rank, world, checkpoint):
    return {
        "resume": {gathered: _resume(rank, world, _checkpoint(checkpoint, gathered)) for gathered in (False, True)},
        "rank0_only": _gathered_to_rank_zero(rank, world),
        "paged": _paged_with_a_nan(rank, world, 3, 2, 1),
        "quantized": _frozen_quantized_base(rank, world),
    }


def _frozen_quantized_base(rank, world):
    """The blocks' matmul weights frozen and stored as int8, the rest trained (as LoRA over
    a quantized base trains its adapters)."""
    model = _model()
    for name, p in model.named_parameters():
        if name.startswith("layers.") and name.endswith(("qkv.weight", "proj.weight", "fc.weight", "out.weight")):
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, foreach=False)
    model, opt = trainstream.wrap(model, opt, device="cpu", threads=1, profile=False, offload=True, quantize="int8")
    _train(model, opt, rank, world, 2)
    return {"state": _host_state(model), "report": trainstream.memory_report(model)}


# optimizer_mode="gpu" beside the host AdamW (on the CPU path the host AdamW stands in for the
# kernel, with the device update's layout: the shards' moment regions, the reduced shards in
# its arena): name -> (wrap() options, accumulation_steps, max_grad_norm).
GPU_MODE_CASES = {
    "eager, paged, bf16 moments": ({"param_offload": True, "moment_dtype": "bfloat16"}, 1, None),
    "held, resident": ({"param_offload": False}, ACCUMULATION, CLIP),
}


def _wrapped_in_mode(mode: str, options: dict, accumulation=1, clip=None, model=None):
    """wrap() on the CPU with offload=True and optimizer_mode `mode` (a new _model() by default)."""
    model = _model() if model is None else model
    return _wrap_on_cpu(model, accumulation, clip, offload=True, optimizer_mode=mode, **options)


def _gpu_mode(rank, world, checkpoint):
    """Each of GPU_MODE_CASES trained with optimizer_mode "cpu" and "gpu" on the same batches.
    Then the eager case in "gpu" mode: rank 0 saves a checkpoint, the run takes one step
    more, and a new run loads the checkpoint (with as many ranks) and takes the same step."""
    from trainstream import options as ts_options

    ts_options.CPU_STANDS_IN_FOR_GPU_OPTIMIZER = True  # as tests/conftest.py sets it in this process
    out = {}
    for case, (options, accumulation, clip) in GPU_MODE_CASES.items():
        out[case] = {}
        for mode in ("cpu", "gpu"):
            model, opt = _wrapped_in_mode(mode, options, accumulation, clip)
            norms = _train(model, opt, rank, world, STEPS, accumulation, clip)
            out[case][mode] = {
                "state": _host_state(model),
                "optim": copy.deepcopy(opt.state_dict()),  # a collective: every rank asks
                "norms": norms,
                "report": trainstream.memory_report(model),
            }
    options, *_ = GPU_MODE_CASES["eager, paged, bf16 moments"]
    model, opt = _wrapped_in_mode("gpu", options)
    _train(model, opt, rank, world, STEPS)
    osd = opt.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": osd}, checkpoint)
    _train(model, opt, rank, world, 1)
    out["continued"] = _host_state(model)
    dist.barrier()  # the checkpoint is written
    model, opt = _wrapped_in_mode("gpu", options)
    saved = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    _train(model, opt, rank, world, 1)
    out["resumed"] = _host_state(model)
    trainstream.unwrap(model)  # a collective: the optimizer gathers its moments back
    out["moments after unwrap"] = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    whole = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(whole)  # into the optimizer, no longer into the engine's regions
    out["loaded after unwrap"] = opt.state_dict()
    out["whole after unwrap"] = whole
    out["repaged"] = _repaged(rank, world, optimizer_mode="gpu")
    return out


@pytest.fixture(scope="module")
def gpu_mode(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp-gpu-mode")
    checkpoint = str(root / "ckpt.pt")
    return _ok(_spawn(2, root, _gpu_mode, checkpoint)), checkpoint


@pytest.mark.parametrize("case", list(GPU_MODE_CASES))
def test_gpu_mode_trains_each_shard_as_the_host_adamw_does(gpu_mode, case):
    """optimizer_mode="gpu" under data parallel: the same bits as the host AdamW on every rank
    (weights, the gathered optimizer state, the clipping norms), each rank holding half the
    moments, every update through the moment regions."""
    results, _ = gpu_mode
    for res in results:
        cpu, gpu = res[case]["cpu"], res[case]["gpu"]
        _same_bits(gpu["state"], cpu["state"])
        _same_values(gpu["optim"], cpu["optim"])
        assert gpu["norms"] == cpu["norms"]
        assert gpu["report"]["plan"]["optimizer_mode"] == "gpu" and cpu["report"]["plan"]["optimizer_mode"] == "cpu"
        # Every update went through the moment regions (on the CPU path each is "copied").
        copies = gpu["report"]["plan"]["moment_copies"]
        assert copies["copied"] >= STEPS * copies["regions"] > 0
        assert gpu["report"]["host_moment_bytes"] == cpu["report"]["host_moment_bytes"]
        assert gpu["report"]["distributed"]["world_size"] == 2
    _same_bits(results[0][case]["gpu"]["state"], results[1][case]["gpu"]["state"])
    assert _max_diff(results[0][case]["gpu"]["state"], _host_state(_model())) > 0  # it trained
    moments = [r[case]["gpu"]["report"]["host_moment_bytes"] for r in results]
    whole = sum(moments)
    n_params = len(list(_model().parameters()))
    assert all(abs(m - whole / 2) <= 8 * n_params for m in moments)


def test_gpu_mode_resumes_exactly_with_two_ranks_and_alone(gpu_mode):
    """A checkpoint of optimizer_mode="gpu" under data parallel: loaded with the same two
    ranks, the next step gives the bits the run that went on gave; loaded in one process, its
    state is the saved state, and unwrap() gave each rank the whole moments."""
    from trainstream import options as ts_options

    results, checkpoint = gpu_mode
    for res in results:
        _same_bits(res["resumed"], res["continued"])
        shapes = {n: p.shape for n, p in _model().named_parameters()}
        assert {n: m.shape for n, m in res["moments after unwrap"].items()} == shapes
        _same_values(res["loaded after unwrap"], res["whole after unwrap"])
    assert ts_options.CPU_STANDS_IN_FOR_GPU_OPTIMIZER  # tests/conftest.py, in this process too
    options, *_ = GPU_MODE_CASES["eager, paged, bf16 moments"]
    model, opt = _wrapped_in_mode("gpu", options)
    saved = torch.load(checkpoint, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    _same_bits(_host_state(model), saved["model"])
    _same_values(opt.state_dict(), saved["optim"])


def test_gpu_mode_moves_a_block_between_paged_and_resident_as_the_host_adamw(gpu_mode, two_ranks):
    """The adapter's moves with optimizer_mode="gpu" under data parallel: a block paged takes
    its full host weights from the device (the master is the shard's: nothing is refreshed
    from them), and the run gives the bits of the host AdamW's run of the same moves."""
    results, _ = gpu_mode
    for res, cpu in zip(results, two_ranks[7]):
        r = res["repaged"]
        assert r["paged at step 1"] and not r["paged at step 2"]
        _same_bits(r["moved"], r["still"])
        _same_bits(r["moved"], cpu["moved"])
        assert r["host weights of the resident block"] == 0


def test_every_rank_holds_the_same_weights(two_ranks):
    (a, b), *_ = two_ranks
    _same_bits(a["state"], b["state"])


def test_matches_one_process_as_closely_as_ddp(two_ranks):
    (a, _), *_ = two_ranks
    _as_close_as_ddp(a, STEPS)


def test_each_rank_holds_half_the_moments(two_ranks):
    (a, b), *_ = two_ranks
    model, _, _ = _alone(1)
    alone = trainstream.memory_report(model)["host_moment_bytes"]
    for r in (a, b):
        assert r["report"]["distributed"]["world_size"] == 2
        # Each parameter's chunks are ceil(n / 2): a rank holds at most one element more per parameter.
        n_params = len(list(_model().parameters()))
        assert alone / 2 <= r["report"]["host_moment_bytes"] <= alone / 2 + 8 * n_params
        assert r["report"]["distributed"]["bytes_communicated_per_step"] > 0
    assert a["report"]["host_moment_bytes"] + b["report"]["host_moment_bytes"] == alone
    # The planner counts the shard: half the moments' host bytes, on every rank alike.
    n = a["report"]["distributed"]["trainable_elements"]
    assert trainstream.memory_report(model)["plan"]["budget"]["host"]["moments"] == 8 * n
    assert a["report"]["plan"]["budget"] == b["report"]["plan"]["budget"]
    assert a["report"]["plan"]["budget"]["host"]["moments"] == 8 * -(-n // 2)


def test_each_rank_holds_half_the_fp32_master(two_ranks):
    """Each rank keeps only its shard of every fp32 master (resident units: the weights are on
    the device, and the new ones come from the all-gather)."""
    (a, b), *_ = two_ranks
    model, _, _ = _alone(1)
    alone = trainstream.memory_report(model)["host_master_bytes"]
    assert alone == 4 * a["report"]["distributed"]["trainable_elements"]
    n_params = len(list(_model().parameters()))
    for r in (a, b):
        # Each parameter's chunks are ceil(n / 2): a rank holds at most one element more or less per parameter.
        assert abs(r["report"]["host_master_bytes"] - alone / 2) <= 4 * n_params
        assert r["report"]["distributed"]["shard_master_bytes"] == r["report"]["host_master_bytes"]
    assert a["report"]["host_master_bytes"] + b["report"]["host_master_bytes"] == alone
    # The planner counts the shard (the same on every rank) and no full weights of a resident unit.
    n = a["report"]["distributed"]["trainable_elements"]
    for r in (a, b):
        host = r["report"]["plan"]["budget"]["host"]
        assert host["fp32 master weights"] == 4 * -(-n // 2)
        assert host["lower-precision copies"] == 0


def test_three_paged_ranks_hold_a_third_of_the_fp32_master_each(three_ranks):
    """Paged blocks keep their full weights on the host (their forward reads them there), but
    the fp32 master each rank updates is its third alone."""
    model = _model()
    model, _ = trainstream.wrap(
        model, _optimizer(model), device="cpu", threads=1, profile=False, param_offload=True, distributed=False
    )
    alone = trainstream.memory_report(model)["host_master_bytes"]
    n_params = len(list(_model().parameters()))
    held = [r["paged"]["report"]["host_master_bytes"] for r in three_ranks]
    for bytes_ in held:  # chunks of ceil(n / 3): the last rank's may be up to two elements short
        assert abs(bytes_ - alone / 3) <= 8 * n_params
    assert sum(held) == alone


def test_a_bf16_model_gathers_its_weights_rounded_from_the_sharded_masters(two_ranks):
    """A bf16 model: each rank keeps its shard of the fp32 master, the new weights travel in
    bf16, rounded by each rank from its shard; a rank paging its blocks and one keeping them
    resident hold the same bits, and those are the whole master rounded to nearest even,
    whose low bits the shards keep. A load and an in-place edit reach the shards: a step at
    lr 0 after either leaves the weights as loaded or edited."""
    a, b = two_ranks[6]
    assert a["report"]["params"]["paged_blocks"] == [0, 1, 2, 3]
    assert b["report"]["params"]["paged_blocks"] == []
    _same_bits(a["state"], b["state"])
    low_bits = False
    for name, (shard_a, master_a) in a["masters"].items():
        shard_b, master_b = b["masters"][name]
        weights = a["state"][name]
        assert shard_a == (0, master_a.numel()) and shard_b == (master_a.numel(), weights.numel())
        whole = torch.cat([master_a, master_b]).view(weights.shape)
        assert whole.dtype == torch.float32
        assert_same_bits(whole.to(torch.bfloat16), weights)
        low_bits = low_bits or not torch.equal(whole, weights.float())
    assert low_bits  # the masters are not the bf16 weights widened
    total = sum(w.numel() for w in a["state"].values())
    assert a["report"]["host_master_bytes"] + b["report"]["host_master_bytes"] == 4 * total
    for r in (a, b):
        _same_bits(r["after the load"], r["loaded"])
        _same_bits(r["after the edit"], r["edited"])
    assert not torch.equal(a["edited"]["head.weight"], a["loaded"]["head.weight"])  # the edit changed it


def _one_rank_runs(rank, world, distributed=True, optimizer_mode="cpu"):
    """3 steps of a model on each path the all-gather serves (an fp32 model paged under bf16
    autocast, a bf16 model resident and paged), with a process group of one rank
    (distributed=True: the data-parallel path) or alone (False)."""
    out = {}
    for name, bf16, paged, autocast in (
        ("fp32 paged", False, True, True),
        ("bf16 resident", True, False, False),
        ("bf16 paged", True, True, False),
    ):
        model = _model().to(torch.bfloat16) if bf16 else _model()
        options = {"param_offload": paged, "distributed": distributed}
        model, opt = _wrapped_in_mode(optimizer_mode, options, model=model)
        _train(model, opt, rank, world, STEPS, autocast=autocast)
        out[name] = {"state": _host_state(model), "distributed": trainstream.memory_report(model)["distributed"]}
    return out


def _one_rank_and_alone(rank, world):
    """Both in the same process (its thread count decides the matmuls' rounding); the
    data-parallel path also with optimizer_mode="gpu" (the host AdamW standing in for the
    kernel over the device update's layout)."""
    from trainstream import options as ts_options

    ts_options.CPU_STANDS_IN_FOR_GPU_OPTIMIZER = True
    return {
        "dp": _one_rank_runs(rank, world),
        "dp, gpu mode": _one_rank_runs(rank, world, optimizer_mode="gpu"),
        "alone": _one_rank_runs(rank, world, distributed=False),
    }


def test_one_rank_data_parallel_is_bit_exact_with_one_process(tmp_path):
    """With one rank the data-parallel path is one process's arithmetic: the weights gathered
    from the master shard (rounded by the gathering rank for a bf16 model, or for a paged
    block's autocast copy) are the bits the update writes training alone."""
    (res,) = _ok(_spawn(1, tmp_path, _one_rank_and_alone))
    dp, gpu_mode, alone = res["dp"], res["dp, gpu mode"], res["alone"]
    for name, res in dp.items():
        assert res["distributed"]["world_size"] == 1, name
        assert alone[name]["distributed"] is None
        _same_bits(res["state"], alone[name]["state"])
        _same_bits(gpu_mode[name]["state"], alone[name]["state"])
        assert _max_diff(res["state"], _host_state(_model())) > 0  # it trained


def test_a_block_moved_between_paged_and_resident_trains_as_one_left_in_place(two_ranks):
    """The adapter's moves under data parallel: a block paged takes its full host weights
    from the device, and one made resident again drops them (its new weights come from the
    all-gather); the run's bits are those of the run without moves, and the master stays
    the shard."""
    a, b = two_ranks[7]
    for r in (a, b):
        assert r["paged at step 1"] and not r["paged at step 2"]
        _same_bits(r["moved"], r["still"])
        assert r["host weights of the resident block"] == 0
    _same_bits(a["moved"], b["moved"])
    assert a["master bytes"] + b["master bytes"] == 4 * sum(p.numel() for p in _model().parameters())


@pytest.mark.parametrize("rank0_only", [False, True], ids=["every-rank", "rank0-only"])
def test_saved_with_two_ranks_resumes_alone_exactly(two_ranks, rank0_only):
    _, checkpoint, *_ = two_ranks
    checkpoint = _checkpoint(checkpoint, rank0_only)
    saved = torch.load(checkpoint, weights_only=False)
    res = _resume(0, 1, checkpoint)  # no process group here: the engine trains alone
    _same_bits(res["loaded"]["model"], {k: v for k, v in saved["model"].items()})
    for pid, st in saved["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(res["loaded"]["optim"]["state"][pid][key], st[key]), (pid, key)


@pytest.mark.parametrize("rank0_only", [False, True], ids=["every-rank", "rank0-only"])
def test_saved_with_two_ranks_resumes_with_three_exactly(two_ranks, three_ranks, rank0_only):
    _, checkpoint, *_ = two_ranks
    saved = torch.load(_checkpoint(checkpoint, rank0_only), weights_only=False)
    results = [r["resume"][rank0_only] for r in three_ranks]
    _same_values(results[0]["loaded"]["optim rank 0 only"], results[0]["loaded"]["optim"])  # after a load too
    assert results[1]["loaded"]["optim rank 0 only"] == results[2]["loaded"]["optim rank 0 only"] == {}
    for res in results:
        _same_bits(res["loaded"]["model"], saved["model"])
        for pid, st in saved["optim"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(res["loaded"]["optim"]["state"][pid][key], st[key]), (pid, key)
    _same_bits(results[0]["after"], results[1]["after"])
    _same_bits(results[0]["after"], results[2]["after"])
    assert _max_diff(results[0]["after"], saved["model"]) > 0  # the step trained


@pytest.mark.parametrize("case", list(GATHER_CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_rank0_only_gives_rank_0_the_whole_dict_and_the_others_nothing(request, world, case):
    """state_dict(rank0_only=True) gathers to rank 0 alone (every other rank only sends, one
    gather per moment and master): rank 0 gets the dict every rank gets from state_dict(),
    bit for bit (the fp32 masters of a bf16 model too), every other rank {}; after the switch
    to stock, with nothing to gather, the same. The run goes on after it as the run without
    it, bit for bit."""
    if world == 2:
        ranks = [r[case] for r in request.getfixturevalue("two_ranks")[8]]
    else:
        ranks = [r["rank0_only"][case] for r in request.getfixturevalue("three_ranks")]
    whole = ranks[0]["asked"]["every rank"]
    assert ranks[0]["asked"]["mode"] == ("stock" if case == "stock" else "offload")
    shapes = [tuple(p.shape) for p in _model().parameters()]
    assert [tuple(st["exp_avg"].shape) for _, st in sorted(whole["state"].items())] == shapes
    if case == "bf16 model":
        assert all(st["master"].dtype == torch.float32 for st in whole["state"].values())
    gathers = 0 if case == "stock" else len(shapes) * (3 if case == "bf16 model" else 2)
    for r, res in enumerate(ranks):
        asked, not_asked = res["asked"], res["not asked"]
        assert asked["gathers"] == [("gather", r == 0)] * gathers, f"rank {r}"
        _same_values(asked["every rank"], whole)
        if r == 0:
            _same_values(asked["rank 0 only"], whole)
        else:
            assert asked["rank 0 only"] == {}, f"rank {r}"
        _same_values(asked["after"], not_asked["after"])
    assert _max_diff(ranks[0]["asked"]["after"]["state"], _host_state(_model())) > 0  # it trained


def test_state_dict_rank0_only_training_alone_gives_the_whole_dict():
    model, opt, _ = _alone(2)
    _same_values(opt.state_dict(rank0_only=True), opt.state_dict())


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_state_dict_rank0_only_must_be_true_or_false(value):
    _, opt, _ = _alone(1)
    with pytest.raises(TypeError, match=rf"state_dict\(\): rank0_only must be True or False, got {value!r}"):
        opt.state_dict(rank0_only=value)


def test_loading_the_empty_dict_of_a_rank_other_than_0_says_which_dict_to_load():
    _, opt, _ = _alone(1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(
        ValueError,
        match=r"state_dict is empty \(\{\}\), which is what state_dict\(rank0_only=True\) returns on ranks "
        r"other than 0; load the state_dict rank 0 saved, on every rank",
    ):
        opt.load_state_dict({})
    _same_values(opt.state_dict(), before)


def test_accumulation_and_clipping_match_one_process_as_closely_as_ddp(two_ranks):
    steps, accumulation, clip = HELD_STEPS, ACCUMULATION, CLIP
    a, b = two_ranks[2]
    _same_bits(a["state"], b["state"])
    assert a["norms"] == b["norms"]
    model, _, norms = _alone(steps, accumulation, clip)
    stock, _, stock_norms = _alone(steps, accumulation, clip, wrapped=False)
    assert all(n > clip for n in norms)  # every step clipped
    # The global norm is the whole batch's, not a rank's: as close to it as DDP's is.
    ours = max(abs(x - y) for x, y in zip(a["norms"], norms))
    assert ours <= 3 * max(max(abs(x - y) for x, y in zip(stock_norms, norms)), 1e-6), ours
    ours = _max_diff(a["state"], _host_state(model))
    ddp = _max_diff(a["ddp"], _host_state(stock))
    assert ours <= 3 * max(ddp, 1e-7), (ours, ddp)


def test_a_step_that_ends_a_window_early_updates_as_one_process(two_ranks):
    """step() after 1 of 2 accumulated passes, without clipping (an epoch's last partial
    batch): every rank updates from the partial window, as one process does."""
    a, b = two_ranks[4]
    _same_bits(a["state"], b["state"])
    _, opt, _ = _as_close_as_ddp(a, PARTIAL_STEPS, accumulation=ACCUMULATION, last=1)
    assert a["step counts"] == b["step counts"] == _step_counts(opt) == [float(PARTIAL_STEPS)] * len(a["step counts"])


def test_ranks_whose_paging_differs_train_alike(two_ranks):
    """Paging is each rank's own: a rank whose paged blocks keep bf16 copies and one whose
    blocks are resident issue the same gathers (the fp32 masters; each rank rounds its own
    copies from them, as the update does) and hold the same weights."""
    a, b = two_ranks[5]
    assert a["report"]["params"]["paged_blocks"] == [0, 1, 2, 3]
    assert b["report"]["params"]["paged_blocks"] == []
    _same_bits(a["state"], b["state"])
    assert _max_diff(a["state"], _host_state(_model())) > 0  # it trained


def test_offload_auto_switches_every_rank_to_stock_training_as_ddp(two_ranks):
    """offload='auto' switches to the fused AdamW on every rank alike, and the gradients are
    averaged over the ranks from then on, as DDP averages them."""
    a, b = two_ranks[3]
    for r in (a, b):
        assert r["report"]["mode"] == "stock"
        assert "averaged over the 2 ranks" in r["report"]["events"]
    _same_bits(a["state"], b["state"])
    model, _, _ = _as_close_as_ddp(a, SWITCHED_STEPS, offload="auto")
    assert trainstream.memory_report(model)["mode"] == "stock"


# -- the averaging after the switch to stock ([Note: averaging buckets]) -------------------------

STOCK_BUCKET_BYTES = 64 * 1024  # the tiny GPT's matrices are 16 to 64 KiB in fp32: a few buckets per block
# StockGradients on its own, each parameter a bucket of its own, in this order: "one" only rank
# 0 has a gradient for (the first bucket: rank 0 launches buckets during backward, the others
# none before its end), "none" no rank has.
FLAG_PARAMS = {"one": 3, "all": 5, "all2": 2, "none": 4}


def _flat_average(group, params) -> None:
    """The reference, the averaging after the switch as it was before buckets: at the end of
    backward every gradient in one flat fp32 host tensor, divided by the world size, one
    all-reduce, and one of the flags, one per parameter (a parameter no rank had stays None)."""
    world = dist.get_world_size(group)
    present = torch.tensor([0.0 if p.grad is None else 1.0 for p in params])
    flat = torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1).float().cpu() for p in params])
    flat.div_(world)
    dist.all_reduce(flat, group=group)
    dist.all_reduce(present, group=group)
    offset = 0
    for p, some in zip(params, present.tolist()):
        part = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        if some:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(part)


@contextlib.contextmanager
def _launches_recorded(events: list):
    """Every all-reduce issued inside the block appends "launch" to `events`."""
    real = dist.all_reduce

    def all_reduce(*args, **kwargs):
        events.append("launch")
        return real(*args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = real


def _stock_buckets(rank, world, device="cpu"):
    """offload="auto" switched to stock training, buckets of STOCK_BUCKET_BYTES, 2 passes a
    step; then a step whose passes are recorded: each pass's averaged gradients beside those
    of a plain copy of the model averaged by _flat_average on the same batches, and the order
    of the buckets' launches and of block 0's gradients landing."""
    engine_dist.AVERAGING_BUCKET_BYTES = STOCK_BUCKET_BYTES
    reference_group = dist.new_group(backend="gloo")  # host tensors, whatever the default group's backend

    def loss(model, i):
        idx, tgt = _batch(i, rank, world)
        return model(idx.to(device), tgt.to(device)) / ACCUMULATION

    model = _model().to(device)
    model, opt = trainstream.wrap(
        model, _optimizer(model), device=device, threads=1, profile=False, accumulation_steps=ACCUMULATION
    )
    for step in range(SWITCHED_STEPS):
        for micro in range(ACCUMULATION):
            loss(model, step * ACCUMULATION + micro).backward()
        opt.step()
        opt.zero_grad()
    averaging = _engine_of(model)._stock_grads
    out = {"mode": trainstream.memory_report(model)["mode"], "buckets": len(averaging.buckets), "passes": []}
    out["on device"] = averaging.on_device
    plain = _model().to(device)
    plain.load_state_dict(model.state_dict())
    events = []
    for p in model.layers[0].parameters():  # registered after the averaging's own: they fire after them
        p.register_post_accumulate_grad_hook(lambda p: events.append("block 0"))
    for micro in range(ACCUMULATION):  # no zero_grad between the passes: every pass is averaged
        events.clear()
        with _launches_recorded(events):
            loss(model, SWITCHED_STEPS * ACCUMULATION + micro).backward()
        loss(plain, SWITCHED_STEPS * ACCUMULATION + micro).backward()
        _flat_average(reference_group, list(plain.parameters()))
        out["passes"].append(
            {
                "events": list(events),
                "grads": {n: p.grad.cpu().clone() for n, p in model.named_parameters()},
                "reference": {n: p.grad.cpu().clone() for n, p in plain.named_parameters()},
            }
        )
    opt.step()
    return out


def _flag_coefficients(rank, world, name, step) -> torch.Tensor:
    """Rank `rank`'s gradient of FLAG_PARAMS' `name` in pass `step`: multiples of world**2,
    so that every mean (divided by world, summed, accumulated) is exact."""
    g = torch.Generator().manual_seed(100 * step + 10 * rank + list(FLAG_PARAMS).index(name))
    return world**2 * torch.randint(-3, 4, (FLAG_PARAMS[name],), generator=g).double()


def _uses(rank, name) -> bool:
    return name in ("all", "all2") or (name == "one" and rank == 0)


def _stock_flags(rank, world):
    """StockGradients over FLAG_PARAMS, 2 accumulated passes: each pass's gradients and the
    order of the buckets' launches and of the gradients landing."""
    engine_dist.AVERAGING_BUCKET_BYTES = 4  # each parameter a bucket of its own
    params = {name: torch.nn.Parameter(torch.zeros(n)) for name, n in FLAG_PARAMS.items()}
    averaging = StockGradients(
        dist.group.WORLD, dist.group.WORLD, list(params.values()), torch.nn.ParameterDict(params)
    )
    events = []
    for p in params.values():
        p.register_post_accumulate_grad_hook(lambda p: events.append("landed"))
    out = {"buckets": len(averaging.buckets), "passes": []}
    for step in range(2):
        events.clear()
        # Backward runs the term made last first: "one" lands first on rank 0.
        used = [
            (_flag_coefficients(rank, world, n, step).float() * p).sum()
            for n, p in reversed(params.items())
            if _uses(rank, n)
        ]
        with _launches_recorded(events):
            sum(used).backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}
        out["passes"].append({"events": list(events), "grads": grads})
    averaging.remove()
    return out


def _stock_averaging(rank, world):
    return {"switched": _stock_buckets(rank, world), "flags": _stock_flags(rank, world)}


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def stock_averaging(request, tmp_path_factory):
    return _ok(_spawn(request.param, tmp_path_factory.mktemp("stock"), _stock_averaging))


def _same_as_the_flat_average(ranks: list, exact: bool, atol: float = 1e-8) -> None:
    """Every rank's gradients alike, bit for bit, and those of the flat reference: bit for bit
    if `exact`, else within rounding."""
    for p, first in enumerate(ranks[0]["passes"]):
        for res in ranks:
            mine = res["passes"][p]
            _same_bits(mine["grads"], first["grads"])
            if exact:
                _same_bits(mine["grads"], mine["reference"])
            for name, g in mine["grads"].items():
                torch.testing.assert_close(g, mine["reference"][name], rtol=1e-5, atol=atol)


def test_after_the_switch_to_stock_the_buckets_average_as_one_flat_all_reduce_did(stock_averaging):
    """After offload='auto' switched to stock under data parallel, 2 accumulated passes: each
    pass's gradients are those the averaging gave before buckets (one flat all-reduce at the end
    of backward), on every rank."""
    ranks = [r["switched"] for r in stock_averaging]
    for res in ranks:
        assert res["mode"] == "stock" and not res["on device"]
        assert res["buckets"] > 4  # several buckets, each block's matrices in more than one
        assert len(res["passes"]) == ACCUMULATION
    # Bit for bit with 2 ranks, where a sum of two is the same in any order; within rounding
    # with 3, where gloo sums an element in an order that depends on where it sits in the
    # tensor reduced, which the flat tensor and the buckets place differently.
    _same_as_the_flat_average(ranks, exact=len(ranks) == 2)
    first, second = ranks[0]["passes"]
    assert any(not torch.equal(first["grads"][n], second["grads"][n]) for n in first["grads"])  # it accumulated


def test_after_the_switch_to_stock_buckets_are_reduced_while_backward_goes_on(stock_averaging):
    """Buckets are launched as backward completes them: on every rank, in every pass, a
    bucket's all-reduce goes before the first gradient of block 0 (the last block backward
    reaches) has landed, and every bucket goes once."""
    _overlapped([r["switched"] for r in stock_averaging])


def test_after_the_switch_to_stock_a_gradient_some_rank_or_no_rank_had_averages_as_before(stock_averaging):
    """A parameter only rank 0 has a gradient for gets the mean with zeros from the others on
    every rank; one no rank has stays None; every pass is averaged (2 passes accumulated). The
    first bucket is the parameter of rank 0 alone: rank 0 launches buckets during backward,
    every other rank only at its end, and the all-reduces still pair bucket with bucket."""
    world = len(stock_averaging)
    grads = dict.fromkeys(FLAG_PARAMS)
    for step in range(2):
        for name in FLAG_PARAMS:  # the mean of every rank's gradient, absent ones as zeros (exact in float64)
            mine = [grads[name]] * world
            for r in range(world):
                if _uses(r, name):
                    c = _flag_coefficients(r, world, name, step)
                    mine[r] = c if mine[r] is None else mine[r] + c
            had = [g for g in mine if g is not None]
            grads[name] = sum(g / world for g in had) if had else None
        for r, res in enumerate(stock_averaging):
            flags = res["flags"]
            assert flags["buckets"] == len(FLAG_PARAMS)
            recorded = flags["passes"][step]
            for name, want in grads.items():
                got = recorded["grads"][name]
                if want is None:
                    assert got is None, (r, step, name)
                else:
                    assert_same_bits(got, want.float())
            events = recorded["events"]
            assert events.count("launch") == len(FLAG_PARAMS)
            last_landing = len(events) - 1 - events[::-1].index("landed")
            if r == 0:  # during backward: before its last gradient landed
                assert events.index("launch") < last_landing, (step, events)
            else:  # its first bucket's gradient never lands: everything goes at the end
                assert events.index("launch") > last_landing, (r, step, events)
    assert grads["one"] is not None and grads["none"] is None


def test_paging_bf16_moments_and_a_nan_on_one_rank(three_ranks):
    """Three ranks, every block's weights and activations paged, bf16 moments, bf16 autocast;
    rank 2's loss is NaN at step 1: every rank skips that step, and all stay identical."""
    results = [r["paged"] for r in three_ranks]
    for res in results:
        assert res["skipped"] == 1
        assert "not finite on some rank" in res["report"]["events"]
        assert res["report"]["params"]["paged_blocks"] == [0, 1, 2, 3]
    _same_bits(results[0]["state"], results[1]["state"])
    _same_bits(results[0]["state"], results[2]["state"])
    assert all(torch.isfinite(v).all() for v in results[0]["state"].values())


def _raise_in_backward(grad):
    raise RuntimeError("a backward that fails on purpose")


def _fails_in_backward(module, args, out) -> None:
    out.register_hook(_raise_in_backward)


def _changed(before: dict, after: dict) -> list:
    return sorted(k for k in after if not torch.equal(after[k], before[k]))


def _raised_pass(rank, world, failing: tuple, clip=None, accumulation=1, nan_rank=None):
    """One step; then a window whose first pass raises in backward where it reaches block 1's
    output on the ranks in `failing` (the head, the final norm and blocks 3 and 2 have their
    gradients by then: with eager updates their reductions have gone and come back on a rank
    whose backward goes on). Every rank runs the loop a training script runs: the window's
    passes until one raises, then step() and zero_grad(), each error caught and kept; then
    STEPS more steps. `nan_rank`: its loss in that window's first pass is NaN. World 1: one
    process on the whole batch."""
    model, opt = _wrapped_in_mode("cpu", {}, accumulation, clip)
    _train(model, opt, rank, world, 1, accumulation=accumulation, clip=clip)
    out = {"before": _host_state(model), "errors": []}
    for micro in range(accumulation):
        handle = model.layers[1].register_forward_hook(_fails_in_backward) if rank in failing and micro == 0 else None
        try:
            loss = model(*_batch(accumulation + micro, rank, world)) / accumulation
            if rank == nan_rank and micro == 0:
                loss = loss * float("nan")
            loss.backward()
        except RuntimeError as e:
            out["errors"].append(str(e))
            break
        finally:
            if handle is not None:
                handle.remove()
    try:
        opt.step()
    except RuntimeError as e:
        out["errors"].append(str(e))
    opt.zero_grad()
    out["after"] = _host_state(model)
    out["skipped"] = opt.skipped_steps
    _train(model, opt, rank, world, STEPS, accumulation=accumulation, clip=clip)
    out["end"] = _host_state(model)
    out["events"] = trainstream.memory_report(model)["events"]
    return out


RAISED_PASSES = {  # id -> (failing ranks, clip, accumulation, the rank whose loss is NaN)
    "eager, every rank": ((0, 1), None, 1, None),
    "eager, rank 0 alone": ((0,), None, 1, None),
    "clipped, every rank": ((0, 1), CLIP, 1, None),
    "clipped, rank 0 alone": ((0,), CLIP, 1, None),
    "accumulated, in the first pass, rank 0 alone": ((0,), None, ACCUMULATION, None),
    "eager, rank 0 alone, a NaN on rank 1": ((0,), None, 1, 1),
    "clipped, rank 0 alone, a NaN on rank 1": ((0,), CLIP, 1, 1),
}


@pytest.mark.parametrize("name", list(RAISED_PASSES))
def test_a_pass_that_raised_on_the_host_path_keeps_on_every_rank_what_one_process_keeps(tmp_path, name):
    """[Note: a pass some rank drops, host path]: a backward that raises on some ranks after
    units' reductions went. The rank that raised completes the window's reductions at its
    step(); every rank keeps the updates of the units every rank sent before the exception
    (eager: the final norm, the head and blocks 3 and 2, what one process keeps of the same
    pass; a held window, clipped or accumulated: nothing; a NaN on another rank: nothing,
    counted as a skipped step where one process counts it); every other rank raises once,
    saying why; the ranks stay alike, bit for bit, through the training after it. (At
    40416f5 the rank that raised left its reductions unsent and the others' collectives
    paired with other buckets; at 91f73f7 a raise in an accumulated window's first pass
    completed nothing, and with clipping the raising rank's step() sent a window of zeros
    that no other rank sent: from then on the ranks averaged windows one step apart; and a
    NaN on another rank in the window was not counted as a skipped step.)"""
    failing, clip, accumulation, nan_rank = RAISED_PASSES[name]
    ranks = _ok(_spawn(2, tmp_path, _raised_pass, failing, clip, accumulation, nan_rank))
    alone = _raised_pass(0, 1, (0,), clip, accumulation, None if nan_rank is None else 0)
    kept = _changed(alone["before"], alone["after"])
    # One process counts a NaN it skipped before the exception (eager); a held window is dropped uncounted.
    assert alone["skipped"] == (1 if nan_rank is not None and clip is None and accumulation == 1 else 0)
    if clip is None and accumulation == 1 and nan_rank is None:
        assert kept and all(k.startswith(("head.", "norm.", "layers.3.", "layers.2.")) for k in kept), kept
        assert any(k.startswith("layers.2.") for k in kept), kept
    else:
        assert kept == []
    for r, res in enumerate(ranks):
        assert _changed(res["before"], res["after"]) == kept
        assert res["skipped"] == alone["skipped"]  # a NaN in the window counts as one process's does
        if r in failing:
            assert res["errors"] == ["a backward that fails on purpose"]
        else:
            assert len(res["errors"]) == 1 and "the backward pass raised on another rank" in res["errors"][0], res
        assert _changed(res["after"], res["end"])  # training goes on
        assert all(torch.isfinite(v).all() for v in res["end"].values())
    assert "its reductions were completed on every rank" in ranks[0]["events"]
    _same_bits(ranks[0]["after"], ranks[1]["after"])
    _same_bits(ranks[0]["end"], ranks[1]["end"])


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    return _ok(_spawn(2, tmp_path_factory.mktemp("dpfail"), _failures, timeout_s=5))


def test_a_frozen_quantized_base_trains_alike_on_every_rank(three_ranks):
    results = [r["quantized"] for r in three_ranks]
    assert results[0]["report"]["plan"]["quantized"]["tensors"] == 16
    _same_bits(results[0]["state"], results[1]["state"])
    _same_bits(results[0]["state"], results[2]["state"])


def test_models_that_differ_are_refused_on_every_rank(failures):
    for res in failures:
        assert res["differ"] is not None and "same model on every rank" in res["differ"]


def test_options_that_differ_are_refused_on_every_rank(failures):
    for res in failures:
        for key in ("options differ", "offload differs", "moment_dtype differs"):
            assert res[key] is not None and "same options on every rank" in res[key], key


def test_nonfinite_raise_raises_on_every_rank_and_the_run_goes_on(failures):
    for res in failures:
        assert res["nonfinite raised"] is not None and "not finite on some rank" in res["nonfinite raised"]
    (before0, after0), (before1, after1) = (res["after the raise"] for res in failures)
    _same_bits(before0, before1)
    _same_bits(before0, _host_state(_model()))  # the raised window changed nothing
    _same_bits(after0, after1)
    assert _max_diff(after0, before0) > 0


def test_a_dropped_window_with_a_nan_on_one_rank_counts_alike_on_every_rank(failures):
    """zero_grad() dropping a held window: skipped or not is decided alike on every rank, as
    one process decides it from the whole batch's gradient."""
    alone = _dropped_windows(0, 1, poison_rank=0)  # no process group here: one process
    assert alone == {"accumulated": 1, "clipped": 1, "accumulated device state": False, "clipped device state": False}
    for res in failures:
        assert res["dropped"] == alone


def test_wrap_gives_its_groups_back_at_unwrap_and_when_refused(failures):
    for res in failures:
        g = res["groups"]
        assert g["after 5 unwraps"] == g["before"]
        assert "lists block 99" in g["refused"]
        assert g["after a refused wrap"] == g["before"]
        assert g["mode"] == "stock"
        assert g["in stock mode"] == g["before"] + 1  # the averaging's group only
        assert g["after unwrapping the stock run"] == g["before"]


def test_a_held_window_with_a_nan_in_one_unit_is_skipped_whole(failures):
    """Accumulation holds a window: a NaN in the unit reduced last skips all of it, as one
    process skips it, not only that unit."""
    alone = _nan_in_the_embedding(0, 1, poison_rank=0)
    initial = _host_state(_model())
    assert alone["skipped"] == 1
    _same_bits(alone["state"], initial)
    for res in failures:
        assert res["nan in the embedding"]["skipped"] == 1
        _same_bits(res["nan in the embedding"]["state"], initial)


def test_a_nan_in_a_block_skips_what_one_process_skips(failures):
    """The reduction order is backward's own from the second window on (rank 0's, adopted by
    every rank): the head and the final norm, whose gradients land before the block's, stand."""
    alone = _nan_in_the_last_block(0, 1, poison_rank=0)
    assert alone["changed"] == ["head.weight", "norm.bias", "norm.weight"], alone
    for res in failures:
        assert res["nan in the last block"] == alone


def test_a_model_already_in_ddp_is_refused(failures):
    for res in failures:
        assert "pass the module itself" in res["ddp"]  # a model already in DDP would be reduced twice


def test_unwrap_gives_the_optimizer_its_whole_moments_back(failures):
    a, b = (res["moments after unwrap"] for res in failures)
    shapes = {n: p.shape for n, p in _model().named_parameters()}
    for name, m in a.items():
        assert m.shape == shapes[name]
        assert_same_bits(m, b[name])


def test_a_rank_that_raises_stops_the_others_with_an_error(failures):
    # rank 0 returned (it did not hang: the spawn's deadline would have killed it), with the
    # error its collectives raised once the group's 5 s timeout passed.
    assert failures[0]["raised"] is not None


def test_distributed_true_needs_a_process_group():
    model = _model()
    with pytest.raises(ValueError, match="distributed=True but no torch.distributed process group"):
        trainstream.wrap(model, _optimizer(model), device="cpu", distributed=True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1, 5, 12, 13])
def test_a_units_shards_rebuild_every_gradient(world, numel):
    """[Note: shards]: packing each rank's gradients rank-major and summing the buckets gives
    every rank its elements' sum; the segments gathered rebuild each tensor."""
    lin = torch.nn.Linear(numel, 1, bias=True)

    class Slot:
        def __init__(self, p):
            self.param, self.trainable, self.dtype = p, True, p.dtype

    class Unit:
        trainable = [Slot(lin.weight), Slot(lin.bias)]

    grads = [{s: torch.randn(s.param.shape) for s in Unit.trainable} for _ in range(world)]
    layouts = [UnitShards(Unit, r, world) for r in range(world)]
    buckets = []
    for r, us in enumerate(layouts):
        bucket = torch.full((world * us.segment,), float("nan"))
        us.pack(bucket, grads[r])
        buckets.append(bucket)
    summed = torch.stack(buckets).sum(0).view(world, -1)
    for r, us in enumerate(layouts):
        us.reduced.copy_(summed[r])
        for sh in us.slots:
            want = sum(g[sh.slot] for g in grads).reshape(-1)[sh.lo : sh.hi]
            assert torch.equal(us.grad(sh), want)
    gathered = summed.reshape(-1)
    for sh in layouts[0].slots:
        out = torch.empty(sh.slot.param.shape)
        layouts[0].unpack(gathered, sh, out)
        assert torch.equal(out, sum(g[sh.slot] for g in grads))
    assert sum(sh.hi - sh.lo for us in layouts for sh in us.slots) == numel + 1  # every element once


@pytest.mark.gpu
def test_two_processes_on_one_gpu_hold_the_same_weights(tmp_path):
    """On a GPU: two ranks sharing it (gloo: the engine's reductions are host tensors)."""
    results = _ok(_spawn(2, tmp_path, _on_the_gpu))
    _same_bits(results[0]["state"], results[1]["state"])


def _on_the_gpu(rank, world):
    model = _model()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cuda", offload=True)
    for step in range(3):
        idx, tgt = _batch(step, rank, world)
        model(idx.cuda(), tgt.cuda()).backward()
        opt.step()
        opt.zero_grad()
    return {"state": _host_state(model)}


@pytest.mark.gpu
def test_two_processes_on_one_gpu_paging_differently_agree_and_halve_the_master(tmp_path):
    """On a GPU, under bf16 autocast: rank 0 pages every block, rank 1 none. The resident
    rank's new weights reach the device from the all-gather's buffer (the push), the paged
    rank's through its host weights; both hold the same bits, and half the fp32 master each."""
    results = _ok(_spawn(2, tmp_path, _on_the_gpu_paging_differently))
    assert results[0]["paged"] == [0, 1, 2, 3] and results[1]["paged"] == []
    _same_bits(results[0]["state"], results[1]["state"])
    assert _max_diff(results[0]["state"], _host_state(_model())) > 0  # it trained
    total = 4 * sum(p.numel() for p in _model().parameters())
    n_params = len(list(_model().parameters()))
    held = [r["master bytes"] for r in results]
    assert sum(held) == total
    assert all(abs(h - total / 2) <= 4 * n_params for h in held)


def _on_the_gpu_paging_differently(rank, world):
    model = _model()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cuda", offload=True, param_offload=rank == 0)
    for step in range(3):
        idx, tgt = _batch(step, rank, world)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx.cuda(), tgt.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
    report = trainstream.memory_report(model)
    return {
        "state": _host_state(model),
        "master bytes": report["host_master_bytes"],
        "paged": report["params"]["paged_blocks"],
    }


@pytest.mark.gpu
def test_two_processes_on_one_gpu_update_their_shards_with_the_kernel_as_the_host_adamw_does(tmp_path):
    """optimizer_mode="gpu" under data parallel on a GPU: the kernel updates each rank's
    shard from the reduced shard, its moments and master in pinned host memory, and gives the
    host AdamW's bits, eager with bf16 moments and held (accumulation, clipping); rank 0
    pages every block, rank 1 none."""
    results = _ok(_spawn(2, tmp_path, _on_the_gpu_in_both_modes))
    for case in GPU_MODE_CASES:
        for res in results:
            _same_bits(res[case]["gpu"]["state"], res[case]["cpu"]["state"])
            _same_values(res[case]["gpu"]["optim"], res[case]["cpu"]["optim"])
            assert res[case]["gpu"]["norms"] == res[case]["cpu"]["norms"]
            copies = res[case]["gpu"]["copies"]
            assert copies["copied"] + copies["mapped_for_want_of_room"] >= STEPS * copies["regions"] > 0
        _same_bits(results[0][case]["gpu"]["state"], results[1][case]["gpu"]["state"])
        assert _max_diff(results[0][case]["gpu"]["state"], _host_state(_model())) > 0  # it trained
    assert results[0]["paged"] == [0, 1, 2, 3] and results[1]["paged"] == []


def _on_the_gpu_in_both_modes(rank, world):
    out = {}
    for case, (options, accumulation, clip) in GPU_MODE_CASES.items():
        options = {**options, "param_offload": rank == 0}
        out[case] = {}
        for mode in ("cpu", "gpu"):
            model = _model()
            model, opt = trainstream.wrap(
                model,
                _optimizer(model),
                device="cuda",
                offload=True,
                optimizer_mode=mode,
                accumulation_steps=accumulation,
                max_grad_norm=clip,
                **options,
            )
            update_stream = _engine_of(model).backend.update
            norms = []
            for step in range(STEPS):
                for micro in range(accumulation):
                    # The update stream is held: a gather, reduction or forward that did not
                    # wait for the kernel would read the master or weights before it wrote them.
                    with torch.cuda.stream(update_stream):
                        torch.cuda._sleep(20_000_000)
                    idx, tgt = _batch(step * accumulation + micro, rank, world)
                    (model(idx.cuda(), tgt.cuda()) / accumulation).backward()
                opt.step()
                opt.zero_grad()
                norms.append(opt.last_grad_norm)
            report = trainstream.memory_report(model)
            out[case][mode] = {
                "state": _host_state(model),
                "optim": copy.deepcopy(opt.state_dict()),
                "norms": norms,
                "copies": report["plan"]["moment_copies"],
            }
            out["paged"] = report["params"]["paged_blocks"]
    return out


def test_the_buckets_go_on_the_device_where_the_group_reduces_cuda_tensors_with_nccl(monkeypatch):
    """After the switch to stock, the averaging reduces on the device only for CUDA gradients
    with a group whose CUDA backend is NCCL; the fp32 buckets it then holds there are counted
    in the memory the switch needs, and nothing where they are host copies."""
    configs = {"nccl": "cuda:nccl", "mixed": "cpu:gloo,cuda:nccl", "gloo": "cpu:gloo,cuda:gloo"}
    monkeypatch.setattr(dist, "get_backend_config", lambda group: configs[group])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert engine_dist.reduces_on_device("nccl", cuda) and engine_dist.reduces_on_device("mixed", cuda)
    assert not engine_dist.reduces_on_device("gloo", cuda) and not engine_dist.reduces_on_device("mixed", cpu)
    model, _, _ = _alone(1)
    engine = _engine_of(model)
    elements = sum(p.numel() for p in _model().parameters())
    ranks = type("Ranks", (), {"user": "mixed"})
    assert engine_dist.stock_averaging_bytes(ranks, cuda, engine.units) == 4 * elements
    assert engine_dist.stock_averaging_bytes(ranks, cpu, engine.units) == 0
    assert engine_dist.stock_averaging_bytes(None, cuda, engine.units) == 0
    alone = stock_bytes(engine.units, engine.meter, 0)
    assert stock_bytes(engine.units, engine.meter, 0, 4 * elements) == {
        **alone,
        "gradient buckets (data parallel)": 4 * elements,
    }


def _overlapped(ranks: list) -> None:
    """_stock_buckets' passes launched every bucket, the first before block 0's gradients."""
    for r, res in enumerate(ranks):
        for p, recorded in enumerate(res["passes"]):
            events = recorded["events"]
            assert events.count("launch") == res["buckets"] > 4, (r, p)
            assert events.index("launch") < events.index("block 0"), (r, p, events)


@pytest.mark.gpu
def test_two_processes_on_one_gpu_average_in_buckets_after_the_switch_to_stock(tmp_path):
    """On a GPU, gloo the default group: after the switch to stock the buckets are host copies
    of the device's gradients, launched during backward; every rank's averaged gradients are
    alike, and those of the flat reference within rounding (the model's own backward on a GPU
    need not repeat bit for bit: the reference's runs apart)."""
    ranks = _ok(_spawn(2, tmp_path, _stock_buckets, "cuda"))
    for res in ranks:
        assert res["mode"] == "stock" and not res["on device"]
    _same_as_the_flat_average(ranks, exact=False, atol=1e-6)
    _overlapped(ranks)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL takes one per rank)")
def test_two_gpus_over_nccl_average_in_buckets_on_the_device_after_the_switch_to_stock(tmp_path):
    """NCCL the default group, a GPU per rank: after the switch to stock the buckets are
    reduced on the device, launched during backward; every rank's averaged gradients are
    alike, and those of the flat reference (host copies over gloo) within rounding."""
    ranks = _ok(_spawn(2, tmp_path, _stock_buckets, "cuda", backend="nccl"))
    for res in ranks:
        assert res["mode"] == "stock" and res["on device"]
    _same_as_the_flat_average(ranks, exact=False, atol=1e-6)
    _overlapped(ranks)


def test_the_ranks_of_a_machine_share_its_pinnable_memory(monkeypatch):
    from trainstream.engine.placement import pinned_share
    from trainstream.planner import conservative_profile

    profile = conservative_profile(torch.device("cpu"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert pinned_share(profile) == profile.pinned_limit_bytes // 4
    # RLIMIT_MEMLOCK binds each process on its own.
    limited = dataclasses.replace(
        profile, pinned_bound_by="RLIMIT_MEMLOCK (ulimit -l): a pinned allocation above it failed"
    )
    assert pinned_share(limited) == profile.pinned_limit_bytes


@pytest.mark.parametrize(
    "handed, want",
    [
        (["head", "norm", "b3", "b1", "b0", "emb"], ["head", "norm", "b3", "b2", "b1", "b0", "emb"]),  # b2 unused
        (["b2", "b1", "b0"], ["b3", "b2", "b1", "b0", "head", "norm", "emb"]),  # the leader and the tail unused
        ([], ["b3", "b2", "b1", "b0", "head", "norm", "emb"]),
    ],
    ids=["a-block-unused", "leader-and-tail-unused", "none-handed"],
)
def test_a_unit_unused_in_the_learned_window_keeps_its_place(handed, want):
    """The reduction order learned from rank 0's first window: a unit it did not hand on then
    goes where the fixed order had it (after the unit it followed), not after the embedding."""
    assert order_with_unseen(handed, ["b3", "b2", "b1", "b0", "head", "norm", "emb"]) == want
