"""Data parallel after offload="auto" switched to stock training: the gradients' averaging
(engine/distributed.py, StockGradients: a post-accumulate-grad hook per parameter, buckets
launched in index order, the end of the pass queued as autograd's final callback) where a
backward pass is not the plain one it counts on. Four faults found in review of 82bfc56:

- a parameter used by two reentrant checkpoint segments gets two gradients in one pass (its
  hook fires twice), which 82bfc56 counted as two parameters landing;
- a user's post-accumulate-grad hook registered after the switch runs after the averaging's
  own, so the bucket it completes was copied before the user's hook changed the gradient;
- a backward pass that raises never runs its final callback, and 82bfc56 then never queued
  one again: no later pass was averaged;
- with no trainable parameter outside reentrant checkpoint segments, the first gradient lands
  inside a segment's inner backward, whose end ran the final callback: one averaging per
  segment.

Each test: 2 CPU ranks over gloo, spawned with tests/test_distributed.py's launcher; a tiny
model wrapped with offload="auto" trains SWITCH_STEPS steps, after which the engine has
switched to stock training (memory_report's "mode", checked), then the case. The references,
as test_distributed's: torch's DDP on the same batches in the same processes, and one process
training on the whole batch, wrapped alike (distributed=False) and plain torch; the engine must
be within three times DDP's own distance from one process, and every rank must hold the same
bits."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import bits
from test_distributed import _host_state, _launches_recorded, _max_diff, _ok, _spawn
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainstream
from trainstream.engine import distributed as engine_dist

IN, DIM, OUT = 8, 16, 4
GLOBAL_ROWS = 8  # rows per step, split evenly over the ranks
LR = 1e-2
SWITCH_STEPS = 2  # offload="auto" switches to stock training after 2 measured steps
STEPS = 6  # in all: SWITCH_STEPS, then 4 in stock mode


def _batch(step: int, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_ROWS, IN, generator=g)
    y = torch.randn(GLOBAL_ROWS, OUT, generator=g)
    per = GLOBAL_ROWS // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


class _FailsOnce(torch.autograd.Function):
    """The identity; its backward raises where the forward was told to (`fail`)."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.fail:
            raise RuntimeError("a backward that fails on purpose")
        return grad, None


class _Segment(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h, shared=None):
        h = torch.tanh(self.fc(h))
        return h if shared is None else torch.tanh(shared(h))


class _Net(nn.Module):
    """emb, two segments (the block stack the engine finds), head; an MSE loss. `shared`: a
    Linear outside the stack that both segments call; `frozen_ends`: emb and head frozen, so
    every trainable parameter lies inside the segments (the segments' input is made to require
    grad, as Hugging Face's enable_input_require_grads does, or a reentrant checkpoint would
    make no gradient). Set by the tests after the switch: `reentrant` runs each segment under
    checkpoint(use_reentrant=True); `fail` makes the next pass's backward raise between the
    segments (after the head's and segment 1's gradients landed, before segment 0's and emb's)."""

    def __init__(self, shared: bool = False, frozen_ends: bool = False):
        super().__init__()
        self.emb = nn.Linear(IN, DIM)
        self.segments = nn.ModuleList([_Segment(), _Segment()])
        self.shared = nn.Linear(DIM, DIM) if shared else None
        self.head = nn.Linear(DIM, OUT)
        if frozen_ends:
            self.emb.requires_grad_(False)
            self.head.requires_grad_(False)
        self.reentrant = False
        self.fail = False

    def forward(self, x, y):
        h = self.emb(x)
        if not h.requires_grad:
            h.requires_grad_()
        for i, seg in enumerate(self.segments):
            if i == 1:
                h = _FailsOnce.apply(h, self.fail)
                self.fail = False
            args = (h,) if self.shared is None else (h, self.shared)
            h = checkpoint(seg, *args, use_reentrant=True) if self.reentrant else seg(*args)
        return F.mse_loss(self.head(h), y)


def _make(**kwargs) -> _Net:
    torch.manual_seed(0)
    return _Net(**kwargs)


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def _wrapped(net: _Net, distributed: bool = True):
    """`net` wrapped with offload="auto" (the default), data parallel where a process group
    is (the default) unless `distributed` is False: (model, optimizer)."""
    opts = {} if distributed else {"distributed": False}
    model, opt = trainstream.wrap(net, _optimizer(net), device="cpu", threads=1, profile=False, **opts)
    return model, opt


def _step(model, opt, step: int, rank: int = 0, world: int = 1) -> None:
    model(*_batch(step, rank, world)).backward()
    opt.step()
    opt.zero_grad()


def _train_on(model, opt, out: dict, rank: int, world: int) -> None:
    """Steps SWITCH_STEPS to STEPS; a RuntimeError ends them, recorded in out["raised"] as
    (the step, its message). Then the weights, in out["state"]."""
    try:
        for step in range(SWITCH_STEPS, STEPS):
            _step(model, opt, step, rank, world)
    except RuntimeError as e:
        out["raised"] = (step, str(e))
    out["state"] = _host_state(model)


def _switched(model, opt, rank: int = 0, world: int = 1) -> dict:
    """The first SWITCH_STEPS steps, after which offload="auto" has switched to stock training
    (checked); the trainstream this process imported, for the test to check."""
    for step in range(SWITCH_STEPS):
        _step(model, opt, step, rank, world)
    mode = trainstream.memory_report(model)["mode"]
    assert mode == "stock", f"offload='auto' did not switch to stock training: mode {mode!r}"
    return {"trainstream": trainstream.__file__}


def _ddp(net: _Net, **kwargs):
    ddp = torch.nn.parallel.DistributedDataParallel(net, **kwargs)
    return ddp, _optimizer(ddp.module)


def _ddp_state(ddp) -> dict:
    return {k.removeprefix("module."): v for k, v in _host_state(ddp).items()}


def _close_as_ddp(ours: dict, alone: dict, ddp: dict, plain: dict) -> None:
    """`ours` (the engine's weights) are within three times DDP's distance (`ddp` from `plain`,
    one process training stock) from `alone` (one process wrapped alike)."""
    mine, theirs = _max_diff(ours, alone), _max_diff(ddp, plain)
    worst = max(ours, key=lambda k: float((ours[k] - alone[k]).abs().max()))
    assert mine <= 3 * max(theirs, 1e-7), f"the engine is {mine:.3g} from one process (at {worst}), DDP {theirs:.3g}"


def _same_on_every_rank(ranks: list) -> None:
    """Every rank's weights the same bits (the parameter that differs named)."""
    first = ranks[0]["state"]
    for r, res in enumerate(ranks[1:], 1):
        assert res["state"].keys() == first.keys()
        for k, t in first.items():
            differ = int((bits(res["state"][k]) != bits(t)).sum())
            assert differ == 0, f"{k} differs between rank 0 and rank {r}: {differ} of {t.numel()} elements"


def _same_trainstream(ranks: list) -> None:
    """Every rank imported the trainstream the test process did (PYTHONPATH reaches them)."""
    print("trainstream of the ranks:", [r["trainstream"] for r in ranks], "of the test:", trainstream.__file__)
    for r in ranks:
        assert r["trainstream"] == trainstream.__file__


def _passes_counted(model, opt, rank: int, world: int) -> dict:
    """Steps SWITCH_STEPS to STEPS, the first of them plain and the others under the reentrant
    checkpoints: the all-reduces each backward pass issued, by whether it ran under them."""
    counted = {False: [], True: []}
    for step in range(SWITCH_STEPS, STEPS):
        model.reentrant = step > SWITCH_STEPS
        launches = []
        with _launches_recorded(launches):
            model(*_batch(step, rank, world)).backward()
        counted[model.reentrant].append(launches.count("launch"))
        opt.step()
        opt.zero_grad()
    return counted


def _close_as_ddp_under_checkpoints(run: dict, **net) -> None:
    """`run` (a rank's weights and DDP's) against one process, wrapped and plain, training a
    _Net(**net) whose steps after the first in stock mode run under the reentrant checkpoints,
    as _passes_counted's do (_close_as_ddp)."""
    model, opt = _wrapped(_make(**net), distributed=False)
    _switched(model, opt)
    plain = _make(**net)
    plain_opt = _optimizer(plain)
    for step in range(STEPS):
        model.reentrant = plain.reentrant = step > SWITCH_STEPS
        if step >= SWITCH_STEPS:
            _step(model, opt, step)
        _step(plain, plain_opt, step)
    _close_as_ddp(run["state"], _host_state(model), run["ddp"], _host_state(plain))


# -- 1. a parameter used by two reentrant checkpoint segments ---------------------------------


def _shared_in_two_segments(rank, world, bucket_bytes):
    engine_dist.AVERAGING_BUCKET_BYTES = bucket_bytes  # read when the switch builds the buckets
    model, opt = _wrapped(_make(shared=True))
    out = _switched(model, opt, rank, world)
    out["all-reduces"] = _passes_counted(model, opt, rank, world)
    out["state"] = _host_state(model)
    # DDP needs static_graph for a parameter whose hook fires twice in a pass (reentrant checkpoints).
    # Its graph may not change, so every step under the checkpoints (the same values).
    net = _make(shared=True)
    net.reentrant = True
    ddp, ddp_opt = _ddp(net, static_graph=True)
    for step in range(STEPS):
        _step(ddp, ddp_opt, step, rank, world)
    out["ddp"] = _ddp_state(ddp)
    return out


@pytest.mark.parametrize("bucket_bytes", [engine_dist.AVERAGING_BUCKET_BYTES, 4], ids=["one bucket", "a bucket each"])
def test_a_parameter_two_reentrant_checkpoint_segments_use_is_averaged_once_its_gradients_are_summed(
    tmp_path, bucket_bytes
):
    """After the switch, each segment of the model under checkpoint(use_reentrant=True), a
    Linear called in both: its gradient lands once per segment's inner backward. The pass is
    averaged as DDP (static_graph) averages it, both gradients summed first: every rank the
    same bits, as close to one process as DDP. With a bucket per parameter the shared one's
    bucket goes at its first gradient and is sent again at the end of the pass ([Note: late
    gradients]): two all-reduces more (its weight and bias) than the same pass without
    the checkpoints. 82bfc56
    counted the second gradient as another parameter landing, the bucket went before emb's
    gradient landed, and emb kept its own rank's gradient (ranks diverged)."""
    ranks = _ok(_spawn(2, tmp_path, _shared_in_two_segments, bucket_bytes))
    _same_trainstream(ranks)
    _same_on_every_rank(ranks)
    for r in ranks:
        plain, reentrant = r["all-reduces"][False], r["all-reduces"][True]
        resent = 2 if bucket_bytes == 4 else 0  # the shared Linear's weight and bias, a bucket each
        assert all(n == plain[0] + resent for n in reentrant), (plain, reentrant)
    _close_as_ddp_under_checkpoints(ranks[0], shared=True)


# -- 2. a user's hooks registered after the switch --------------------------------------------


def _user_hooks(model) -> None:
    """A user's hooks on every trainable parameter: a tensor hook that halves the incoming
    gradient (runs before accumulation), and a post-accumulate-grad hook that keeps the first
    row of every parameter fixed (zeroes that row of p.grad). Both commute with the average over
    the ranks (a per-rank clamp, say, would not: one process would be no reference)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_halved)
            p.register_post_accumulate_grad_hook(_first_row_kept)


def _halved(grad):
    return grad * 0.5


def _first_row_kept(p) -> None:
    p.grad.narrow(0, 0, 1).zero_()


def _hooks_after_the_switch(rank, world):
    model, opt = _wrapped(_make())
    out = _switched(model, opt, rank, world)
    _user_hooks(model)
    for step in range(SWITCH_STEPS, STEPS):
        _step(model, opt, step, rank, world)
    out["state"] = _host_state(model)
    ddp, ddp_opt = _ddp(_make())
    for step in range(STEPS):
        if step == SWITCH_STEPS:
            _user_hooks(ddp.module)  # registered after DDP's own, as after the switch
        _step(ddp, ddp_opt, step, rank, world)
    out["ddp"] = _ddp_state(ddp)
    return out


def test_a_user_hook_registered_after_the_switch_changes_the_gradients_averaged_as_under_ddp(tmp_path):
    """After the switch the user registers, on every parameter, a tensor hook (halves the
    incoming gradient) and a post-accumulate-grad hook (zeroes p.grad's first row); then trains
    on. DDP averages what both hooks made, whatever the order of registration: a tensor hook
    runs before the gradient is accumulated, and a post-accumulate-grad hook is run by
    AccumulateGrad itself, before the node's post hooks, which is where DDP's reducer copies
    the gradient into its bucket (registering the user's hook after DDP's changes nothing).
    So the engine must average the hooked gradients too: every rank the same bits, as close to
    one process (which runs the same hooks) as DDP. 82bfc56 copies a bucket inside the hook of
    the parameter that completes it, registered before the user's: that parameter's row is
    averaged unzeroed, and the user's change is lost."""
    ranks = _ok(_spawn(2, tmp_path, _hooks_after_the_switch))
    _same_trainstream(ranks)
    _same_on_every_rank(ranks)
    a = ranks[0]
    model, opt = _wrapped(_make(), distributed=False)
    _switched(model, opt)
    _user_hooks(model)
    plain = _make()
    plain_opt = _optimizer(plain)
    for step in range(STEPS):
        if step == SWITCH_STEPS:
            _user_hooks(plain)
        if step >= SWITCH_STEPS:
            _step(model, opt, step)
        _step(plain, plain_opt, step)
    _close_as_ddp(a["state"], _host_state(model), a["ddp"], _host_state(plain))


# -- 3. a backward pass that raises -----------------------------------------------------------


def _a_pass_raises(rank, world):
    model, opt = _wrapped(_make())
    out = _switched(model, opt, rank, world)
    model.fail = True
    try:
        model(*_batch(SWITCH_STEPS, rank, world)).backward()
    except RuntimeError as e:
        out["failed pass"] = str(e)
    opt.zero_grad()
    _train_on(model, opt, out, rank, world)
    # DDP cannot go on after a backward that raised (its next forward asks for the reduction
    # it never finished); the failed pass changes no weight: DDP trains without it.
    ddp, ddp_opt = _ddp(_make())
    for step in range(STEPS):
        _step(ddp, ddp_opt, step, rank, world)
    out["ddp"] = _ddp_state(ddp)
    return out


def test_after_a_backward_that_raised_on_every_rank_the_next_passes_are_averaged(tmp_path):
    """After the switch, a backward pass raises on both ranks (a custom autograd Function
    between the segments, after the head's and a segment's gradients landed); the user catches
    it, calls zero_grad() and trains on. Every rank must then hold the same bits, as close to
    one process (the same failed pass) as DDP is (without it: DDP cannot go on after one, and
    the pass changes nothing once zero_grad() dropped its gradients), or the step right after it
    raises on every rank, the weights still alike, a trainstream error that says an earlier pass
    raised (not one that blames something the run never did). 82bfc56 never queued the end of
    a pass again (its `_queued` stayed set, the final callback of the failed pass never ran):
    the later passes were never averaged, and the ranks drifted apart silently."""
    ranks = _ok(_spawn(2, tmp_path, _a_pass_raises))
    _same_trainstream(ranks)
    for r in ranks:
        assert r.get("failed pass") == "a backward that fails on purpose", r.get("failed pass")
    _same_on_every_rank(ranks)  # at the end, or where every rank raised
    raised = [r.get("raised") for r in ranks]
    if any(raised):
        for r, got in enumerate(raised):
            assert got is not None, f"rank {r} went on while another raised: {raised}"
            step, msg = got
            # The next step, before any pass trained on un-averaged gradients; and an error that
            # says the earlier pass raised, not one that blames something the run never did.
            assert step == SWITCH_STEPS, f"rank {r} raised at step {step}, not the one after the failed pass: {msg}"
            said = msg.lower()
            assert "trainstream" in said and any(w in said for w in ("raised", "exception", "fail")), msg
        return
    a = ranks[0]
    model, opt = _wrapped(_make(), distributed=False)
    _switched(model, opt)
    model.fail = True
    with contextlib.suppress(RuntimeError):
        model(*_batch(SWITCH_STEPS)).backward()
    opt.zero_grad()
    plain = _make()
    plain_opt = _optimizer(plain)
    for step in range(STEPS):
        if step >= SWITCH_STEPS:
            _step(model, opt, step)
        _step(plain, plain_opt, step)
    _close_as_ddp(a["state"], _host_state(model), a["ddp"], _host_state(plain))


class _NetExtra(_Net):
    """_Net with a Linear after the head that only rank 0 uses (`use_extra`): with a bucket per
    parameter, rank 0 sends buckets during backward that rank 1 holds to the pass's end."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(OUT, OUT)
        self.use_extra = True

    def forward(self, x, y):
        h = self.emb(x)
        for i, seg in enumerate(self.segments):
            if i == 1:
                h = _FailsOnce.apply(h, self.fail)
                self.fail = False
            h = seg(h)
        out = self.head(h)
        return F.mse_loss(self.extra(out) if self.use_extra else out, y)


def _raised_on(rank, world, failing: tuple):
    """After the switch, buckets of a parameter each, one pass whose backward raises on the
    ranks in `failing` (every rank's backward raises: on the others, as the pass is dropped
    everywhere), zero_grad(), then training on; the same run without that pass beside it."""
    engine_dist.AVERAGING_BUCKET_BYTES = 4
    out = {}
    for name, fails in (("failed", True), ("control", False)):
        torch.manual_seed(0)
        model, opt = _wrapped(_NetExtra())
        model.use_extra = rank == 0
        _switched(model, opt, rank, world)
        if fails:
            model.fail = rank in failing
            try:
                model(*_batch(SWITCH_STEPS, rank, world)).backward()
            except RuntimeError as e:
                out["failed pass"] = str(e)
            opt.zero_grad()
        for step in range(SWITCH_STEPS, STEPS):
            _step(model, opt, step, rank, world)
        out[name] = _host_state(model)
    return out


@pytest.mark.parametrize("failing", [(0, 1), (0,)], ids=["every rank", "rank 0 alone"])
def test_a_pass_that_raised_after_uneven_launches_is_dropped_on_every_rank_and_training_goes_on(tmp_path, failing):
    """A parameter only rank 0 uses: rank 0 sends buckets during backward that rank 1 holds to
    the end. A backward that raises then (on every rank, or on rank 0 alone) is dropped on every
    rank: the rank that raised completes the pass's all-reduces writing nothing, and one whose
    backward ended raises instead of applying it. Afterwards every rank holds, bit for bit, what
    the same run without that pass holds. e571c05 forgot what had been sent: every later
    all-reduce paired with another bucket, and gloo aborted once the sizes differed."""
    ranks = _ok(_spawn(2, tmp_path, _raised_on, failing))
    assert ranks[0]["failed pass"] == "a backward that fails on purpose"
    if failing == (0,):
        assert "raised on another rank" in ranks[1]["failed pass"], ranks[1]["failed pass"]
    else:
        assert ranks[1]["failed pass"] == "a backward that fails on purpose"
    for r in ranks:
        for k, t in r["control"].items():
            assert torch.equal(bits(r["failed"][k]), bits(t)), k
    shared = {k: v for k, v in ranks[0]["failed"].items() if not k.startswith("extra")}
    _same_on_every_rank([{"state": shared}, {"state": {k: ranks[1]["failed"][k] for k in shared}}])


def _retried(rank, world):
    """After the switch, a pass whose backward raises on every rank (a hook that raises once),
    zero_grad(), then the same graph (kept with retain_graph=True) backward again, before any
    forward, and step(); then training on. And the same run with that pass succeeding at once."""
    out = {}
    for name, flaky in (("retried", True), ("control", False)):
        model, opt = _wrapped(_make())
        _switched(model, opt, rank, world)
        fails = [flaky]

        def once(grad, fails=fails):
            if fails[0]:
                fails[0] = False
                raise RuntimeError("a hook that fails once")
            return grad

        handle = model.head.weight.register_hook(once)
        loss = model(*_batch(SWITCH_STEPS, rank, world))
        try:
            loss.backward(retain_graph=True)
        except RuntimeError as e:
            out["failed pass"] = str(e)
        opt.zero_grad()
        loss.backward()
        opt.step()
        opt.zero_grad()
        handle.remove()
        for step in range(SWITCH_STEPS + 1, STEPS):
            _step(model, opt, step, rank, world)
        out[name] = _host_state(model)
    return out


def test_a_retried_backward_of_a_kept_graph_after_one_that_raised_is_averaged(tmp_path):
    """zero_grad() drops the pass a raised backward left open (as the model's next forward
    does), so the retried backward of the kept graph begins a pass of its own and is averaged:
    every rank ends, bit for bit, where the run whose pass succeeded at once ends. e571c05
    dropped the open pass only at the next forward: the retry averaged nothing and each rank
    stepped on its own gradient."""
    ranks = _ok(_spawn(2, tmp_path, _retried))
    for r in ranks:
        assert r["failed pass"] == "a hook that fails once"
        for k, t in r["control"].items():
            assert torch.equal(bits(r["retried"][k]), bits(t)), k
    _same_on_every_rank([{"state": r["retried"]} for r in ranks])


# -- 4. every trainable parameter inside reentrant checkpoint segments ------------------------


def _frozen_ends(rank, world):
    model, opt = _wrapped(_make(frozen_ends=True))
    out = _switched(model, opt, rank, world)
    out["all-reduces"] = _passes_counted(model, opt, rank, world)
    out["state"] = _host_state(model)
    net = _make(frozen_ends=True)
    ddp, ddp_opt = _ddp(net)
    for step in range(STEPS):
        net.reentrant = step > SWITCH_STEPS
        _step(ddp, ddp_opt, step, rank, world)
    out["ddp"] = _ddp_state(ddp)
    return out


def test_reentrant_segments_holding_every_trainable_parameter_average_once_per_pass(tmp_path):
    """After the switch, emb and head frozen, each segment under checkpoint(use_reentrant=True):
    every gradient lands inside a segment's inner backward. The pass must be averaged once, as
    the same pass without the checkpoints is (the same all-reduces: dist.all_reduce counted
    during backward, the only way to see it), and the weights must be every rank's same bits,
    as close to one process as DDP (with the same checkpoints). 82bfc56 queued the end of the
    pass from the first gradient's hook, inside the inner backward of the last segment, whose
    end ran it: each segment's end averaged every bucket (twice the traffic here)."""
    ranks = _ok(_spawn(2, tmp_path, _frozen_ends))
    _same_trainstream(ranks)
    for r in ranks:
        plain, reentrant = r["all-reduces"][False], r["all-reduces"][True]
        assert len(plain) == 1 and len(reentrant) == STEPS - SWITCH_STEPS - 1
        assert all(n == plain[0] for n in reentrant), f"all-reduces per pass: {plain[0]} plain, {reentrant} reentrant"
    _same_on_every_rank(ranks)
    _close_as_ddp_under_checkpoints(ranks[0], frozen_ends=True)
