"""The planner's choice, table by table: pure byte counts and rates, no engine, no GPU."""

import pytest

from trainstream.planner import BlockBytes, PlanInputs, device_bytes, make_plan
from trainstream.planner.plan import copy_waits, placement_terms

# Four blocks of 100 bytes of weights that cross as 50 (bf16 under autocast) and push 100
# after each update, saving 200 bytes of activations; links of 1000 bytes/s.
BLOCK = dict(weight_bytes=100, crossing_bytes=50, push_bytes=100, act_bytes=200)


def inputs(usable, *, compute=0.5, pageable=(True,) * 4, slowdown=0.15, **kw):
    blocks = [BlockBytes(pageable=p, **BLOCK) for p in pageable]
    base = dict(
        blocks=blocks,
        fixed_bytes=0,
        usable_bytes=usable,
        h2d_bytes_per_s=1000.0,
        d2h_bytes_per_s=1000.0,
        adamw_s=0.01,
        grad_bytes=400,
        outside_push_bytes=0,
        compute_s=compute,
        max_activation_slowdown=slowdown,
    )
    base.update(kw)
    return PlanInputs(**base)


@pytest.mark.parametrize(
    "usable, paged, act_paged, fits, within",
    [
        # everything fits: nothing moves
        (10_000, [], [], True, True),
        # weights 400 + activations 800 + two blocks crossing (100) must fit in 1050: paging
        # three blocks' weights costs no PCIe time (2 x 50 in place of the 100 pushed), while
        # paging activations would double the step: the weights go
        (1050, [0, 1, 2], [], True, True),
        # 700: every block's weights paged is not enough (800 of activations + 100 in flight); one
        # block's activations too: 600 held at the forward's end, 400 when backward fetches it
        # back with one ahead; its 200 bytes go out beside the forward's 200 of weights coming
        # in, but come back only as block 1's backward starts (prefetch_depth 1), behind block
        # 0's weights: backward waits 0.1 s for them, 17% over the same weights without it,
        # past the limit, and still the only placement that fits
        (700, [0, 1, 2, 3], [0], True, False),
        # nothing fits: the plan that needs the least memory, flagged (two blocks' activations
        # paged need no more than four: backward fetches two at a time either way)
        (100, [0, 1, 2, 3], [0, 1], False, False),
    ],
)
def test_the_fastest_placement_that_fits(usable, paged, act_paged, fits, within):
    plan = make_plan(inputs(usable))
    assert (plan.paged, plan.act_paged, plan.fits, plan.within_limit) == (paged, act_paged, fits, within)
    assert plan.device_bytes == device_bytes(inputs(usable), set(paged), set(act_paged))
    assert (plan.device_bytes <= usable) == fits
    # The step said is the placement's own, fitting or not (its weights' waits walked).
    assert plan.step_s == pytest.approx(placement_terms(inputs(usable), paged, act_paged, plan.recompute)["step"])


def test_activation_paging_within_the_slowdown_limit_is_preferred_to_none():
    # Compute-bound (2 s): paging one block's activations (200 bytes each way on top of 400,
    # 0.6 s) hides under compute: no slowdown. 400 of weights + 600 held at the forward's end.
    plan = make_plan(inputs(1000, compute=2.0, pageable=(False,) * 4))
    assert plan.paged == [] and plan.act_paged == [0] and plan.within_limit and plan.act_slowdown == 0.0


def test_unpageable_blocks_keep_their_weights():
    plan = make_plan(inputs(700, pageable=(False, True, True, False)))
    assert not {0, 3} & set(plan.paged)


def test_over_the_slowdown_limit_only_when_nothing_else_fits():
    # Only activations can move (no pageable weights): the step doubles, beyond 15%.
    plan = make_plan(inputs(1000, pageable=(False,) * 4))
    assert plan.fits and plan.act_paged and not plan.within_limit and plan.act_slowdown > 0.15
    # Allowing the slowdown makes it an ordinary choice.
    assert make_plan(inputs(1000, pageable=(False,) * 4, slowdown=5.0)).within_limit


def test_explicit_choices_are_kept():
    plan = make_plan(inputs(700, weights="fixed", fixed_paged=(1, 2)))
    assert plan.paged == [1, 2] and plan.fits
    plan = make_plan(inputs(1050, activations="fixed", fixed_act_paged=(3,)))
    assert plan.act_paged == [3]


def test_host_adamw_bound_makes_paging_free():
    # When the host AdamW takes longer than every transfer, paging activations costs
    # nothing: the step time stays the AdamW's.
    plan = make_plan(inputs(700, adamw_s=5.0))
    assert plan.step_s == 5.0 and plan.act_slowdown == 0.0 and plan.within_limit


def test_describe_gives_the_numbers():
    text = make_plan(inputs(1050)).describe(1050)
    assert "3 blocks' weights paged" in text and "predicted step" in text and "host AdamW" in text


def test_paging_a_blocks_weights_also_frees_autocasts_copies_of_them():
    # Of each block's 200 bytes of activations, 50 are autocast's bf16 copies of its weights:
    # gone once the weights are paged (they arrive in bf16), held even when the activations
    # are paged (autocast keeps them until the forward ends). All resident: 400 + 800 = 1200;
    # in 1050, two paged blocks free 2 x (100 + 50) and hold 100 in flight.
    blocks = [BlockBytes(cast_bytes=50, **BLOCK) for _ in range(4)]
    inp = PlanInputs(
        blocks=blocks,
        fixed_bytes=0,
        usable_bytes=1050,
        h2d_bytes_per_s=1000.0,
        d2h_bytes_per_s=1000.0,
        adamw_s=0.01,
        grad_bytes=400,
        outside_push_bytes=0,
        compute_s=0.5,
    )
    plan = make_plan(inp)
    assert plan.paged == [0, 1] and plan.act_paged == [] and plan.device_bytes == 1000
    assert plan.device_bytes == device_bytes(inp, {0, 1}, set())
    # Autocast holds the copies until the forward ends, activations paged or not: paging the
    # weights of a block whose activations are paged still frees them (100 + 50 freed, 2 x 50
    # held in flight).
    assert device_bytes(inp, {0}, {0}) == device_bytes(inp, set(), {0}) - 50


def test_the_logits_and_fetched_activations_are_never_counted_as_held_at_once():
    # 300 bytes after the stack (the logits, the loss) sit on top of the activations held at
    # the end of the forward; backward fetching a paged block's back (one ahead: 2 x 200)
    # comes after them, above the not-paged activations of the blocks before it.
    inp = inputs(10_000, after_stack_bytes=300)
    assert device_bytes(inp, set(), set()) == 400 + 800 + 300
    assert device_bytes(inp, set(), {0, 1, 2, 3}) == 400 + max(300, 2 * 200)
    assert device_bytes(inp, set(), {0, 1}) == 400 + max(2 * 200 + 300, 2 * 200)
    # Paged at the back, backward reaches them first, with blocks 0 and 1's still held.
    assert device_bytes(inp, set(), {2, 3}) == 400 + 2 * 200 + 2 * 200
    # The plan counts the same way: in 1000, all resident (1500) does not fit.
    plan = make_plan(inputs(1000, after_stack_bytes=300))
    assert (
        plan.fits
        and plan.device_bytes
        == device_bytes(inputs(1000, after_stack_bytes=300), set(plan.paged), set(plan.act_paged))
        <= 1000
    )


def test_backward_fetches_a_paged_block_with_the_one_ahead_of_it_above_what_is_still_held():
    # Uneven blocks, one fetched ahead (prefetch_depth 1), 100 bytes after the stack of which
    # 50 are still held in backward (a caller's logits). At block 2's backward: blocks 1 and
    # 2 fetched back (400 + 200), block 0's not-paged 200 still held, and the head's 50.
    blocks = [
        BlockBytes(weight_bytes=100, crossing_bytes=50, push_bytes=100, act_bytes=a) for a in (200, 400, 200, 200)
    ]
    inp = PlanInputs(
        blocks=blocks,
        fixed_bytes=0,
        usable_bytes=10_000,
        h2d_bytes_per_s=1000.0,
        d2h_bytes_per_s=1000.0,
        adamw_s=0.01,
        grad_bytes=400,
        outside_push_bytes=0,
        after_stack_bytes=100,
        held_after_stack_bytes=50,
    )
    weights = 400
    assert device_bytes(inp, set(), {1, 2}) == weights + max(200 + 200 + 100, 200 + 400 + 200 + 50)
    # Not side by side ({0, 2}): at its own backward block 2 is fetched alone, above block 1's
    # 400 (not paged): 600. But it is fetched ahead already as block 3's backward starts, while
    # block 3's own 200 is still held: 400 (block 1) + 200 (block 3) + 200 (block 2, ahead) + 50
    # (the head) = 850, above the forward's end (400 + 200 + 100 = 700). (700 before: the start of
    # a kept block's backward was counted without the paged activations fetched ahead below it.)
    assert device_bytes(inp, set(), {0, 2}) == weights + max(400 + 200 + 100, 400 + 200 + 200 + 50)


def test_a_kept_or_recomputed_blocks_backward_holds_the_paged_activations_fetched_ahead_below_it():
    # As any block's backward starts, the engine fetches the paged activations of the
    # prefetch_depth blocks below it, whatever the block's own mode. Four blocks of 200, 20 of
    # inputs each, 100 after the stack of which 50 are held in backward; weights 400.
    blocks = [
        BlockBytes(weight_bytes=100, crossing_bytes=50, push_bytes=100, act_bytes=200, input_bytes=20) for _ in range(4)
    ]
    inp = PlanInputs(
        blocks=blocks,
        fixed_bytes=0,
        usable_bytes=10_000,
        h2d_bytes_per_s=1000.0,
        d2h_bytes_per_s=1000.0,
        adamw_s=0.01,
        grad_bytes=400,
        outside_push_bytes=0,
        after_stack_bytes=100,
        held_after_stack_bytes=50,
    )
    weights = 400
    # Block 3 recomputed above block 2 paged: as block 3's backward starts, blocks 0 and 1 keep
    # 400, block 3's activations are back (200) beside its inputs (20, the checkpoint's) and block
    # 2's arrive ahead (200), the head 50: 870, above the forward's end (400 + 20 + 100). (Counted
    # 650 before: block 2's backward alone.)
    assert device_bytes(inp, set(), {2}, {3}) == weights + 400 + 20 + 200 + 200 + 50
    # Block 3 kept above blocks 1 and 2 paged, two fetched ahead: 200 + 200 kept, 2 x 200 ahead, 50.
    inp.prefetch_depth = 2
    assert device_bytes(inp, set(), {1, 2}) == weights + 400 + 2 * 200 + 50


def test_before_any_forward_is_timed_blocks_are_paged_where_recomputing_them_does_not_fit():
    # [Note: recompute before timing]. Four resident blocks of 100 saving 200 from 50 of inputs,
    # 500 after the stack. Every block recomputed keeps 4 x 50 to the forward's end: 400 + 200 +
    # 500 = 1100. In 1000 two of them are paged instead (keeping none: 400 + 100 + 500; block 3's
    # backward: 100 kept, its 200 fetched with block 2's 200 ahead), the front ones recomputed.
    # (Before, the only option under 1100 was none: the plan did not fit, and ran out of memory.)
    def inp(usable):
        return PlanInputs(
            blocks=[BlockBytes(pageable=False, input_bytes=50, **BLOCK) for _ in range(4)],
            fixed_bytes=0,
            usable_bytes=usable,
            h2d_bytes_per_s=1000.0,
            d2h_bytes_per_s=1000.0,
            adamw_s=0.01,
            grad_bytes=400,
            outside_push_bytes=0,
            compute_s=0.5,
            recompute=True,
            after_stack_bytes=500,
        )

    plan = make_plan(inp(1100))
    assert (plan.act_paged, plan.recompute, plan.fits) == ([], [0, 1, 2, 3], True)
    plan = make_plan(inp(1000))
    assert (plan.act_paged, plan.recompute, plan.fits) == ([2, 3], [0, 1], True)
    assert plan.device_bytes == device_bytes(inp(1000), set(), {2, 3}, {0, 1}) == 400 + 2 * 50 + 500
    # Every block paged: 400 + 500 at the forward's end, 400 + 2 x 200 in backward.
    plan = make_plan(inp(900))
    assert (plan.act_paged, plan.recompute, plan.fits, plan.device_bytes) == ([0, 1, 2, 3], [], True, 900)


# -- copies in the pipeline ([Note: copies in the pipeline]) ---------------------------------------


def three_blocks(**kw):
    # Three blocks with a 1 s forward and a 1 s backward each; block 0's activations take 2 s
    # each way; weights resident and crossing in 0.5 s when paged.
    blocks = [
        BlockBytes(weight_bytes=100, crossing_bytes=500, push_bytes=0, act_bytes=2000, forward_s=1.0) for _ in range(3)
    ]
    base = dict(
        blocks=blocks,
        fixed_bytes=0,
        usable_bytes=10**9,
        h2d_bytes_per_s=1000.0,
        d2h_bytes_per_s=1000.0,
        adamw_s=0.0,
        grad_bytes=0,
        outside_push_bytes=0,
        compute_s=6.0,
        backward_per_forward=1.0,
    )
    base.update(kw)
    return PlanInputs(**base)


def test_a_forward_waits_for_copies_past_the_inflight_limit():
    # Block 0's copy out (2 s) runs under blocks 1 and 2's forwards: no wait. With 500 bytes
    # in flight at most, block 0 cannot end before its copy is within 0.5 s of done (1.5 s):
    # 0.5 s waited. Backward fetches block 0's activations as block 1's starts (1 s into it),
    # 2 s: block 0 waits 1 s for them either way.
    assert copy_waits(three_blocks(), {0}, set()) == pytest.approx((0.0, 1.0))
    assert copy_waits(three_blocks(inflight_bytes=500), {0}, set()) == pytest.approx((0.5, 1.0))
    # Fetched two blocks ahead (as block 2's backward starts), it is in as block 0 starts.
    assert copy_waits(three_blocks(prefetch_depth=2), {0}, set()) == pytest.approx((0.0, 0.0))
    # Block 1 recomputed above it: its backward is 2 s, the fetch hides under it.
    assert copy_waits(three_blocks(), {0}, {1}) == pytest.approx((0.0, 0.0))
    # The terms add the waits to each phase's compute (3 s, then 3 s).
    terms = placement_terms(three_blocks(inflight_bytes=500), [], [0], [])
    assert (terms["forward"], terms["backward"]) == pytest.approx((3.5, 4.0))


def test_paged_weights_share_the_link_with_the_activations_fetched_in_backward():
    # Every block's weights paged (0.5 s each): in forward, block 0 waits for its own (0.5 s);
    # the next ones come while the block before computes. The last block keeps its weights
    # into its backward; the others come while the block above runs its backward. Block 0's
    # activations are fetched behind its weights as block 1's backward starts (at 1 s): in at
    # 3.5 s, where block 0 would start at 2 s: 1.5 s waited, where without the weights on the
    # link 1 s (test above).
    inp = three_blocks()
    assert copy_waits(inp, set(), set(), {0, 1, 2}) == pytest.approx((0.5, 0.0))
    assert copy_waits(inp, {0}, set(), {0, 1, 2}) == pytest.approx((0.5, 1.5))
    assert copy_waits(inp, set(), set(), {2}) == (0.0, 0.0)


def test_paged_blocks_are_spread_among_recomputed_ones():
    # A 14B LoRA's proportions under a 24 GiB cap (hf row 6 on the H100): 48 blocks, 640 MiB of
    # activations each, 20 MiB of inputs, a 5.5 ms forward and 1.03 forwards of backward, links
    # of 54.5 GB/s, 1 GiB in flight; room for 8 blocks' activations. The plan of 4b9b533 paged 22
    # blocks in runs of up to ten between 18 recomputed, predicted 635 ms and stepped 905 ms:
    # walked block by block it waits for its copies in both phases.
    MiB, GiB = 2**20, 2**30
    blocks = [
        BlockBytes(
            weight_bytes=147 * MiB,
            crossing_bytes=147 * MiB,
            push_bytes=0,
            act_bytes=640 * MiB,
            input_bytes=20 * MiB,
            forward_s=0.0055,
            backward_bytes=300 * MiB,
        )
        for _ in range(48)
    ]
    inp = PlanInputs(
        blocks=blocks,
        fixed_bytes=int(6.5 * GiB),
        usable_bytes=int(21.6 * GiB),
        h2d_bytes_per_s=54.5e9,
        d2h_bytes_per_s=54.8e9,
        adamw_s=0.0,
        grad_bytes=0,
        outside_push_bytes=0,
        compute_s=48 * 0.0055 * 2.03 + 0.03,
        backward_per_forward=1.03,
        recompute=True,
        inflight_bytes=GiB,
        after_stack_bytes=int(1.5 * GiB),
        held_after_stack_bytes=int(0.5 * GiB),
        weights="fixed",
    )
    then_paged = [0, 1, 5, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 29, 31, 32, 33, 35, 36, 37, 38, 39]
    then_recomputed = [2, 3, 4, 6, 7, 8, 9, 10, 21, 22, 23, 24, 25, 26, 27, 28, 30, 34]
    forward_wait, backward_wait = copy_waits(inp, set(then_paged), set(then_recomputed))
    assert forward_wait > 0.05 and backward_wait > 0.1
    then = placement_terms(inp, [], then_paged, then_recomputed)["step"]
    everything_recomputed = placement_terms(inp, [], [], list(range(40)))["step"]
    plan = make_plan(inp)
    assert plan.fits and plan.act_paged and plan.recompute
    # No two paged blocks side by side: each comes back while the recomputed block above it runs.
    assert not {i + 1 for i in plan.act_paged} & set(plan.act_paged)
    assert plan.step_s < 0.85 * then and plan.step_s < 0.95 * everything_recomputed


def test_a_search_cut_at_max_walks_says_so(monkeypatch):
    # Weights crossing in 1 s each, 100 bytes of inputs kept by a recomputed block, room for
    # one block's activations: the pair first by its bound walks slower than the next one's
    # bound. Cut at one walk, the plan says it is the best of those walked.
    import trainstream.planner.plan as plan_module

    inp = three_blocks(usable_bytes=4200, recompute=True, weights="auto")
    for x in inp.blocks:
        x.crossing_bytes, x.input_bytes = 1000, 100
    full = make_plan(inp)
    assert not full.search_cut and "the search was cut" not in full.describe(inp.usable_bytes)
    monkeypatch.setattr(plan_module, "MAX_WALKS", 1)
    cut = make_plan(inp)
    assert cut.search_cut and "the best of the first 1 placements walked" in cut.describe(inp.usable_bytes)
