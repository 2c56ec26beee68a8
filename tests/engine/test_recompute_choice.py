"""Recompute or page, on the costs a step really pays ([Note: step phases] in planner/plan.py):
paged activations go out during the forward and come back during backward, so their PCIe
time hides only under the compute of its own phase; backward's compute is what the blocks'
trainable matrices make it (a frozen base's LoRA: about one forward, not two). On tables in
the 7B LoRA's proportions, and on a transformers decoder stack (the real call: keywords,
position embeddings, no cache) under simulated times: where PCIe is slow against compute the
plan recomputes, where it is fast it pages, and the events say per block which and why."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import machine, planned_recompute

import trainstream
from engine.test_recompute import SimulatedTimes, _block_of, _first_leaf
from trainstream.engine.adapt import backward_per_forward
from trainstream.planner import BlockBytes, PlanInputs, make_plan
from trainstream.planner.plan import device_bytes, paging_s, placement_terms

GB = 1e9


def lora_7b(forward_s: float, *, link=55 * GB, usable=5 * 2**30) -> PlanInputs:
    """The bench's Qwen2.5-7B LoRA under 8 GiB (benchmarks/results/lora-nvidia-h200.*): 28
    blocks of 122 MB of NF4 codes saving 670 MB of activations each from 15 MB of inputs, a
    LoRA's backward (one forward's worth), 55 GB/s each way; `forward_s` per block."""
    bpf = 1.004
    blocks = [
        BlockBytes(
            weight_bytes=122_000_000,
            crossing_bytes=122_000_000,
            push_bytes=0,
            act_bytes=670_000_000,
            input_bytes=15_000_000,
            forward_s=forward_s,
        )
        for _ in range(28)
    ]
    return PlanInputs(
        blocks=blocks,
        fixed_bytes=2_500_000_000,
        usable_bytes=usable,
        h2d_bytes_per_s=link,
        d2h_bytes_per_s=link,
        adamw_s=0.0,
        grad_bytes=80_000_000,
        outside_push_bytes=0,
        compute_s=(1.0 + bpf) * forward_s * 28,
        backward_per_forward=bpf,
        recompute=True,
    )


@pytest.mark.parametrize("forward_ms", [3.6, 7.7], ids=["kernels", "launch-bound"])
def test_the_7b_lora_recomputes_where_paging_every_activation_was_chosen(forward_ms):
    # On the H200 the plan paged all 28 blocks' weights and activations (0.875 s/step, the
    # sum of 18.8 GB out and 18.8 GB in at 55 GB/s, 0.68 s) where recomputing every block
    # costs one forward each (3.6 ms of kernels; 7.7 ms as a forward launched at the 0.47 GPU
    # busy share the suite measured). One max over the step hid that paging under a compute of
    # three forwards a block; the phases show it.
    inp = lora_7b(forward_ms / 1e3)
    every = list(range(28))
    paged_all = placement_terms(inp, every, every, [])
    assert paged_all["forward"] >= 28 * 670e6 / (55 * GB) and paged_all["backward"] >= 28 * 670e6 / (55 * GB)
    assert paged_all["step"] == pytest.approx(0.75, abs=0.01)
    # The plan recomputes the blocks whose paging its phases' compute cannot hide (most of
    # them when a forward is cheap) and pages the others: well under paging them all, and
    # under recomputing them all. (Launch-bound: 0.71 of paging them all, where the phases
    # alone, each paged block's fetch not waited for, predicted under 0.7.)
    plan = make_plan(inp)
    assert plan.fits and len(plan.recompute) >= (15 if forward_ms == 3.6 else 5)
    assert plan.step_s < (0.4 if forward_ms == 3.6 else 0.75) * paged_all["step"]
    assert plan.step_s < placement_terms(inp, plan.paged, [], every)["step"]


def test_the_7b_lora_pages_where_its_link_is_fast_against_its_compute():
    # The same blocks behind links ten times faster: their activations' way out and back hides
    # under each phase's compute, where a recompute would add to it.
    inp = lora_7b(7.7e-3, link=550 * GB)
    plan = make_plan(inp)
    assert plan.fits and plan.recompute == [] and len(plan.act_paged) >= 20
    assert plan.step_s == pytest.approx(inp.compute_s, rel=0.01)


def test_a_block_that_must_not_be_recomputed_is_paged_by_the_plan():
    # A call that carries a key/value cache (or a BatchNorm in training) is paged by the engine
    # whatever the plan says (recompute_call.py); the plan counts it paged, settled or not.
    inp = lora_7b(3.6e-3)
    inp.blocks[0].recomputable = False
    inp.blocks[1].recomputable = False
    plan = make_plan(inp)
    assert {0, 1} <= set(plan.act_paged) and not {0, 1} & set(plan.recompute) and len(plan.recompute) >= 15
    plan = make_plan(dataclasses.replace(inp, settled={0: "recompute", 1: "recompute"}))
    assert {0, 1} <= set(plan.act_paged) and not {0, 1} & set(plan.recompute)


def test_backward_per_forward_counts_the_trainable_matrices():
    # Every matrix's input gradient, and the weight gradient of the trainable ones: a full
    # fine-tune's backward is two forwards, a LoRA's on a frozen base about one; the adapter's
    # compute base and the plan's split of it use that figure.
    from models import tiny_gpt

    model, _, _ = tiny_gpt()
    model, _ = trainstream.wrap(model, None, device="cpu", offload=True, activation_offload="auto", profile=machine())
    adapter = model._trainstream_engine.adapter
    assert backward_per_forward(adapter.block_units) == 2.0
    adapter.block_s = {b: 0.01 for b in range(len(adapter.block_units))}
    assert adapter.compute_s() == pytest.approx(3 * 0.01 * len(adapter.block_units))
    model, _ = trainstream.wrap(lora_qwen2(), None, device="cpu", offload=True, activation_offload="auto")
    adapter = model._trainstream_engine.adapter
    bpf = backward_per_forward(adapter.block_units)
    assert 1.0 < bpf < 1.2 and adapter._inputs(0).backward_per_forward == bpf
    adapter.block_s = {b: 0.01 for b in range(len(adapter.block_units))}
    assert adapter.compute_s() == pytest.approx((1 + bpf) * 0.01 * len(adapter.block_units))


def timed_backwards(monkeypatch, *, recomputed=(), activation_offload="auto", forward_hook=None, each_step=None):
    """A 4-block GPT (every weight trainable: backward estimated at two forwards) run 4 steps on
    simulated times, `recomputed` blocks recomputed from wrap() on: each block's forward 4 ms
    after a 2 ms wait for its weights, its backward 5.2 ms (1.3 forwards), each paged
    activation's unpack waiting 3 ms for its copy. `forward_hook(times)`: the blocks' forward
    pre-hook in place of times.run_forward; `each_step(i, adapter)`: called before step i.
    Returns (the adapter, the times, the number of paged unpacks)."""
    from models import tiny_gpt

    times = SimulatedTimes()
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    for name, module in model.named_modules():
        block = _block_of(model, name)
        if block is not None and name == block[0] + "." + _first_leaf(block[1]):
            module.register_forward_pre_hook(forward_hook(times) if forward_hook else times.run_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    with planned_recompute(monkeypatch, list(recomputed)):
        model, opt = trainstream.wrap(
            model,
            opt,
            device="cpu",
            offload=True,
            param_offload=False,
            activation_offload=activation_offload,
            min_offload_bytes=0,  # a tiny GPT's saved tensors are paged too
            profile=machine(),
        )
        engine = model._trainstream_engine
        times.hook_engine(engine)
        times.forward, times.wait, times.backward, times.act_wait = 0.004, 0.002, 0.0052, 0.003
        unpacks = []
        unpack = engine.acts.unpack
        engine.acts.unpack = lambda packed: unpacks.append(1) or unpack(packed)
        for i in range(4):
            if each_step is not None:
                each_step(i, engine.adapter)
            loss_fn(model, batch(i, "cpu")).backward()
            opt.step()
            opt.zero_grad()
    return engine.adapter, times, len(unpacks)


@pytest.mark.parametrize("case", ["recomputed", "paged"])
def test_each_blocks_backward_is_timed_without_its_recompute_or_its_waits_and_reaches_the_plan(case, monkeypatch):
    # Backward was estimated from the trainable share (2 forwards here, about 1 for a LoRA,
    # where the H200 ran a 7B LoRA's backward at 1.29): each block's is timed from when its
    # weights are there to when backward reaches the block below, without a recomputed
    # block's forward again (and its weights' guard: the plan counts that forward apart, as
    # forward_s) or the waits for its paged activations' copies (PCIe time), and the plan
    # splits the compute by the timed ratio.
    if case == "recomputed":
        adapter, times, unpacks = timed_backwards(monkeypatch, recomputed=[0, 1, 2])
        assert adapter.recomputed() == [0, 1, 2] and unpacks == 0
    else:
        adapter, times, unpacks = timed_backwards(monkeypatch, activation_offload=True)
        assert adapter.current()[1] == [0, 1, 2, 3] and unpacks > 0
    n = len(adapter.block_units)
    assert adapter.backward_per_forward == 2.0  # the estimate, replaced once timed
    assert sorted(adapter.block_s) == sorted(adapter.block_backward_s) == list(range(n))
    assert all(s == pytest.approx(times.forward) for s in adapter.block_s.values())
    assert all(s == pytest.approx(times.backward) for s in adapter.block_backward_s.values()), adapter.block_backward_s
    inp = adapter._inputs(0)
    assert inp.backward_per_forward == pytest.approx(1.3)
    assert inp.compute_s == pytest.approx((times.forward + times.backward) * n)
    # The plan's phases: the forward's compute is the forwards, backward's the timed backwards.
    terms = placement_terms(inp, [], [], [])
    assert terms["forward"] == pytest.approx(times.forward * n)
    assert terms["backward"] == pytest.approx(times.backward * n)
    (said,) = [h for h in adapter.history if h["kind"] == "timing"]  # once, at the first timed step
    assert said["step"] == 2 and said["backward_per_forward"] == pytest.approx(1.3) and said["estimated"] == 2.0
    assert "backward timed: 1.30 forwards per block (median 5.20 ms against a forward's 4.00 ms" in said["message"]


def lora_qwen2(layers: int = 3):
    """A tiny Qwen2 (transformers' decoder layers, called with keywords) with peft's LoRA on
    every block Linear, its base frozen."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=64,
    )
    config.use_cache = False  # as the bench and a training run set it (a cache refuses recompute)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return peft.get_peft_model(model, lora)


def settle_qwen2(forward_share: float, steps: int = 5):
    """An 8-layer LoRA Qwen2 with NF4 base weights, every option at its default, on 10 MB/s
    links with room for two blocks' activations (six must leave); each block's forward takes
    `forward_share` of the time its activations take one way. Returns (each step's recomputed
    and activation-paged blocks, the losses, the forwards run in the last step, the report)."""
    times = SimulatedTimes()
    model = lora_qwen2(layers=8)
    forwards = []
    for name, module in model.named_modules():
        block = _block_of(model, name)
        if block is not None and name == block[0] + "." + _first_leaf(block[1]):
            module.register_forward_pre_hook(times.run_forward)
            module.register_forward_pre_hook(lambda m, a: forwards.append(1))
    link = dataclasses.replace(machine(), h2d_bytes_per_s=1e7, d2h_bytes_per_s=1e7)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cpu", offload=True, quantize="nf4", profile=link)
    engine = model._trainstream_engine
    adapter = engine.adapter
    times.hook_engine(engine)
    ids = torch.randint(0, 101, (4, 32), generator=torch.Generator().manual_seed(1))
    chosen, losses = [], []
    for i in range(steps):
        forwards.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        if i == 0:  # the activations are measured now; the first replan (at step()) reads the room
            inp = adapter._inputs(0)
            x = inp.blocks[0]
            adapter.usable = device_bytes(inp, set(), set()) - 6 * x.act_bytes + 6 * x.input_bytes
            times.forward = forward_share * paging_s(inp, x)
            # Backward as the trainable share estimates it, so the timed plan weighs the same compute.
            times.backward = adapter.backward_per_forward * times.forward
        opt.step()
        opt.zero_grad()
        params = trainstream.memory_report(model)["params"]
        chosen.append((params["recompute_blocks"], params["activation_paged_blocks"]))
    return chosen, losses, len(forwards), trainstream.memory_report(model)


def test_a_transformers_decoder_stack_recomputes_where_paging_is_slow_and_pages_where_it_is_fast():
    # Paging one block's activations takes two and a half of its forwards each way, or a third
    # of one. Slow: a paged block's fetch hides only under the backward of a recomputed block
    # above it (its recompute and its backward, 2.1 forwards), so every other block is paged.
    slow_chosen, slow_losses, slow_forwards, slow = settle_qwen2(forward_share=0.4)
    fast_chosen, fast_losses, fast_forwards, fast = settle_qwen2(forward_share=3.0)
    # The first step, nothing timed: six blocks recomputed ([Note: recompute before timing]).
    assert slow_chosen[0] == fast_chosen[0] == ([0, 1, 2, 3, 4, 5], [])
    recomputed, paged = slow_chosen[-1]
    assert (recomputed, paged) == ([1, 3, 5], [0, 2, 4]), slow_chosen
    assert all(c == slow_chosen[1] for c in slow_chosen[1:]), slow_chosen
    assert fast_chosen[-1][0] == [] and fast_chosen[-1][1], fast_chosen
    # The decoder layers' calls (keywords, position embeddings, use_cache=False) really ran
    # under the engine's checkpoint: one forward more per recomputed block, nothing refused.
    assert slow_forwards == 8 + len(recomputed) and fast_forwards == 8
    assert "instead of recomputed" not in slow["events"]
    # Each replan on timed forwards says per block what it chose, against what.
    (why,) = [h for h in slow["plan"]["history"] if h["kind"] == "recompute"]
    assert "recompute: blocks 1, 3, 5 recomputed in backward, blocks 0, 2, 4 paged" in why["message"]
    assert "Per block:" in why["message"] and "all 6 paged:" in why["message"]
    assert sorted(why["per_block"]) == [0, 1, 2, 3, 4, 5]
    assert {b: v["mode"] for b, v in why["per_block"].items()} == {
        b: "recomputed" if b in recomputed else "paged" for b in range(6)
    }
    assert why["predicted_step_s"] < why["all_paged_step_s"] and why["predicted_step_s"] < why["all_recomputed_step_s"]
    (why,) = [h for h in fast["plan"]["history"] if h["kind"] == "recompute"]
    assert why["message"].startswith("recompute: no block is recomputed from the next step on; blocks ")
    assert why["predicted_step_s"] < why["all_recomputed_step_s"]
    # Recompute and paging change no bit.
    assert slow_losses == fast_losses


def test_the_plan_learns_which_blocks_the_engine_refused_to_recompute(monkeypatch):
    # A decoder layer called with use_cache=True (the configs' default) is paged instead of
    # recomputed from its first call on; the adapter's plan inputs say so, so no replan counts
    # its recompute again.
    from helpers import planned_recompute

    model = lora_qwen2()
    model.base_model.model.config.use_cache = True
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    with planned_recompute(monkeypatch, [0, 2]):
        model, _ = trainstream.wrap(model, None, device="cpu", offload=True, activation_offload="auto")
        model(input_ids=ids, labels=ids).loss.backward()
    adapter = model._trainstream_engine.adapter
    assert "use_cache=True" in trainstream.memory_report(model)["events"]
    assert [x.recomputable for x in adapter._inputs(0).blocks] == [False, True, False]


def test_a_replan_that_brings_every_blocks_activations_back_says_so():
    from models import tiny_gpt

    model, _, _ = tiny_gpt()
    model, _ = trainstream.wrap(model, None, device="cpu", offload=True, activation_offload="auto", profile=machine())
    adapter = model._trainstream_engine.adapter
    adapter.block_s = {b: 0.01 for b in range(len(adapter.block_units))}
    adapter._explain_leaving(make_plan(adapter._inputs(0)), [], [], [])
    assert trainstream.memory_report(model)["events"].endswith("every block keeps its activations")


@pytest.mark.gpu
def test_gpu_each_blocks_backward_is_timed_on_events_without_its_recompute(monkeypatch):
    """On the GPU each block's backward is timed with CUDA events on the compute stream (read
    after the step), its weights' wait (paged weights) and, for blocks 1-2, the recompute of its
    forward taken off: a full fine-tune's backward (an input and a weight gradient per matrix)
    is about two forwards, and a recomputed block's about a kept one's (with its recompute
    counted in, it would be about 1.5 of them)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=512,
        max_position_embeddings=2048,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with planned_recompute(monkeypatch, [1, 2]):
        model, opt = trainstream.wrap(model, opt, device="cuda", offload=True, param_offload=True)
        for i in range(4):
            x = torch.randint(0, 512, (8, 1024), generator=torch.Generator().manual_seed(i)).cuda()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    adapter = model._trainstream_engine.adapter
    assert adapter.recomputed() == [1, 2]
    assert sorted(adapter.block_backward_s) == [0, 1, 2, 3]
    ratio = adapter.backward_ratio()
    assert 1.0 < ratio < 4.0, (adapter.block_s, adapter.block_backward_s)
    assert adapter._inputs(0).backward_per_forward == ratio
    b = adapter.block_backward_s
    assert max(b[1], b[2]) < 1.3 * min(b[0], b[3]), b  # block 0's backward ends with the pass: not less
    trainstream.unwrap(model)


def test_a_pass_that_pins_new_activation_slabs_is_not_timed(monkeypatch):
    # On the H200 the 7B LoRA's first pass that paged activations pinned their slabs inside
    # its blocks' forwards: each read 296 ms where 6 ms is its own, and recomputing a block
    # looked fifty times dearer than it is. Such a pass gives no times; the next one does.
    pinning, pinned, timed_after = [False], [0], []

    def pinning_forward(times):
        def forward(module, args):
            times.run_forward(module, args)
            if pinning[0]:
                times.now += 0.3  # fresh host memory pinned for the block's activations
                pinned[0] += 1

        return forward

    def each_step(i, adapter):
        if i == 0:
            slabs = adapter.slab_bytes
            adapter.slab_bytes = lambda: slabs() + pinned[0]
        else:
            timed_after.append(dict(adapter.block_s))
        pinning[0] = i == 1  # the first timed pass pins

    adapter, _, _ = timed_backwards(
        monkeypatch, activation_offload=True, forward_hook=pinning_forward, each_step=each_step
    )
    assert timed_after[0] == {}  # the first pass is never timed
    assert timed_after[1] == {}  # the pinning pass: no times (before: 0.304 s a block)
    assert timed_after[2] and all(s == pytest.approx(0.004) for s in timed_after[2].values())
    assert any("pinned new activation slabs is not timed" in h["message"] for h in adapter.history)
