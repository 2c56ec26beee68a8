"""trainstream.plot_memory: the PNG timeline of a run's memory (each step's measured peak, the
usable memory, the planner's moves), from a wrapped model or a memory_report() dict; and the
per-step peaks the adapter records for it (device memory simulated on the CPU path, as
tests/engine/test_adapt.py does)."""

import json
import struct
import sys

import pytest
import torch
from helpers import AUTO, machine, train
from models import tiny_mlp

import trainstream
from trainstream.engine.adapt import PeakTimeline
from trainstream.plot import planner_moves

MiB = 1 << 20
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TAB_BLUE = (0x1F / 255, 0x77 / 255, 0xB4 / 255)  # the peaks' line


def needs_matplotlib():
    return pytest.importorskip("matplotlib", reason="plot_memory draws with matplotlib (pip install matplotlib)")


class FakeDevice:
    """Device memory as the adapter reads it: `now` (allocated), and a peak counter."""

    def __init__(self, adapter, now):
        self.now, self.peak = now, now
        adapter.allocated = lambda: self.now
        adapter.device_peak = lambda: self.peak
        adapter.counters = lambda: {"current": self.now, "peak": self.peak}  # both in one read


def run_with_moves():
    """6 blocks on a simulated 3 MiB card: the first step's replan brings the 4 blocks paged at
    wrap() back; at step 6 the peak passes the usable memory (a longer sequence): the guard
    pages activations during the pass, the watchdog pages every block's weights. Returns the
    model and the peak each step had."""
    model, batch, loss_fn = tiny_mlp()
    model, opt = trainstream.wrap(
        model, None, device="cpu", lr=1e-2, offload=True, **AUTO, profile=machine(vram_gib=3 / 1024)
    )
    adapter = model._trainstream_engine.adapter
    fake = FakeDevice(adapter, MiB)
    over = adapter.usable + MiB
    expected = []
    for i in range(12):
        if i == 5:
            fake.now = fake.peak = over
        if i == 7:
            fake.now = 2 * MiB
        loss_fn(model, batch(i, "cpu")).backward()
        opt.step()
        opt.zero_grad()
        expected.append(fake.now)
    return model, expected


def png_size(path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def blue_pixels(path) -> int:
    import numpy as np

    image = needs_matplotlib().image.imread(path)[..., :3]
    return int((np.abs(image - np.array(TAB_BLUE)) < 0.02).all(-1).sum())


def test_the_timeline_keeps_every_step_until_full_then_merges_neighbours_into_their_larger():
    timeline = PeakTimeline()
    timeline.CAPACITY = 4
    for step, peak in [(1, 5), (2, 9), (3, None), (4, 7), (5, 3)]:
        timeline.add(step, peak)  # None: not measured, no point
    assert timeline.points == [[1, 5], [2, 9], [4, 7], [5, 3]] and timeline.span == 1
    timeline.add(6, 4)  # a fifth point: pairs merge, each keeps its larger peak at its step
    assert timeline.points == [[2, 9], [4, 7], [6, 4]] and timeline.span == 2
    timeline.add(7, 8)  # the newest point now stands for two steps: 7 joins 6, and is larger
    timeline.add(8, 1)
    assert timeline.points == [[2, 9], [4, 7], [7, 8], [8, 1]]
    timeline.add(9, 2)
    assert timeline.points == [[2, 9], [4, 7], [7, 8], [9, 2]] and timeline.span == 2


def test_memory_report_holds_the_peak_each_step_measured():
    model, expected = run_with_moves()
    peaks = trainstream.memory_report(model)["peaks"]
    assert peaks["per_step"] == [[step, peak] for step, peak in enumerate(expected, 1)]
    assert peaks["per_step_span"] == 1
    # The CPU backend has no device memory counter: no peak, rather than a made-up one.
    _, _, (cpu_model, _) = train("mlp", AUTO, steps=2)
    assert trainstream.memory_report(cpu_model)["peaks"]["per_step"] == []


def test_the_moves_are_labelled_with_the_blocks_they_moved():
    model, _ = run_with_moves()
    report = trainstream.memory_report(model)
    assert report["plan"]["placement_at_wrap"] == {"paged": [0, 1, 2, 3], "act_paged": [], "recompute": []}
    moves = planner_moves(report)
    assert [(step, kind) for step, kind, _ in moves] == [
        (1, "replan"),
        (1, "applied"),
        (5, "guard"),
        (6, "replan"),
        (6, "applied"),
    ]
    labels = [label for _, _, label in moves]
    assert labels[0].startswith("replan (settling): measured peak 1.0 MiB")
    assert labels[1] == "moved: weights back on the device for blocks 0-3"
    assert labels[2] == "guard: activations paged during the pass, blocks 0-5"
    assert labels[3].startswith("replan (watchdog)")
    # The guard paged the activations already: this move pages the weights only.
    assert labels[4] == "moved: weights paged for blocks 0-5"


def test_plot_memory_writes_a_png_of_a_run_with_replans(tmp_path):
    needs_matplotlib()
    model, _ = run_with_moves()
    path = trainstream.plot_memory(model, tmp_path / "memory.png", title="tiny MLP on a 3 MiB card")
    assert path == tmp_path / "memory.png"
    width, height = png_size(path)
    assert width == 1100 and height > 450 and path.stat().st_size > 20_000
    assert blue_pixels(path) > 200  # the measured peaks are drawn


def test_a_report_read_back_from_json_plots_the_same_png(tmp_path):
    needs_matplotlib()
    model, _ = run_with_moves()
    saved = json.loads(json.dumps(trainstream.memory_report(model)))
    from_model = trainstream.plot_memory(model, tmp_path / "model.png")
    from_json = trainstream.plot_memory(saved, str(tmp_path / "json.png"))
    assert from_json.read_bytes() == from_model.read_bytes()


def test_a_run_switched_to_stock_on_the_cpu_plots_its_switch_and_no_peaks(tmp_path):
    needs_matplotlib()
    _, _, (model, _) = train("gpt", dict(offload="auto"), steps=4, clip=1.0)  # clipped: no warning at the switch
    report = trainstream.memory_report(model)
    assert report["mode"] == "stock"
    assert [(step, kind) for step, kind, _ in planner_moves(report)] == [(2, "switch")]
    path = trainstream.plot_memory(report, tmp_path / "stock.png")
    assert png_size(path)[0] == 1100
    assert blue_pixels(path) == 0  # no peak line: none was measured


def test_bad_arguments_are_refused_by_name(tmp_path):
    model, _ = run_with_moves()
    report = trainstream.memory_report(model)
    with pytest.raises(ValueError, match=r"model_or_report=.*not wrapped"):
        trainstream.plot_memory(torch.nn.Linear(2, 2), tmp_path / "a.png")
    with pytest.raises(TypeError, match=r"model_or_report=.*got list"):
        trainstream.plot_memory([report], tmp_path / "a.png")
    partial = {k: v for k, v in report.items() if k != "peaks"}
    with pytest.raises(ValueError, match=r"model_or_report=.*peaks\.per_step"):
        trainstream.plot_memory(partial, tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"path=.*does not exist"):
        trainstream.plot_memory(report, tmp_path / "missing" / "a.png")
    with pytest.raises(ValueError, match=r"path=.*\.png"):
        trainstream.plot_memory(report, tmp_path / "a.jpg")
    with pytest.raises(TypeError, match=r"path=.*got int"):
        trainstream.plot_memory(report, 3)
    with pytest.raises(TypeError, match=r"title=.*got int"):
        trainstream.plot_memory(report, tmp_path / "a.png", title=3)
    assert not list(tmp_path.iterdir())


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    model, _ = run_with_moves()
    with pytest.raises(ImportError, match="pip install matplotlib"):
        trainstream.plot_memory(model, tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()


@pytest.mark.gpu
def test_gpu_each_step_records_its_peak_and_the_report_plots(tmp_path):
    needs_matplotlib()
    _, _, (model, _) = train("gpt", AUTO, steps=4, device="cuda")
    report = trainstream.memory_report(model)
    per_step = report["peaks"]["per_step"]
    assert [step for step, _ in per_step] == [1, 2, 3, 4]
    assert all(peak > 0 for _, peak in per_step)
    # Step 1's peak is the device's counter as it stood then, or a sample below it.
    assert report["peaks"]["max_allocated_bytes"] >= per_step[0][1]
    path = trainstream.plot_memory(model, tmp_path / "gpu.png")
    assert png_size(path)[0] == 1100  # no pixel count: a tiny model on a large card draws along the axis
