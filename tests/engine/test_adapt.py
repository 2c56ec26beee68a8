"""The adapter on the CPU path: replanning from measured activations, the watchdog and the
online guard (device memory simulated)."""

import subprocess
import sys

import pytest
import torch
from helpers import AUTO, RESIDENT, FakeDevice, assert_same_bits, machine, on_a_nearly_full_card, train
from models import tiny_gpt, tiny_mlp

import trainstream

KiB = 1 << 10


MiB = 1 << 20


def history(model, kind=None):
    return [h for h in trainstream.memory_report(model)["plan"]["history"] if kind in (None, h["kind"])]


def test_the_first_steps_bring_blocks_back_once_activations_are_measured():
    # 6 blocks of 256 KiB on a 3 MiB card: at wrap() half the memory is held back for the
    # unmeasured activations and four blocks are paged; the first step measures 8 KiB per
    # block, and the replan brings every block back. Moving blocks changes no bit.
    resident = train("mlp", RESIDENT, steps=6)
    auto = train("mlp", dict(AUTO, profile=machine(vram_gib=3 / 1024)), steps=6)
    assert_same_bits(resident, auto)
    model = auto[2][0]
    assert history(model, "applied") and history(model, "applied")[0]["paged"] == []
    report = trainstream.memory_report(model)
    assert report["params"]["paged_blocks"] == [] and report["plan"]["activation_bytes_per_block"]


def on_fake_device(make, vram_mib, now, param_offload=(0,)):
    """A model wrapped on the CPU path for a card of `vram_mib`, its device memory simulated:
    (model, optimizer, adapter, fake device, batch, loss_fn)."""
    model, batch, loss_fn = make()
    model, opt = trainstream.wrap(
        model,
        None,
        device="cpu",
        lr=1e-2,
        offload=True,
        param_offload=list(param_offload),
        activation_offload="auto",
        profile=machine(vram_gib=vram_mib / 1024),
    )
    adapter = model._trainstream_engine.adapter
    return model, opt, adapter, FakeDevice(adapter, now), batch, loss_fn


def test_the_watchdog_pages_more_when_a_step_grows():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(
        model, None, device="cpu", lr=1e-2, offload=True, **AUTO, profile=machine(vram_gib=8 / 1024)
    )
    adapter = model._trainstream_engine.adapter
    fake = FakeDevice(adapter, 2 * MiB)

    def step(i):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()

    for i in range(5):  # settled: everything resident
        step(i)
    assert trainstream.memory_report(model)["params"]["paged_blocks"] == []
    fake.now = fake.peak = adapter.usable + MiB  # a longer sequence: the step passed the usable memory
    step(5)
    step(6)
    report = trainstream.memory_report(model)
    assert report["params"]["paged_blocks"] or report["params"]["activation_paged_blocks"]
    assert "watchdog" in history(model, "replan")[-1]["message"]
    assert history(model, "applied")


@pytest.mark.parametrize("param_offload", [(0,), ()], ids=["backward hook", "no backward hook"])
def test_what_runs_after_the_stack_is_measured_and_planned_on_top_of_the_activations(param_offload):
    # The loss (the head, on a language model) raises the device's peak above the memory
    # allocated at the stack's end. With a block paged, a hook reads the rise when backward
    # reaches the stack, before backward's own transients; with nothing paged there is no
    # hook there, and the step's end reads the rise with backward's in it (more: the safe side).
    model, opt, adapter, fake, batch, loss_fn = on_fake_device(tiny_mlp, 64, 2 * MiB, param_offload)
    in_backward = {"rise": 0}  # a transient of backward, after the stack: block 1's input gradient
    model[1].register_full_backward_pre_hook(
        lambda m, g: setattr(fake, "peak", max(fake.peak, fake.now + in_backward["rise"]))
    )
    hooked = bool(param_offload)
    # (head's rise, what the head still holds into backward, backward's transient) per step
    for head, held, rise, after_stack in [
        (3 * MiB, MiB, 6 * MiB, 3 * MiB if hooked else 7 * MiB),
        (12 * MiB, 0, 0, 12 * MiB),
        (MiB, 0, 0, 12 * MiB),
    ]:  # below the last peak: nothing learnt
        fake.now = 2 * MiB
        loss = loss_fn(model, batch(0, "cpu"))
        fake.peak = max(fake.peak, fake.now + head)  # the loss and its gradient, after the stack
        fake.now += held
        in_backward["rise"] = rise
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert adapter.after_stack == after_stack and adapter.after_stack_measured
    inputs = adapter._inputs(0)
    # (The plan counts the larger bound of the next test: here, the simulated memory does not
    # hold the output's gradient that backward's first reading takes off.)
    assert inputs.after_stack_bytes == adapter.planned_after_stack() >= 12 * MiB
    assert inputs.held_after_stack_bytes == (MiB if hooked else 0)


def test_memory_freed_before_backward_is_added_to_the_heads_rise_until_a_pass_frees_none():
    # The head's forward sets the step's peak; autocast then frees its copies of resident
    # weights (simulated) before backward, whose own part of the head stays under that peak
    # and cannot be read. With nothing freed it would have been that much higher: the plan
    # counts the rise plus what was freed, until a pass that frees nothing measures it.
    model, opt, adapter, fake, batch, loss_fn = on_fake_device(tiny_gpt, 256, 0)

    def head_forward(m, a, out):  # the logits: the peak rises 3 MiB above the stack's end
        fake.peak = max(fake.peak, fake.now + 3 * MiB)
        fake.now += 2 * MiB  # what the head keeps for backward

    def head_backward(m, g):  # the logits' gradient: 4 MiB above what is allocated then
        fake.peak = max(fake.peak, fake.now + 4 * MiB)

    model.head.register_forward_hook(head_forward)
    model.head.register_full_backward_pre_hook(head_backward)

    def step(stack_end, freed):
        fake.now = stack_end
        loss = loss_fn(model, batch(0, "cpu"))
        fake.now -= freed  # autocast's exit
        loss.backward()
        opt.step()
        opt.zero_grad()

    # (The simulated memory does not hold the loss's 4-byte gradient, which backward's first
    # reading takes off: the bounds below are that much larger.)
    grad = pytest.approx(0, abs=4)
    step(10 * MiB, 4 * MiB)
    # Read: the forward's rise (3). Backward's part, with the 4 MiB still held, could have
    # reached 2 + 4 = 6 above the stack's end; bounded by 3 + 4 = 7.
    assert adapter.after_stack == 3 * MiB and adapter.after_stack_bound - 7 * MiB == grad
    assert adapter._inputs(0).after_stack_bytes == adapter.after_stack_bound
    step(20 * MiB, 0)  # a placement that frees nothing: backward's part is the new peak, 6 MiB
    assert adapter.after_stack == 6 * MiB and adapter.after_stack_bound - 6 * MiB == grad
    assert adapter._inputs(0).after_stack_bytes == adapter.after_stack_bound


def test_a_peak_from_before_wrap_is_taken_as_the_heads_only_until_a_step_measures_it():
    model, opt, adapter, fake, batch, loss_fn = on_fake_device(tiny_mlp, 256, 2 * MiB)
    fake.peak = 50 * MiB  # set before wrap(): this run's steps stay below it
    opt.step()  # a step with no forward pass (a warm-up, a learning-rate finder) reads nothing
    assert not adapter.after_stack_measured

    def step(now, head):
        fake.now = now
        loss = loss_fn(model, batch(0, "cpu"))
        fake.peak = max(fake.peak, fake.now + head)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step(2 * MiB, 3 * MiB)
    assert adapter.after_stack == 48 * MiB and adapter.after_stack_provisional
    step(30 * MiB, 25 * MiB)  # the counter rises after the stack: the head measured, replacing the guess
    assert adapter.after_stack == 25 * MiB and not adapter.after_stack_provisional


def test_the_online_guard_pages_activations_during_a_pass():
    resident = train("mlp", RESIDENT, steps=4)
    model, opt, adapter, batch, loss_fn = on_a_nearly_full_card(tiny_mlp)
    losses = []
    for i in range(4):
        loss = loss_fn(model, batch(i, "cpu"))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    guarded = history(model, "guard")
    assert guarded and guarded[0]["step"] == 0 and "activations paged during the pass" in guarded[0]["message"]
    # One history entry per pass, listing every block the guard paged in it.
    assert len([g for g in guarded if g["step"] == 0]) == 1 and len(guarded[0]["blocks"]) > 1
    first, last = guarded[0]["blocks"][0], guarded[0]["blocks"][-1]
    assert (
        f"the guard paged the activations of {len(guarded[0]['blocks'])} blocks in that pass: {first}-{last}"
        in trainstream.memory_report(model)["events"]
    )
    assert_same_bits(resident, (losses, {k: v.clone() for k, v in model.state_dict().items()}))


def test_the_guard_projects_as_the_plan_does_and_pages_when_a_pass_grows():
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(
        model,
        None,
        device="cpu",
        offload=True,
        param_offload=False,
        activation_offload="auto",
        profile=machine(vram_gib=8 / 1024),
    )
    engine = model._trainstream_engine
    adapter = engine.adapter
    for i in range(2):
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    acts = sum(engine.activation_bytes.values())
    assert acts > 0
    adapter.after_stack, adapter.after_stack_measured = 100 * KiB, True  # as a step on a GPU would have shown
    unit = engine.block_units[0]
    # Allocated + every block's measured activations + what runs after the stack: exactly the usable memory.
    exact = adapter.usable - acts - adapter.after_stack
    adapter._pass_act, adapter._pass_growth = 0, 1.0
    assert not adapter._guard(unit, exact) and not history(model, "guard")
    # The pass's first block saved ten times what was measured (a longer sequence): the rest of
    # the pass is projected that much larger, and this block's activations are paged.
    adapter._pass_growth = 10.0
    assert adapter._guard(engine.block_units[1], exact)  # the engine pages the block on this answer
    assert "activations paged during the pass" in history(model, "guard")[-1]["message"]
    # At block 2, blocks 0 and 1 have saved theirs (now allocated): one byte more than fits.
    adapter._pass_growth = 1.0
    done = engine.activation_bytes[0] + engine.activation_bytes[1]
    assert not adapter._guard(engine.block_units[2], exact + done)
    assert adapter._guard(engine.block_units[2], exact + done + 1)


def test_the_guard_recomputes_a_block_only_where_the_inputs_it_keeps_fit_beside_the_head():
    # A recomputed block keeps its inputs to its backward; blocks recomputed one after the
    # other each keep theirs. A first pass (nothing timed: the guard recomputes rather than
    # pages) on a card with room beside what runs after the stack for one block's inputs and a
    # half: block 0 is recomputed, the next ones paged (keeping none), and the pass ends within
    # the usable memory. (Before, every block was recomputed: the 1.9B GPT under a 4 GiB cap
    # kept 35 x 32 MiB of inputs and ran out of memory in the head's backward.)
    model, batch, loss_fn = tiny_gpt()
    model, opt = trainstream.wrap(
        model,
        None,
        device="cpu",
        offload=True,
        param_offload=False,
        activation_offload="auto",
        profile=machine(vram_gib=8 / 1024),
    )
    engine = model._trainstream_engine
    adapter, units = engine.adapter, engine.block_units
    loss_fn(model, batch(0, "cpu")).backward()  # measures each block's activations and inputs
    inputs = [engine.meter.activation_inputs[u.block] for u in units]
    assert len(set(inputs)) == 1 and inputs[0] * 4 < min(engine.activation_bytes.values())
    after_stack = int(adapter.AFTER_STACK_SHARE * adapter.usable) + max(u.nbytes for u in units)  # not measured yet
    device = FakeDevice(adapter, adapter.usable - after_stack - inputs[0] * 3 // 2)
    adapter.new_pass()
    choices = []
    for u in units:
        choice = adapter.block_starts(u, 0)
        choices.append(choice)
        u.recompute, u.act_paged = choice == "recompute", choice == "page"  # as the engine applies them
        device.now += inputs[0] if choice == "recompute" else 0
    assert choices == ["recompute", "page", "page", "page"]
    assert device.now + after_stack <= adapter.usable
    guard = [h for h in history(model, "guard") if h["choice"] == "page"]
    assert (
        guard
        and guard[0]["blocks"] == [1, 2, 3]
        and "would not fit beside what runs after the stack" in (guard[0]["message"])
    )


def test_backward_start_is_read_without_the_outputs_own_gradient():
    # A loss computed outside the model: its gradient with respect to the logits is allocated
    # when backward's first reading is taken, and is not memory freed.
    model, opt, adapter, fake, batch, loss_fn = on_fake_device(tiny_mlp, 256, 10 * MiB)
    loss = loss_fn(model, batch(0, "cpu"))  # the stack's end and the forward's return, at 10 MiB
    fake.now = 9 * MiB + 3 * MiB  # 1 MiB freed, then a 3 MiB gradient of the logits
    adapter.backward_starts(3 * MiB)
    assert adapter._fwd_end - adapter._bwd_start == MiB
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_a_model_output_that_is_a_leaf_gets_no_hook():
    # Hooks on a leaf outlive the pass (and would keep the engine alive): none is placed.
    class PassThrough(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.scale = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x, self.scale

    model, opt = trainstream.wrap(PassThrough(), None, device="cpu", lr=1e-2, offload=True)
    for _ in range(3):
        out, scale = model(torch.randn(4, 8))
        (out * scale).sum().backward()
        opt.step()
        opt.zero_grad()
    assert not scale._backward_hooks


def test_a_checkpointed_model_recomputing_in_backward_is_not_a_new_pass():
    from torch.utils.checkpoint import checkpoint

    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(model, None, device="cpu", lr=1e-2, offload=True, param_offload=[0])
    adapter = model._trainstream_engine.adapter
    for i in range(3):
        checkpoint(model, batch(i, "cpu"), use_reentrant=False).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert adapter.passes == 3


@pytest.mark.gpu
@pytest.mark.parametrize("cap_gib", [24, 8, 4])
def test_gpu_defaults_train_the_1_9b_gpt_under_each_cap(cap_gib):
    """wrap() with its defaults, in a fresh process under the cap (the cap is per process)."""
    import json

    case = dict(model="gpt-1.9b", cap_gib=cap_gib, settings=[{}], warmup=4, steps=2)
    proc = subprocess.run(
        [sys.executable, "-m", "trainstream.bench.planner", json.dumps(case)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])[0]
    assert not row.get("oom") and row["peak_GiB"] < cap_gib, row
    assert row["loss"] == row["loss"] and row["mode"] == "offload", row
