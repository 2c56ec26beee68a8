"""The adapter keeps a placement whose measured peak fits when no placement is predicted to
fit (device memory simulated, the CPU path)."""

from helpers import AUTO, FakeDevice, machine
from models import tiny_mlp

import trainstream
import trainstream.engine.adapt as adapt

MiB = 1 << 20


def _history(model, kind):
    return [h for h in trainstream.memory_report(model)["plan"]["history"] if h["kind"] == kind]


def _wrapped(monkeypatch, measured_peak):
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(
        model, None, device="cpu", lr=1e-2, offload=True, **AUTO, profile=machine(vram_gib=8 / 1024)
    )
    adapter = model._trainstream_engine.adapter
    fake = FakeDevice(adapter, measured_peak(adapter))
    fake.rises = True
    real = adapt.make_plan

    def predicted_past_the_card(inputs):  # every placement predicted a card's worth too large
        inputs.fixed_bytes += inputs.usable_bytes
        return real(inputs)

    monkeypatch.setattr(adapt, "make_plan", predicted_past_the_card)

    def step(i):
        loss = loss_fn(model, batch(i, "cpu"))
        if fake.rises:  # the counter reads this step's own peak
            fake.peak += 1
        loss.backward()
        opt.step()
        opt.zero_grad()

    return model, step, fake


def test_a_measured_fit_is_kept_when_no_placement_is_predicted_to_fit(monkeypatch):
    model, step, _ = _wrapped(monkeypatch, lambda adapter: 2 * MiB)
    before = trainstream.memory_report(model)["params"]
    for i in range(4):
        step(i)
    after = trainstream.memory_report(model)["params"]
    assert after["paged_blocks"] == before["paged_blocks"]
    assert after["activation_paged_blocks"] == before["activation_paged_blocks"]
    kept = [h["message"] for h in _history(model, "warning") if "no placement is predicted to fit" in h["message"]]
    assert kept and all(m.endswith("but the current one measured 0.00 GiB: kept") for m in kept), kept
    assert not _history(model, "replan")


def test_a_measured_misfit_still_pages_as_much_as_possible(monkeypatch):
    model, step, _ = _wrapped(monkeypatch, lambda adapter: adapter.usable + MiB)
    for i in range(4):
        step(i)
    warnings = [h["message"] for h in _history(model, "warning")]
    assert "no placement is predicted to fit; paging as much as possible" in warnings
    assert _history(model, "replan")


def test_a_peak_sampled_under_an_earlier_higher_counter_is_not_taken_as_a_fit(monkeypatch):
    """The device's peak counter was set before wrap() (a model on the card first) and never
    rises: the adapter only samples its blocks' boundaries, which miss the head's peak, so no
    measured fit can be claimed (review R8 #2); the plan pages as much as it can."""
    model, step, fake = _wrapped(monkeypatch, lambda adapter: 2 * MiB)
    fake.peak, fake.rises = model._trainstream_engine.adapter.usable + 64 * MiB, False
    for i in range(4):
        step(i)
    warnings = [h["message"] for h in _history(model, "warning")]
    assert not any(m.endswith(": kept") for m in warnings), warnings
    assert "no placement is predicted to fit; paging as much as possible" in warnings


def test_a_prediction_measured_too_high_is_taken_off_when_nothing_fits(monkeypatch):
    """Every prediction carries the same overstatement (here a card's worth): nothing fits as
    predicted, but the current placement's measured peak says by how much they are high, and
    with that taken off the blocks paged at wrap() (half the card held back for unmeasured
    activations) come back, as they do where the predictions are right."""
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(
        model, None, device="cpu", lr=1e-2, offload=True, **AUTO, profile=machine(vram_gib=3 / 1024)
    )
    adapter = model._trainstream_engine.adapter
    assert trainstream.memory_report(model)["params"]["paged_blocks"]  # paged at wrap()
    fake = FakeDevice(adapter, 256 * 1024)
    real = adapter._inputs

    def overstated(correction, *args, **kwargs):
        inputs = real(correction, *args, **kwargs)
        inputs.fixed_bytes += inputs.usable_bytes
        return inputs

    monkeypatch.setattr(adapter, "_inputs", overstated)
    for i in range(4):
        loss = loss_fn(model, batch(i, "cpu"))
        fake.peak += 1  # the counter reads each step's own peak
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert trainstream.memory_report(model)["params"]["paged_blocks"] == []
    warnings = [h["message"] for h in _history(model, "warning")]
    assert any("in place of its prediction" in m for m in warnings), warnings
    assert "no placement is predicted to fit; paging as much as possible" not in warnings
