"""memory_report() and the events log: the plan explained, and each decision printed under
verbose=True."""

from helpers import AUTO, machine, train
from models import tiny_mlp

import trainstream


def test_memory_report_explains_the_plan():
    _, _, (model, _) = train("gpt", dict(param_offload=[1, 3], activation_offload=0.5), steps=1)
    report = trainstream.memory_report(model)
    assert report["mode"] == "offload"
    assert report["params"] == {
        "paged_blocks": [1, 3],
        "resident_blocks": [0, 2],
        "activation_paged_blocks": [0, 1],
        "recompute_blocks": [],
        "quantize": "none",
    }
    assert "block stack 'layers': 4 x Block" in report["events"]
    assert report["plan"]["history"] == [] and report["peaks"]["steps"] == 1
    # The paged activations' pinned pool, as the pager holds it.
    assert report["activation_slab_bytes"] == model._trainstream_engine.acts.slab_bytes


def test_verbose_prints_each_decision_as_it_happens(capsys):
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(
        model, None, device="cpu", offload=True, verbose=True, **AUTO, profile=machine(vram_gib=3 / 1024)
    )
    at_wrap = capsys.readouterr().out
    assert "trainstream: plan at wrap()" in at_wrap and "blocks paged" in at_wrap
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()  # the first step's replan is printed, and applied, by the step that made it
    after_step = capsys.readouterr().out
    assert "trainstream: settling: measured peak" in after_step
    assert "trainstream: weights paged for blocks []" in after_step
    # The events log holds the same lines, time-stamped.
    events = trainstream.memory_report(model)["events"]
    assert all(
        line.split("trainstream: ", 1)[1] in events
        for line in (at_wrap + after_step).splitlines()
        if line.startswith("trainstream: ")
    )


def test_wrap_events_follow_the_decisions_in_order():
    """The wrap() events: the stack, the profile, the placement, the moments, the optimizer,
    offload='auto', quantization."""
    model, _, _ = tiny_mlp()
    model, _ = trainstream.wrap(model, None, device="cpu", profile=machine())
    lines = trainstream.memory_report(model)["events"].splitlines()

    def first(text):
        return next(i for i, line in enumerate(lines) if text in line)

    order = ["block stack", "hardware profile", "plan at wrap()", "weights:", "moment_dtype='auto'", "optimizer:"]
    order += ["offload='auto': after", "quantize='auto'"]
    assert [first(t) for t in order] == sorted(first(t) for t in order)
