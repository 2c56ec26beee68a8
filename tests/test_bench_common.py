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
