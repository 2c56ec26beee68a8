"""Weights on the device: paged weights are placeholders between uses, the guard, and blocks
moved between paged and resident."""

import pytest
import torch
from helpers import GPU_MODE, PAGED, RESIDENT, assert_same_bits, gpt_steps, max_diff, train
from models import tiny_gpt

import trainstream
from trainstream.engine.adapt import Replan


def test_guard_params_false_gives_the_same_run():
    assert_same_bits(
        train("gpt", dict(PAGED, guard_params=True), steps=3), train("gpt", dict(PAGED, guard_params=False), steps=3)
    )


def test_paged_weights_read_outside_forward_give_their_values():
    """Between uses a paged param's data is its host weights (params.py, [Note: placeholders]):
    every way of reading it gives the values state_dict() gives, current after synchronize(),
    and it holds no copy of its own."""
    _, state, (model, opt) = train("gpt", PAGED, steps=2)
    engine = model._trainstream_engine
    w = model.layers[0].qkv.weight
    slot = next(s for s in engine.block_units[0].slots if s.param is w)
    assert w.shape == (192, 64) and w.dtype == torch.float32 and w.device.type == "cpu"
    assert w.untyped_storage().data_ptr() == slot.master.untyped_storage().data_ptr()
    named = dict(model.named_parameters())
    for read in (w, w.data, w.detach(), named["layers.0.qkv.weight"]):
        assert torch.equal(read, state["layers.0.qkv.weight"])
    _, batch, loss_fn = tiny_gpt()
    loss_fn(model, batch(5, "cpu")).backward()
    opt.step()
    opt.synchronize()
    assert not torch.equal(w, state["layers.0.qkv.weight"])
    assert torch.equal(w.detach(), model.state_dict()["layers.0.qkv.weight"])


def _edit(model):
    """In-place edits after wrap(), as weight init, pruning masks and EMA copy-back make them:
    on the params themselves, under no_grad (a resident head, paged or resident blocks)."""
    with torch.no_grad():
        model.head.weight.mul_(0.5)
        model.layers[1].fc.weight.mul_(0.5)
        torch.nn.init.constant_(model.layers[2].ln1.weight, 2.0)


@pytest.mark.parametrize(
    "options",
    [PAGED, RESIDENT, dict(RESIDENT, **GPU_MODE), dict(PAGED, max_grad_norm=0.5)],
    ids=["paged", "resident", "gpu_mode", "paged_clipped"],
)
def test_in_place_edits_after_wrap_are_trained_on_as_torch_does(options):
    """An edit made between steps (after synchronize(), before wrap's first step too) is what
    the next forward computes with and what the next update starts from: the run equals
    torch AdamW doing the same edits, and state_dict() shows each edit."""
    clip = options.get("max_grad_norm")
    runs = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
        if wrapped:
            model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, **options)
        for i in range(4):
            if i in (0, 2):
                if wrapped:
                    opt.synchronize()
                before = model.state_dict()["layers.1.fc.weight"].clone()
                _edit(model)
                assert torch.equal(model.state_dict()["layers.1.fc.weight"], before * 0.5)
            loss_fn(model, batch(i, "cpu")).backward()
            if clip is not None and not wrapped:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        runs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert max_diff(*runs) < 2e-5


def test_dtype_and_device_changes_after_wrap_are_refused_at_the_call():
    """model.double(), .half(), .to(dtype) and a move to another device, on the model or one
    of its modules, would leave the engine's buffers and kernels laid out for the old ones:
    refused before anything changes, with what to do instead; conversions that change
    nothing pass, and after unwrap() the model converts as any other."""
    _, state, (model, opt) = train("gpt", PAGED, steps=1)
    calls = [
        lambda: model.double(),
        lambda: model.half(),
        lambda: model.to(torch.bfloat16),
        lambda: model.layers[2].to(dtype=torch.float64),
        lambda: model.head.to("meta"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"unwrap\(model\), convert or move it, then wrap\(\) it again"):
            call()
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert model.float() is model and model.to("cpu") is model and model.cpu() is model
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    _, batch, loss_fn = tiny_gpt()
    loss_fn(model, batch(1, "cpu")).backward()  # still trains
    opt.step()
    trainstream.unwrap(model)
    assert all(p.dtype == torch.float64 for p in model.double().parameters())


def _train_and_move(mode: str) -> dict:
    """Three steps with every block resident, blocks 0 and 1 paged, three more steps, block 0
    back: the host weights of a unit updated on the device must be brought level first."""

    def move(i, engine):
        if i in (3, 6):  # between steps, where the engine applies the adapter's replans
            engine.apply(Replan([0, 1] if i == 3 else [1], []))

    model, _ = gpt_steps(mode, steps=9, before_step=move)
    engine = model._trainstream_engine
    assert [u.paged for u in engine.block_units] == [False, True, False, False]
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_gpu_mode_blocks_moved_between_steps_keep_their_weights():
    host, device = _train_and_move("cpu"), _train_and_move("gpu")
    for k in host:
        assert torch.equal(host[k], device[k]), k


@pytest.mark.gpu
def test_gpu_paged_weights_read_outside_forward_give_their_values():
    """On a GPU a paged param's placeholder is a CUDA tensor over its pinned host weights (no
    device memory of its own): reads outside forward give the values state_dict() gives, and
    a move to the CPU is refused at the call."""
    _, state, (model, opt) = train("gpt", PAGED, steps=2, device="cuda")
    w = model.layers[0].qkv.weight
    assert w.device.type == "cuda" and w.dtype == torch.float32
    slot = next(s for s in model._trainstream_engine.block_units[0].slots if s.param is w)
    assert w.data_ptr() == slot.master.data_ptr() and slot.master.is_pinned()
    for read in (w, w.data, w.detach(), dict(model.named_parameters())["layers.0.qkv.weight"]):
        assert torch.equal(read.cpu(), state["layers.0.qkv.weight"])
    with pytest.raises(ValueError, match="unwrap"):
        model.cpu()
    assert w.device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("options", [PAGED, RESIDENT], ids=["paged", "resident"])
def test_gpu_in_place_edits_after_wrap_are_trained_on_as_torch_does(options):
    runs = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model, batch, loss_fn = tiny_gpt()
        model = model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
        if wrapped:
            model, opt = trainstream.wrap(model, opt, offload=True, **options)
        for i in range(4):
            if i in (0, 2):
                if wrapped:
                    opt.synchronize()
                _edit(model)
            loss_fn(model, batch(i, "cuda")).backward()
            opt.step()
            opt.zero_grad()
        runs.append({k: v.detach().cpu() for k, v in model.state_dict().items()})
    assert max_diff(*runs) < 2e-5


def test_an_edit_before_a_block_moves_between_paged_and_resident_is_kept():
    """A block edited in place and then paged (or brought back) between steps: the edit is
    taken into its host weights before they become the param's, as torch keeps it."""

    def edit_and_move(i, engine):
        if i in (1, 3):
            engine.optimizer.synchronize()
            with torch.no_grad():
                engine.model.layers[0].fc.weight.mul_(0.5)
            engine.apply(Replan([0] if i == 1 else [], []))

    model, _ = gpt_steps("cpu", steps=5, before_step=edit_and_move)
    torch.manual_seed(0)
    reference, batch, loss_fn = tiny_gpt()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for i in range(5):
        if i in (1, 3):
            with torch.no_grad():
                reference.layers[0].fc.weight.mul_(0.5)
        loss_fn(reference, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    assert max_diff(reference.state_dict(), model.state_dict()) < 2e-5


# -- a unit's fetch layout: made once per plan (issue 23) -------------------------------------------

GPT_FROZEN = lambda n: n.startswith("layers.") and n.endswith(("qkv.weight", "fc.weight", "out.weight"))  # noqa: E731


def _gpt_run(opts, steps, between=None):
    """tiny_gpt with its block matrices frozen, wrapped with `opts`, trained `steps` steps;
    `between(engine, step)` runs after each step. Returns (losses, state, engine)."""
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    for n, p in model.named_parameters():
        p.requires_grad_(not GPT_FROZEN(n))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, **opts)
    engine = model._trainstream_engine
    losses = []
    for i in range(steps):
        loss = loss_fn(model, batch(i, "cpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if between is not None:
            between(engine, i)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return losses, state, engine


def test_a_quantized_units_fetches_reuse_one_layout_and_one_dtypes_dict(monkeypatch):
    """A resident quantized unit is dequantized twice a step, into a fresh buffer each time,
    laid out once: where each weight lies, its codes, and the dtypes dict every forward (and
    its backward) hands on as the unit's fetch_dtypes. No layout is made after the first step."""
    from trainstream.engine import params
    from trainstream.engine.layout import Fetch

    _, _, engine = _gpt_run(dict(RESIDENT, quantize="nf4"), steps=2)
    dtypes = {u: u.fetch_dtypes for u in engine.block_units}
    assert all(dtypes.values())
    made = []

    class Counted(params._FetchLayout):
        def __init__(self, *args):
            made.append(args)
            super().__init__(*args)

    monkeypatch.setattr(params, "_FetchLayout", Counted)
    seen = []
    real_fetch = engine.weights.fetch

    def fetch(unit, **kwargs):
        released = unit.fetch is Fetch.RELEASED  # else the call has nothing to do
        real_fetch(unit, **kwargs)
        if released and unit.fetch is not Fetch.RELEASED:  # (a resident unit is never fetched ahead)
            seen.append((unit, unit.fetch_dtypes, unit.fetched))

    monkeypatch.setattr(engine.weights, "fetch", fetch)
    loss_fn, batch = tiny_gpt()[2], tiny_gpt()[1]
    loss_fn(engine.model, batch(9, "cpu")).backward()
    assert not made
    assert {u for u, _, _ in seen} == set(engine.block_units)
    assert all(d is dtypes[u] for u, d, _ in seen)
    # forward and backward each fetch, the last block's too (a resident unit keeps nothing
    # from its forward for its backward: the head and the loss run without its weights)
    fetches = [sum(u is unit for u, _, _ in seen) for unit in engine.block_units]
    assert fetches == [2] * len(fetches), fetches


def test_a_quantized_block_paged_mid_run_fetches_all_its_weights_and_keeps_the_bits():
    """A resident quantized block moved to host memory between steps (a replan) is laid out
    again: its fetch brings every weight it keeps in host memory (its codes across PCIe and
    its plain weights), and training gives the bits of the run that never moved it."""

    def page_block_1(engine, step):
        if step == 1:
            engine.apply(Replan([1], [], []))
            unit = engine.block_units[1]
            assert unit.paged and set(unit.streamed_slots) == set(unit.pageable_slots)

    opts = dict(RESIDENT, quantize="nf4")
    stayed = _gpt_run(opts, steps=4)
    moved = _gpt_run(opts, steps=4, between=page_block_1)
    assert_same_bits(stayed[:2], moved[:2])
    layouts = moved[2].weights._layouts
    unit = moved[2].block_units[1]
    views, by_dtype = layouts[unit]
    assert views is unit.views and all(set(layout.slots) == set(unit.pageable_slots) for layout in by_dtype.values())
