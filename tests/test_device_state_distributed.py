"""Device state under data parallel (engine/device_state.py, distributed.BucketAverage): every
rank keeps the whole state of a small trainable set (a LoRA's adapters), replicated, and its
gradients are averaged over the ranks, in buckets, at the window's last backward pass, so that
every rank applies the same update to the same mean gradient. Two and three CPU processes over
gloo, spawned by test_distributed.py's harness, with its references: one process training on
the whole batch, and torch's DDP on the same batches in the same processes (the engine within
three times DDP's own distance from that one process)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from engine.test_device_state import LoraMLP
from test_distributed import (
    ACCUMULATION,
    CLIP,
    HELD_STEPS,
    PARTIAL_STEPS,
    STEPS,
    SWITCHED_STEPS,
    _alone,
    _as_close_as_ddp,
    _batch,
    _checkpoint,
    _dropped_windows,
    _host_state,
    _launches_recorded,
    _max_diff,
    _ok,
    _optimizer,
    _resume,
    _same_bits,
    _same_values,
    _spawn,
    _step_counts,
    _train,
    _wrapped_and_ddp,
)
from torch import nn

import trainstream
from trainstream.engine import distributed as engine_dist
from trainstream.engine import placement

NAN = float("nan")
LORA_BUCKET_BYTES = 1024  # two of a block's four adapter tensors (512 B each in fp32) per bucket


class LoraLM(nn.Module):
    """A frozen embedding and head around LoraMLP's blocks (frozen Linears, each with two small
    trainable low-rank factors), fed and scored as tiny_gpt: 2,048 of 47,232 parameters train,
    a share that takes device state."""

    def __init__(self, vocab: int = 97, dim: int = 64, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = LoraMLP(dim, layers).layers
        self.head = nn.Linear(dim, vocab, bias=False)
        self.emb.weight.requires_grad_(False)
        self.head.weight.requires_grad_(False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for block in self.layers:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def _lora():
    torch.manual_seed(0)
    return LoraLM()


def _wrapped_lora(**options):
    """A fresh LoRA wrapped on the CPU path (offload=True: the engine throughout), with `options`."""
    model = _lora()
    return trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True, **options)


def _adapters() -> list:
    return [n for n, p in _lora().named_parameters() if p.requires_grad]


def _took_device_state(report: dict, world: int) -> None:
    """The run trained its adapters in device state, replicated over `world` ranks."""
    events = report["events"]
    assert "device state: the 16 trainable tensors" in events, events
    assert f"on each of the {world} ranks: replicated" in events
    assert f"averaged over the {world} ranks before the update" in events
    assert report["plan"]["device_state"]["replicas"] == world


# -- what the ranks run -----------------------------------------------------------------------


def _launches_per_pass(rank, world):
    """Two accumulated passes, buckets of LORA_BUCKET_BYTES: in each pass, the order of the
    all-reduces launched and of block 0's adapter gradients landing; then the step."""
    engine_dist.AVERAGING_BUCKET_BYTES = LORA_BUCKET_BYTES
    model, opt = _wrapped_lora(accumulation_steps=2)
    events = []
    for p in model.layers[0].parameters():  # registered after the engine's own: they fire after them
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: events.append("block 0"))
    passes = []
    for micro in range(2):
        events.clear()
        with _launches_recorded(events):
            (model(*_batch(micro, rank, world)) / 2).backward()
        passes.append(list(events))
    opt.step()
    opt.zero_grad()
    return {
        "passes": passes,
        "state": _host_state(model),
        "report": trainstream.memory_report(model),
    }


def _poisoned(rank, world, poison_rank, how, accumulation=1, **options):
    """Three steps; in step 1 `poison_rank` makes its loss NaN (`how` "loss", in its first
    pass) or the gradient of block 2's adapters ("block 2"). The weights before each step and
    after the last, optimizer.skipped_steps, the message a raise gave, the norms, the events."""
    model, opt = _wrapped_lora(accumulation_steps=accumulation, **options)
    poisoned = rank == poison_rank
    out = {"states": [], "raised": None, "norms": []}
    for step in range(3):
        out["states"].append(_host_state(model))
        hooks = []
        if step == 1 and poisoned and how == "block 2":
            hooks = [p.register_hook(lambda g: g * NAN) for p in model.layers[2].parameters() if p.requires_grad]
        try:
            for micro in range(accumulation):
                loss = model(*_batch(step * accumulation + micro, rank, world)) / accumulation
                if step == 1 and poisoned and how == "loss" and micro == 0:
                    loss = loss * NAN
                loss.backward()
            opt.step()
        except FloatingPointError as e:
            out["raised"] = str(e)
        opt.zero_grad()
        out["norms"].append(opt.last_grad_norm)
        for h in hooks:
            h.remove()
    out["states"].append(_host_state(model))
    out["skipped"] = opt.skipped_steps
    out["report"] = trainstream.memory_report(model)
    return out


POISONED = {  # name: (how, accumulation, wrap() options)
    "eager": ("loss", 1, {}),
    "one block": ("block 2", 1, {}),
    "accumulated": ("loss", 2, {}),
    "clipped": ("loss", 1, {"max_grad_norm": CLIP}),
    "raise": ("loss", 1, {"nonfinite": "raise"}),
    "raise accumulated": ("loss", 2, {"nonfinite": "raise"}),
}


def _other_adapters(rank, world):
    """Rank 1 draws its adapters again (another seed) before wrap(): rank 0's are taken."""
    model = _lora()
    if rank == 1:
        torch.manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.normal_()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
    _train(model, opt, rank, world, STEPS)
    return {"state": _host_state(model), "report": trainstream.memory_report(model)}


def _plans_that_differ(rank, world):
    """Rank 1 alone would keep the host path (its planner refuses device state): the ranks
    agree on the host path, and train alike."""
    share = placement.DEVICE_STATE_MAX_SHARE
    if rank == 1:
        placement.DEVICE_STATE_MAX_SHARE = 0.0
    try:
        model, opt = _wrapped_lora()
    finally:
        placement.DEVICE_STATE_MAX_SHARE = share  # the runs after it plan as before
    _train(model, opt, rank, world, 2)
    return {"state": _host_state(model), "report": trainstream.memory_report(model)}


def _saved_rank_zero_only(rank, world, checkpoint):
    """STEPS steps, then optimizer.state_dict() on every rank and state_dict(rank0_only=True);
    rank 0 saves the model and the second at `checkpoint`."""
    model, opt = _wrapped_lora()
    _train(model, opt, rank, world, STEPS)
    every = opt.state_dict()
    rank0 = opt.state_dict(rank0_only=True)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": rank0}, checkpoint)
    return {"every rank": every, "rank 0 only": rank0, "report": trainstream.memory_report(model)}


def _halved(grad):
    return grad / 2


def _first_row_zeroed(p) -> None:
    p.grad[0].zero_()


def _user_hooks(model):
    """A user's hooks on every adapter tensor: one that halves the incoming gradient, and a
    post-accumulate-grad hook that zeroes p.grad's first row. Both commute with averaging, so
    one process's run is the reference. Returns the model."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_halved)
            p.register_post_accumulate_grad_hook(_first_row_zeroed)
    return model


def _hooked_lora():
    return _user_hooks(_lora())


def _hooks_after_wrap(rank, world):
    """The user's hooks registered after wrap(), so after the engine's own on the same tensors;
    then the same hooks on a DDP model (before DDP: it hooks the AccumulateGrad nodes, which run
    after every tensor hook whenever registered)."""
    engine_dist.AVERAGING_BUCKET_BYTES = LORA_BUCKET_BYTES  # buckets go during backward
    model, opt = _wrapped_lora()
    _user_hooks(model)
    _train(model, opt, rank, world, STEPS)
    ddp = torch.nn.parallel.DistributedDataParallel(_hooked_lora())
    ddp_opt = _optimizer(ddp)
    _train(ddp, ddp_opt, rank, world, STEPS, stock=True)
    ddp_state = {k.removeprefix("module."): v for k, v in _host_state(ddp).items()}
    return {"state": _host_state(model), "ddp": ddp_state, "report": trainstream.memory_report(model)}


def _raise_in_backward(grad):
    raise RuntimeError("a backward that fails on purpose")


def _fails_in_backward(module, args, out) -> None:
    out.register_hook(_raise_in_backward)


def _a_backward_raises(rank, world):
    """STEPS steps; before step 1's, a pass over the same batch whose backward raises on every
    rank between block 1 and block 2 (blocks 3 and 2 have their gradients, buckets have gone),
    then zero_grad(). Buckets of LORA_BUCKET_BYTES, so that some go before the failure."""
    engine_dist.AVERAGING_BUCKET_BYTES = LORA_BUCKET_BYTES
    model, opt = _wrapped_lora()
    out = {}
    for step in range(STEPS):
        if step == 1:
            handle = model.layers[1].register_forward_hook(_fails_in_backward)
            try:
                model(*_batch(step, rank, world)).backward()
            except RuntimeError as e:
                out["failed pass"] = str(e)
            handle.remove()
            opt.zero_grad()
        model(*_batch(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    ddp = torch.nn.parallel.DistributedDataParallel(_lora())
    ddp_opt = _optimizer(ddp)
    _train(ddp, ddp_opt, rank, world, STEPS, stock=True)
    ddp_state = {k.removeprefix("module."): v for k, v in _host_state(ddp).items()}
    return {**out, "state": _host_state(model), "ddp": ddp_state, "report": trainstream.memory_report(model)}


class _LoraSkipping(LoraLM):
    """LoraLM whose last block (backward's first) `skip` leaves out: with it on one rank, the
    other sends that block's buckets during backward while this one holds them to the end."""

    skip = False

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for i, block in enumerate(self.layers):
            if not (self.skip and i == len(self.layers) - 1):
                x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def _raised_after_uneven_launches(rank, world, failing: tuple):
    """Rank 1 skips the last block; one pass whose backward raises on the ranks in `failing`
    (the others' backward raises too: the pass is dropped everywhere), zero_grad(), training
    on; and the same run without that pass."""
    engine_dist.AVERAGING_BUCKET_BYTES = LORA_BUCKET_BYTES
    out = {}
    for name, fails in (("failed", True), ("control", False)):
        torch.manual_seed(0)
        model = _LoraSkipping()
        model.skip = rank == 1
        model, opt = trainstream.wrap(model, _optimizer(model), device="cpu", threads=1, profile=False, offload=True)
        _train(model, opt, rank, world, 1)
        if fails:
            handle = model.layers[1].register_forward_hook(_fails_in_backward) if rank in failing else None
            try:
                model(*_batch(1, rank, world)).backward()
            except RuntimeError as e:
                out["failed pass"] = str(e)
            if handle is not None:
                handle.remove()
            opt.zero_grad()
        _train(model, opt, rank, world, STEPS)
        out[name] = _host_state(model)
    out["report"] = trainstream.memory_report(model)
    return out


def _two_lora_runs(rank, world, checkpoint):
    return {
        "eager": _wrapped_and_ddp(rank, world, STEPS, {"offload": True}, 1, None, checkpoint, make=_lora),
        "held": _wrapped_and_ddp(rank, world, HELD_STEPS, {"offload": True}, ACCUMULATION, CLIP, None, make=_lora),
        "partial": _wrapped_and_ddp(
            rank, world, PARTIAL_STEPS, {"offload": True}, ACCUMULATION, None, None, last=1, make=_lora
        ),
        "switched": _wrapped_and_ddp(rank, world, SWITCHED_STEPS, {}, 1, None, None, make=_lora),
        "rank0_only": _saved_rank_zero_only(rank, world, _checkpoint(checkpoint, rank0_only=True)),
        "launches": _launches_per_pass(rank, world),
        "poisoned": {name: _poisoned(rank, world, 1, how, acc, **o) for name, (how, acc, o) in POISONED.items()},
        "dropped": _dropped_windows(rank, world, poison_rank=1, make=_lora),
        "plans differ": _plans_that_differ(rank, world),
        "other adapters": _other_adapters(rank, world),
        "user hooks": _hooks_after_wrap(rank, world),
        "raised": _a_backward_raises(rank, world),
    }


def _three_lora_runs(rank, world, checkpoint):
    return {
        "resume": {
            gathered: _resume(rank, world, _checkpoint(checkpoint, gathered), _lora) for gathered in (False, True)
        },
        "eager": _wrapped_and_ddp(rank, world, STEPS, {"offload": True}, 1, None, None, make=_lora),
        "launches": _launches_per_pass(rank, world),
    }


@pytest.fixture(scope="module")
def lora_two_ranks(tmp_path_factory):
    """Two ranks train the LoRA every way _two_lora_runs lists; rank 0 saves the eager run's
    checkpoint (the optimizer's state from every rank) and a second one (rank 0's alone)."""
    root = tmp_path_factory.mktemp("ds2")
    checkpoint = str(root / "ckpt.pt")
    return checkpoint, _ok(_spawn(2, root, _two_lora_runs, checkpoint))


@pytest.fixture(scope="module")
def lora_three_ranks(lora_two_ranks, tmp_path_factory):
    checkpoint, _ = lora_two_ranks
    return _ok(_spawn(3, tmp_path_factory.mktemp("ds3"), _three_lora_runs, checkpoint))


def _runs(ranks: list, name: str) -> list:
    return [r[name] for r in ranks]


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
def test_a_lora_takes_device_state_and_every_rank_holds_the_same_adapters(request, world):
    fixture = "lora_two_ranks" if world == 2 else "lora_three_ranks"
    ranks = request.getfixturevalue(fixture)
    ranks = ranks[1] if world == 2 else ranks
    runs = _runs(ranks, "eager")
    for r in runs:
        _took_device_state(r["report"], world)
    for r in runs[1:]:
        _same_bits(runs[0]["state"], r["state"])
    assert _max_diff(runs[0]["state"], _host_state(_lora())) > 0  # it trained


@pytest.mark.parametrize("world", [2, 3])
def test_a_lora_matches_one_process_as_closely_as_ddp(request, world):
    ranks = request.getfixturevalue("lora_two_ranks")[1] if world == 2 else request.getfixturevalue("lora_three_ranks")
    run = _runs(ranks, "eager")[0]
    _took_device_state(run["report"], world)
    _as_close_as_ddp(run, STEPS, make=_lora)


def test_every_rank_starts_from_rank_zeros_adapters(lora_two_ranks):
    """Rank 1 drew other adapters: wrap() gives every rank rank 0's, as DDP broadcasts them when
    it wraps a model, and the run is the one whose ranks started alike, bit for bit."""
    _, ranks = lora_two_ranks
    for r in ranks:
        _took_device_state(r["other adapters"]["report"], 2)
        _same_bits(r["other adapters"]["state"], ranks[0]["eager"]["state"])


def test_the_memory_report_says_the_device_state_is_replicated(lora_two_ranks):
    """Each rank holds the whole device state (the bytes one process holds) and counts the
    fp32 buckets its gradients are averaged in; what it sends per step is those buckets."""
    _, ranks = lora_two_ranks
    model, _, _ = _alone(1, make=_lora)
    alone = trainstream.memory_report(model)
    n = sum(p.numel() for p in _lora().parameters() if p.requires_grad)
    for r in _runs(ranks, "eager"):
        report = r["report"]
        ds = report["plan"]["device_state"]
        assert ds["replicas"] == 2 and ds["parameters"] == n
        assert ds["device_bytes"] == alone["plan"]["device_state"]["device_bytes"]
        device = placement.DEVICE_STATE_CLASS
        assert report["plan"]["budget"]["device"][device] == alone["plan"]["budget"]["device"][device] + 4 * n
        assert report["distributed"]["device_state_elements"] == n
        assert report["distributed"]["trainable_elements"] == 0  # nothing sharded
        # On the CPU path the device is host memory: the whole moments, as one process holds them.
        assert report["host_moment_bytes"] == alone["host_moment_bytes"] == 2 * 4 * n
        # The gradients, a flag each, its one bucket's late flag ([Note: late gradients]) and the
        # flag saying a rank dropped the pass ([Note: a pass some rank drops]).
        assert report["distributed"]["bytes_communicated_per_step"] == 4 * (n + 16 + 1 + 1)
    assert alone["plan"]["device_state"]["replicas"] == 1


@pytest.mark.parametrize("world", [2, 3])
def test_accumulation_communicates_only_in_the_windows_last_pass(request, world):
    """Two accumulated passes: the first launches no all-reduce (the sums stay on each rank);
    the last launches every bucket once, the first of them before block 0's gradients land
    (during backward, not after it)."""
    ranks = request.getfixturevalue("lora_two_ranks")[1] if world == 2 else request.getfixturevalue("lora_three_ranks")
    runs = _runs(ranks, "launches")
    for r, res in enumerate(runs):
        _took_device_state(res["report"], world)
        first, last = res["passes"]
        assert "launch" not in first and "block 0" in first, (r, first)
        assert last.count("launch") == 8, (r, last)  # 16 adapter tensors, two per bucket
        assert last.index("launch") < last.index("block 0"), (r, last)
        _same_bits(runs[0]["state"], res["state"])


def test_accumulation_and_clipping_match_one_process_and_the_norm_is_the_whole_batchs(lora_two_ranks):
    """The clipping norm counts the averaged device-state gradients once (they are the same on
    every rank, not shards to sum): it is one process's norm of the whole batch, within
    rounding, and every step clipped."""
    _, ranks = lora_two_ranks
    a, b = _runs(ranks, "held")
    _took_device_state(a["report"], 2)
    _same_bits(a["state"], b["state"])
    assert a["norms"] == b["norms"]
    _, _, norms = _as_close_as_ddp(a, HELD_STEPS, accumulation=ACCUMULATION, clip=CLIP, make=_lora)
    assert all(n > CLIP for n in norms)
    for ours, alone in zip(a["norms"], norms):
        assert math.isclose(ours, alone, rel_tol=1e-5), (ours, alone)


def test_a_step_that_ends_a_window_early_averages_it_there(lora_two_ranks):
    """step() after 1 of 2 accumulated passes: the partial window is averaged at step() and
    applied, as one process applies it."""
    _, ranks = lora_two_ranks
    a, b = _runs(ranks, "partial")
    _took_device_state(a["report"], 2)
    _same_bits(a["state"], b["state"])
    _, opt, _ = _as_close_as_ddp(a, PARTIAL_STEPS, accumulation=ACCUMULATION, last=1, make=_lora)
    assert a["step counts"] == b["step counts"] == _step_counts(opt) == [float(PARTIAL_STEPS)] * 16


def test_a_users_hooks_registered_after_wrap_change_the_gradients_averaged_as_under_ddp(lora_two_ranks):
    """A user's tensor hook and post-accumulate-grad hook on every adapter, registered after
    wrap(): the gradients averaged are those the hooks leave, as under DDP, every bucket alike
    (2221cbc averaged from the engine's own post-accumulate-grad hook: a bucket that went
    early had the gradient of the parameter that completed it before the user's hook ran)."""
    a, b = _runs(lora_two_ranks[1], "user hooks")
    _took_device_state(a["report"], 2)
    _same_bits(a["state"], b["state"])
    _as_close_as_ddp(a, STEPS, make=_hooked_lora)


def test_a_backward_that_raised_on_every_rank_leaves_nothing_and_training_goes_on_as_ddp(lora_two_ranks):
    """A backward pass that raised on every rank after some buckets had gone, then zero_grad():
    nothing of it is averaged or applied, and the next passes average as before: every rank
    the same bits, as close to one process (without the failed pass) as DDP."""
    a, b = _runs(lora_two_ranks[1], "raised")
    assert a["failed pass"] == b["failed pass"] == "a backward that fails on purpose"
    _took_device_state(a["report"], 2)
    _same_bits(a["state"], b["state"])
    _as_close_as_ddp(a, STEPS, make=_lora)


@pytest.mark.parametrize("failing", [(0, 1), (0,)], ids=["every rank", "rank 0 alone"])
def test_a_pass_that_raised_after_uneven_launches_is_dropped_on_every_rank(tmp_path, failing):
    """Rank 1 skips the last block, so rank 0 sends that block's buckets during backward while
    rank 1 holds them. A backward that raises then (on every rank, or on rank 0 alone) is
    dropped on every rank, and afterwards every rank holds, bit for bit, what the same run
    without that pass holds (e571c05: the ranks' all-reduces paired with other buckets from
    then on, and gloo aborted)."""
    ranks = _ok(_spawn(2, tmp_path, _raised_after_uneven_launches, failing))
    _took_device_state(ranks[0]["report"], 2)
    assert ranks[0]["failed pass"] == "a backward that fails on purpose"
    if failing == (0,):
        assert "raised on another rank" in ranks[1]["failed pass"], ranks[1]["failed pass"]
    for r in ranks:
        _same_bits(r["failed"], r["control"])
    _same_bits(ranks[0]["failed"], ranks[1]["failed"])


def test_offload_auto_switches_device_state_to_stock_averaged_as_ddp(lora_two_ranks):
    """offload='auto' switches a device-state run to the fused AdamW on every rank; the
    adapters' gradients are averaged over the ranks from then on (they are all the trainable
    parameters there are), as DDP averages them."""
    _, ranks = lora_two_ranks
    a, b = _runs(ranks, "switched")
    for r in (a, b):
        _took_device_state(r["report"], 2)
        assert r["report"]["mode"] == "stock"
        assert "before the fused AdamW steps, as DDP does: in 1 buckets" in r["report"]["events"]
    _same_bits(a["state"], b["state"])
    model, _, _ = _as_close_as_ddp(a, SWITCHED_STEPS, offload="auto", make=_lora)
    assert trainstream.memory_report(model)["mode"] == "stock"


def _changed(before: dict, after: dict) -> list:
    return sorted(k for k in after if not torch.equal(after[k], before[k]))


@pytest.mark.parametrize("name", [n for n in POISONED if not n.startswith("raise")])
def test_a_nan_on_one_rank_skips_on_every_rank_what_one_process_skips(lora_two_ranks, name):
    """A gradient that is not finite on rank 1 alone: the mean carries it to every rank, which
    skips alike: the step counts as skipped everywhere, and what changed in it is what one
    process on the whole batch changes (nothing, or with eager updates and a NaN in block 2,
    block 3's adapters, whose gradients backward made before block 2's)."""
    _, ranks = lora_two_ranks
    a, b = (r["poisoned"][name] for r in ranks)
    how, accumulation, options = POISONED[name]
    alone = _poisoned(0, 1, 0, how, accumulation, **options)
    _took_device_state(a["report"], 2)
    for r in (a, b):
        assert r["skipped"] == alone["skipped"] == 1
        assert "not finite" in r["report"]["events"]
        for before, after in zip(r["states"], b["states"]):
            _same_bits(before, after)  # the two ranks alike before and after each step
        assert _changed(r["states"][1], r["states"][2]) == _changed(alone["states"][1], alone["states"][2])
        assert all(torch.isfinite(v).all() for v in r["states"][3].values())
    if name == "one block":
        assert _changed(a["states"][1], a["states"][2]) == [n for n in _adapters() if n.startswith("layers.3.")]
    else:
        assert _changed(a["states"][1], a["states"][2]) == []
    assert _changed(a["states"][2], a["states"][3])  # the next step trains


@pytest.mark.parametrize("name", [n for n in POISONED if n.startswith("raise")])
def test_nonfinite_raise_names_the_same_parameter_on_every_rank(lora_two_ranks, name):
    """nonfinite='raise' with a NaN on rank 1 alone: every rank raises, after the window's
    gradients were averaged, naming the parameter one process names; the run goes on alike."""
    _, ranks = lora_two_ranks
    a, b = (r["poisoned"][name] for r in ranks)
    how, accumulation, options = POISONED[name]
    alone = _poisoned(0, 1, 0, how, accumulation, **options)
    _took_device_state(a["report"], 2)
    assert alone["raised"] is not None and "is not finite (wrap(nonfinite='raise'))" in alone["raised"]
    assert a["raised"] == b["raised"] == alone["raised"]
    for before, after in zip(a["states"], b["states"]):
        _same_bits(before, after)
    _same_bits(a["states"][1], a["states"][2])  # the raised window changed nothing
    assert _changed(a["states"][2], a["states"][3])


def test_a_dropped_window_with_a_nan_on_one_rank_counts_alike(lora_two_ranks):
    """zero_grad() drops a held window (accumulation, clipping) whose gradient is NaN on rank 1
    alone: every rank counts it as skipped, as one process counts it."""
    _, ranks = lora_two_ranks
    alone = _dropped_windows(0, 1, poison_rank=0, make=_lora)
    assert alone == {"accumulated": 1, "clipped": 1, "accumulated device state": True, "clipped device state": True}
    for res in _runs(ranks, "dropped"):
        assert res == alone


def test_a_plan_not_every_rank_takes_keeps_the_host_path_on_every_rank(lora_two_ranks):
    """Device state decides which collectives a window issues: where one rank's plan would not
    take it, no rank does (the events say why), and the ranks train alike on the host path."""
    _, ranks = lora_two_ranks
    a, b = _runs(ranks, "plans differ")
    for r in (a, b):
        assert (
            "device state: not used, the trainable set keeps the host path: not every rank's plan took it"
            in (r["report"]["events"])
        )
        assert r["report"]["plan"]["device_state"] is None
    _same_bits(a["state"], b["state"])
    assert _max_diff(a["state"], _host_state(_lora())) > 0


def test_state_dict_holds_whole_moments_and_rank0_only_gives_the_others_nothing(lora_two_ranks):
    """The device-state moments are whole on every rank (replicated): state_dict() is torch's
    format without a collective, the same on every rank, and rank0_only=True gives rank 0 that
    dict and the other ranks {}."""
    _, ranks = lora_two_ranks
    a, b = _runs(ranks, "rank0_only")
    _took_device_state(a["report"], 2)
    shapes = [tuple(p.shape) for p in _lora().parameters() if p.requires_grad]
    whole = a["every rank"]
    assert [tuple(st["exp_avg"].shape) for _, st in sorted(whole["state"].items())] == shapes
    assert all(float(st["step"]) == STEPS for st in whole["state"].values())
    _same_values(b["every rank"], whole)
    _same_values(a["rank 0 only"], whole)
    assert b["rank 0 only"] == {}
    torch.optim.AdamW(_lora().parameters()).load_state_dict(whole)  # torch's format


@pytest.mark.parametrize("rank0_only", [False, True], ids=["every-rank", "rank0-only"])
def test_saved_with_two_ranks_resumes_alone_exactly(lora_two_ranks, rank0_only):
    checkpoint, ranks = lora_two_ranks
    _took_device_state(ranks[0]["eager"]["report"], 2)
    checkpoint = _checkpoint(checkpoint, rank0_only)
    saved = torch.load(checkpoint, weights_only=False)
    res = _resume(0, 1, checkpoint, _lora)  # no process group here: the engine trains alone
    assert "device state: the 16 trainable tensors" in res["report"]["events"]
    _same_bits(res["loaded"]["model"], saved["model"])
    _same_values(res["loaded"]["optim"]["state"], saved["optim"]["state"])


@pytest.mark.parametrize("rank0_only", [False, True], ids=["every-rank", "rank0-only"])
def test_saved_with_two_ranks_resumes_with_three_exactly(lora_two_ranks, lora_three_ranks, rank0_only):
    checkpoint, _ = lora_two_ranks
    saved = torch.load(_checkpoint(checkpoint, rank0_only), weights_only=False)
    results = [r["resume"][rank0_only] for r in lora_three_ranks]
    for res in results:
        _took_device_state(res["report"], 3)
        _same_bits(res["loaded"]["model"], saved["model"])
        _same_values(res["loaded"]["optim"]["state"], saved["optim"]["state"])
    _same_values(results[0]["loaded"]["optim rank 0 only"], results[0]["loaded"]["optim"])
    assert results[1]["loaded"]["optim rank 0 only"] == results[2]["loaded"]["optim rank 0 only"] == {}
    _same_bits(results[0]["after"], results[1]["after"])
    _same_bits(results[0]["after"], results[2]["after"])
    assert _max_diff(results[0]["after"], saved["model"]) > 0  # the step trained


@pytest.mark.gpu
def test_two_processes_on_one_gpu_average_device_state_and_hold_the_same_adapters(tmp_path):
    """On a GPU, gloo the default group: the adapters' state stays on the device on both ranks,
    their gradients go to the host to be averaged and come back; both ranks hold the same bits."""
    results = _ok(_spawn(2, tmp_path, _lora_on_the_gpu))
    for r in results:
        _took_device_state(r["report"], 2)
        assert "over gloo from host copies" in r["report"]["events"]
        assert r["report"]["plan"]["device_state"]["device_bytes"] > 0
    _same_bits(results[0]["state"], results[1]["state"])
    assert _max_diff(results[0]["state"], _host_state(_lora())) > 0


def _lora_on_the_gpu(rank, world):
    model = _lora()
    model, opt = trainstream.wrap(model, _optimizer(model), device="cuda", offload=True, accumulation_steps=2)
    for step in range(3):
        for micro in range(2):
            idx, tgt = _batch(2 * step + micro, rank, world)
            (model(idx.cuda(), tgt.cuda()) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {"state": _host_state(model), "report": trainstream.memory_report(model)}
