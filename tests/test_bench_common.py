"""bench.common's same-process comparison: the windows alternate and each run gets its median."""

from trainstream.bench import common


def test_alternating_windows_interleave_the_runs_and_take_each_median(monkeypatch):
    calls = []
    # Window times per run, in the order they are taken: the medians are 2.0 and 20.0.
    seconds = {"a": iter([3.0, 1.0, 2.0]), "b": iter([20.0, 30.0, 10.0])}
    monkeypatch.setattr(common, "settle", lambda opt: calls.append(("settle", opt)))

    def window(step, opt, steps):
        calls.append((opt, steps))
        return next(seconds[opt]), None

    monkeypatch.setattr(common, "timed_window", window)
    medians = common.alternating_windows({"a": (None, "a"), "b": (None, "b")}, rounds=3, steps=5)
    assert medians == {"a": 2.0, "b": 20.0}
    windows = [c for c in calls if c[0] != "settle"]
    assert windows == [("a", 5), ("b", 5)] * 3
    # Each window starts from a settled run: its own work only.
    assert calls[::2] == [("settle", name) for name in ("a", "b") * 3]


def test_a_quick_run_writes_apart_and_no_table_reads_it(tmp_path):
    from trainstream.bench import readme

    env = dict(date="d", commit="c", torch="t", gpu="NVIDIA H200", cpu="cpu", cores=16, simd="avx512")
    full = common.write_result(tmp_path, "loss", env, {"rows": [{"s": 1.0}]}, "full table")
    quick = common.write_result(tmp_path, "loss", env, {"rows": [{"s": 9.0}]}, "quick table", quick=True)
    assert (full.name, quick.name) == ("loss-nvidia-h200.json", "loss-nvidia-h200-quick.json")
    loaded = readme.load(tmp_path)
    assert [r["markdown"] for r in loaded["loss"]] == ["full table"]
