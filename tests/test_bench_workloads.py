"""The workloads bench suite (bench/workloads.py) on the CPU: its rows and their peers, --rows, the
merge of a partial run into the committed results, the bounds' arithmetic on given numbers, the
tables and the plot, and a few cases at toy size. The GPU run itself is the lead's
(python -m trainstream.bench workloads --rows ...)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from trainstream.bench import __main__ as bench_main
from trainstream.bench import common
from trainstream.bench import workload_cases as cases
from trainstream.bench import workload_tables as tables
from trainstream.bench import workloads as wl
from trainstream.bench.models import GPT, GPTConfig, hub_config

CAPS = {1: 24, 2: 24, 3: 4, 4: 24, 5: 8, 6: 24, 7: 24, 8: 24, 9: None, 10: 24, 11: 24}
PROBE = dict(
    pcie_GBps=dict(h2d=50.0, d2h=50.0, bidir_each_way=40.0),
    host_adamw_params_per_s=dict(float32=5e9, bfloat16=8e9),
    matmul_TFLOPs=500.0,
)


def _runners(row: dict) -> set:
    return {(c["runner"], c.get("stage"), c["cap_gib"]) for c in row["cases"]}


def test_the_rows_and_their_peers():
    table = wl.rows_table()
    assert list(table) == list(wl.ROWS) == list(range(1, 12))
    assert {n: row["cap_gib"] for n, row in table.items()} == CAPS
    for n in (1, 4, 10):  # full fine-tunes: stock, torchao with gradients, DeepSpeed ZeRO-2 and -3 under the cap
        assert {("stock", None, 24), ("torchao", None, 24), ("deepspeed", 2, 24), ("deepspeed", 3, 24)} <= _runners(
            table[n]
        )
    for n in (5, 6, 7, 8, 11):  # LoRA: bitsandbytes QLoRA and the stock bf16 base under the cap
        assert {("bnb", None, CAPS[n]), ("stock", None, CAPS[n])} <= _runners(table[n])
    assert {("trainer_stock", None, None), ("trainer_stock", None, 24), ("trainer_ours", None, 24)} <= _runners(
        table[2]
    )
    assert {("stock", None, 4), ("deepspeed", 3, 4), ("trainstream", None, 4)} <= _runners(table[3])
    for n, row in table.items():
        assert any(c["runner"] in tables.OURS for c in row["cases"]) or n == 9
        assert n == 9 or any(c["runner"] == "compute" and c["cap_gib"] is None for c in row["cases"])
        for c in row["cases"]:
            assert c["row"] == n and c["device"] == "cuda" and c["cap_gib"] in (None, row["cap_gib"])
            assert c["warmup"] >= 1 and c["steps"] >= 1
    ours = {
        n: next(c for c in row["cases"] if c["runner"] == "trainstream") for n, row in table.items() if n not in (2, 9)
    }
    assert ours[3]["wrap"] == dict(param_offload=True, moment_dtype="bfloat16")
    assert ours[5]["wrap"] == dict(param_offload=True, quantize="none") and ours[5]["train"] == "lora"
    assert ours[7]["wrap"] == dict(quantize="auto", prefer="speed") and ours[7]["load"] == "none"
    assert ours[8]["load"] == ours[11]["load"] == "nf4"
    assert ours[10]["wrap"] == dict(moment_dtype="bfloat16") and ours[10]["train"] == "full"
    assert table[9]["cases"][0]["runner"] == "interleaved" and len(table[9]["cases"][0]["labels"]) == 2
    assert set(wl.RUNNERS) == {c["runner"] for row in table.values() for c in row["cases"]}
    # TrainStream's runs are timed once the planner has settled; the peers after 2 steps
    warmups = {
        (c["runner"] == "trainstream", c["warmup"])
        for row in table.values()
        for c in row["cases"]
        if c["runner"] != "interleaved"  # the planner suite's windows
    }
    assert warmups == {(True, wl.OURS_WARMUP), (False, 2)} and wl.OURS_WARMUP == 5


def test_the_rows_have_the_published_shapes():
    table = wl.rows_table()
    published = {5: "qwen2.5-7b", 6: "qwen2.5-14b", 7: "qwen2.5-14b", 8: "qwen2.5-32b", 10: "qwen2.5-7b"}
    published.update({11: "llama-3-70b", 2: "qwen2.5-1.5b"})
    for n, name in published.items():
        assert all(c["model"]["config"] == hub_config(name) for c in table[n]["cases"]), n
    assert (table[1]["cases"][0]["batch"], table[1]["cases"][0]["seq"]) == (8, 512)
    with torch.device("meta"):
        big = GPT(GPTConfig(**table[4]["cases"][0]["model"]["config"]))
    assert sum(p.numel() for p in big.parameters()) / 1e9 == pytest.approx(3.6, abs=0.05)


def test_quick_rows_are_toy_sizes_on_the_device_given():
    table = wl.rows_table(quick=True, device="cpu")
    assert list(table) == list(wl.ROWS)
    for row in table.values():
        for c in row["cases"]:
            assert c["device"] == "cpu" and c["batch"] * c["seq"] <= 64
            size = c["model"]["config"].get("hidden_size", c["model"]["config"].get("dim"))
            assert size == 64 or c["runner"] == "interleaved"


def test_the_rows_flag_accepts_row_numbers_only():
    assert wl.parse_rows("9,1,3") == [1, 3, 9]
    assert wl.parse_rows(" 2 ,2") == [2]
    for bad in ("0", "12", "1,,3", "a", "", "1-3", "-1"):
        with pytest.raises(ValueError, match="accepted: comma-separated row numbers from 1 to 11"):
            wl.parse_rows(bad)
    with pytest.raises(ValueError, match="no row 12"):
        wl.parse_rows("1,12")


def test_the_command_line_refuses_bad_rows_and_rows_without_the_suite(capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["workloads", "--rows", "1,12"])
    assert "no row 12; accepted: comma-separated row numbers from 1 to 11" in capsys.readouterr().err
    for argv in (["engine", "--rows", "1"], ["--rows", "1"], ["workloads", "engine", "--rows", "1"]):
        with pytest.raises(SystemExit):
            bench_main.main(argv)
        assert "--rows selects cases of the workloads suite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main.main(["workloads", "--runners", "stock,fsdp"])
    assert "no runner 'fsdp'; accepted: compute, stock, trainstream" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main.main(["engine", "--runners", "stock"])
    assert "--runners selects cases of the workloads suite" in capsys.readouterr().err


def test_the_suite_runs_only_when_named_and_quick_on_the_cpu(monkeypatch, capsys, tmp_path):
    assert "workloads" in bench_main.SUITES and "workloads" not in bench_main.DEFAULT
    calls = []

    def fake_run(**kwargs):
        calls.append(kwargs)
        return {"rows": [], "markdown": "the table"}

    env = dict(date="d", commit="c", torch="t", gpu=None, cpu="cpu", cores=2, simd="avx2")
    monkeypatch.setattr(wl, "run", fake_run)
    monkeypatch.setattr(bench_main, "environment", lambda: env)
    monkeypatch.setattr(bench_main.torch.cuda, "is_available", lambda: False)
    assert bench_main.main(["workloads", "--quick", "--rows", "3,1", "--out", str(tmp_path)]) == 0
    assert calls and calls[0]["rows"] == [1, 3] and calls[0]["quick"] is True and calls[0]["env"] is env
    calls.clear()
    assert bench_main.main(["workloads", "--out", str(tmp_path)]) == 0  # not quick: a GPU suite
    assert calls == [] and "skipping workloads" in capsys.readouterr().out


def _runs(
    commits: dict, labels=("stock: torch.optim.AdamW(fused=True), uncapped", "stock under the 24 GiB cap")
) -> list:
    return [
        dict(row=n, workload=f"workload {n}", run=label, runner="stock", cap_GiB=None, commit=c, date=f"date {c}")
        for n, c in commits.items()
        for label in labels
    ]


def test_a_partial_run_merges_into_the_results_run_by_run():
    table = wl.rows_table()
    uncapped, capped = "stock: torch.optim.AdamW(fused=True), uncapped", "stock under the 24 GiB cap"
    previous = dict(quick=False, rows=_runs({1: "old", 4: "old", 10: "old"}))
    new = _runs({4: "new", 3: "new"}, labels=(capped,)) + _runs({10: "new"})
    merged = wl.merge(previous, new, False, table)
    assert [(r["row"], r["run"], r["commit"]) for r in merged["rows"]] == [
        (1, uncapped, "old"),
        (1, capped, "old"),
        (3, capped, "new"),
        (4, uncapped, "old"),  # row 4's uncapped stock was not run again: it stays, in the table's order
        (4, capped, "new"),
        (10, uncapped, "new"),
        (10, capped, "new"),
    ]
    assert {c["row"] for c in merged["checks"]} <= {1, 3, 4, 10}
    # nothing before; a quick run never mixes with a full one
    assert [r["row"] for r in wl.merge(None, new, False, table)["rows"]] == [3, 4, 10, 10]
    assert [r["row"] for r in wl.merge(dict(previous, quick=True), new, False, table)["rows"]] == [3, 4, 10, 10]


def test_the_pcie_time_overlaps_what_moves_both_ways():
    bw = dict(h2d=50.0, d2h=40.0, bidir_each_way=25.0)
    assert tables.pcie_seconds(10e9, 4e9, bw) == pytest.approx(4 / 25 + 6 / 50)
    assert tables.pcie_seconds(2e9, 6e9, bw) == pytest.approx(2 / 25 + 4 / 40)
    assert tables.pcie_seconds(0, 8e9, bw) == pytest.approx(8 / 40)


def _facts(stored_codes=False) -> dict:
    block = dict(trained_bytes=100, fetch_trained=50, fetch_frozen=1000)
    return dict(
        blocks=[block] * 3, outside_trained_bytes=10, trained_params=80, matmul_params=0, stored_codes=stored_codes
    )


def _plan(**changes) -> dict:
    plan = dict(
        mode="offload",
        paged_blocks=[1, 2],
        activation_paged_blocks=[0],
        activation_bytes={0: 7, 1: 9},
        quantize="none",
        quantized_bytes=[0, 0],
        optimizer_mode="cpu",
        moment_dtype="float32",
    )
    return dict(plan, **changes)


def test_the_bytes_a_step_moves():
    # block 1 paged: in twice; block 2, the last, once; block 0's activations out and back;
    # every gradient out; new weights back to the resident block 0 and the outside units
    assert cases.step_traffic(_facts(), _plan()) == dict(h2d_bytes=3 * 1050 + 7 + 110, d2h_bytes=310 + 7)
    # weights quantized by wrap() cross at their quantized size; codes stored before it already are
    quantized = _plan(quantize="nf4", quantized_bytes=[1000, 250])
    assert cases.step_traffic(_facts(), quantized)["h2d_bytes"] == 3 * 300 + 7 + 110
    assert cases.step_traffic(_facts(stored_codes=True), quantized)["h2d_bytes"] == 3 * 1050 + 7 + 110
    # optimizer_mode="gpu": both moments each way instead of gradients and new weights
    moments = 2 * 4 * 80
    assert cases.step_traffic(_facts(), _plan(optimizer_mode="gpu")) == dict(
        h2d_bytes=3 * 1050 + 7 + moments, d2h_bytes=7 + moments
    )
    assert (
        cases.step_traffic(_facts(), _plan(optimizer_mode="gpu", moment_dtype="bfloat16"))["d2h_bytes"]
        == 7 + moments // 2
    )
    assert cases.step_traffic(_facts(), _plan(mode="stock")) == dict(h2d_bytes=0, d2h_bytes=0)


def _ours(**extra) -> dict:
    run = dict(
        row=1,
        run="ours",
        runner="trainstream",
        cap_GiB=24,
        s_per_step=0.5,
        h2d_bytes=8e9,
        d2h_bytes=4e9,
        trained_params=1e9,
        optimizer_mode="cpu",
        moment_dtype="float32",
        mode="offload",
        finite=True,
        rates=PROBE,  # measured in the run's own call
    )
    return dict(run, **extra)


def test_each_of_our_runs_gets_its_bound_and_checks():
    runs = [
        dict(row=1, run="compute", runner="compute", cap_GiB=None, s_per_step=0.1),
        dict(row=1, run="stock capped", runner="stock", cap_GiB=24, oom=True, error="OutOfMemoryError: ..."),
        dict(row=1, run="stock", runner="stock", cap_GiB=None, s_per_step=0.05),
        dict(row=1, run="torchao", runner="torchao", cap_GiB=24, s_per_step=0.9),
        dict(row=1, run="zero-3", runner="deepspeed", cap_GiB=24, s_per_step=0.7),
        _ours(),
        _ours(run="ours, bf16 moments", moment_dtype="bfloat16", s_per_step=0.25, h2d_bytes=0, d2h_bytes=0),
    ]
    tables.add_bounds(runs)
    first, second = runs[-2], runs[-1]
    assert first["pcie_s"] == pytest.approx(4 / 40 + 4 / 50) and first["host_adamw_s"] == pytest.approx(0.2)
    assert (first["bound_by"], first["bound_s"], first["vs_bound"]) == (
        "host AdamW",
        pytest.approx(0.2),
        pytest.approx(2.5),
    )
    assert first["compute_s"] == 0.1 and first["compute_how"].startswith("measured")
    assert (second["bound_by"], second["bound_s"]) == ("host AdamW", pytest.approx(1 / 8))
    assert "bound_s" not in runs[3]
    checks = {c["check"]: c for c in tables.row_checks(1, runs, 24)}
    bound = checks["ours: step / bound (host AdamW, 0.2 s)"]
    assert bound["value"] == pytest.approx(2.5) and bound["target"] == "<= 1.25" and bound["met"] is False
    assert checks["ours, bf16 moments: step / bound (host AdamW, 0.125 s)"]["met"] is False
    peer = checks["ours / the fastest peer that fits (zero-3)"]  # the uncapped stock run is no peer under the cap
    assert peer["value"] == pytest.approx(0.5 / 0.7) and peer["met"] is True
    assert checks["ours: every loss finite"]["value"] == "yes"


def test_a_derived_compute_bound_and_a_row_where_no_peer_fits():
    runs = [
        dict(row=11, run="compute", runner="compute", cap_GiB=None, oom=True, error="OutOfMemoryError: ..."),
        dict(row=11, run="qlora", runner="bnb", cap_GiB=24, oom=True, error="OutOfMemoryError: ..."),
        dict(row=11, run="stock", runner="stock", cap_GiB=24, error="RuntimeError: broke"),
        _ours(row=11, s_per_step=3.0, trained_params=1e8, matmul_params=70e9, tokens=2048, h2d_bytes=40e9, d2h_bytes=0),
    ]
    tables.add_bounds(runs)
    ours = runs[-1]
    assert ours["compute_s"] == pytest.approx(4 * 70e9 * 2048 / 500e12)  # frozen base: no weight gradients
    assert ours["compute_how"] == "derived: 4 x 70B x 2048 tokens at 500 TFLOP/s"
    assert (ours["bound_by"], ours["bound_s"]) == ("compute", pytest.approx(4 * 70e9 * 2048 / 500e12))
    checks = [c["check"] for c in tables.row_checks(11, runs, 24)]
    assert "peers that fit: none of 2 (out of memory, failed or skipped)" in checks


def test_the_interleaved_row_and_the_step_time_target():
    windows = dict(stock=[1.0, 1.2, 1.1], ours=[1.0, 1.3, 1.15])
    runs = [
        dict(row=9, run="stock", runner="stock", cap_GiB=None, s_per_step=1.1, window_s_per_step=windows["stock"]),
        dict(row=9, run="ours", runner="trainstream", cap_GiB=None, s_per_step=1.15, window_s_per_step=windows["ours"]),
    ]
    runs[1].update(mode="stock", optimizer_mode="cpu", finite=True, rates=PROBE)
    tables.add_bounds(runs)
    assert runs[1]["bound_s"] == 1.1 and runs[1]["compute_how"].startswith("stock's step")
    checks = {c["check"]: c for c in tables.row_checks(9, runs, None)}
    ratio = checks["defaults / stock, ratio of the medians of 3 interleaved windows"]
    assert ratio["value"] == pytest.approx(1.15 / 1.1) and ratio["target"] == "<= 1.02" and ratio["met"] is False
    fast = [_ours(row=10, s_per_step=1.4, h2d_bytes=0, d2h_bytes=0, trained_params=1)]
    assert {c["check"]: c["met"] for c in tables.row_checks(10, fast, 24)}["ours: s/step"] is True


def _measured_payload() -> dict:
    first = dict(workload="GPT", commit="aaaaaaa1111", date="2026-12-01 10:00 UTC", rates=PROBE)
    later = dict(first, commit="ccccccc3333", date="2026-12-03 12:00 UTC")
    runs = [
        dict(first, row=1, run="stock capped", runner="stock", cap_GiB=24, oom=True, error="OutOfMemoryError: x"),
        dict(later, row=1, run="torchao", runner="torchao", cap_GiB=24, s_per_step=0.9, peak_GiB=20.0),
        _ours(**first, peak_GiB=12.0, paged_blocks=[0, 1], activation_paged_blocks=[1], quantize="none"),
        dict(
            row=3,
            workload="small",
            run="zero-3",
            runner="deepspeed",
            cap_GiB=4,
            skipped="needs CUDA: ...",
            commit="bbbbbbb2222",
            date="2026-12-02 11:00 UTC",
            rates={"error": "the probe failed"},
        ),
    ]
    return wl.merge(None, runs, False, wl.rows_table())


def test_the_markdown_says_which_rows_ran_at_which_commit():
    text = tables.markdown(_measured_payload())
    assert "- rows 1 (2 of its 3 runs): commit aaaaaaa1111, 2026-12-01 10:00 UTC; pinned H2D 50.0, D2H 50.0" in text
    assert "- rows 1 (1 of its 3 runs): commit ccccccc3333, 2026-12-03 12:00 UTC; pinned H2D" in text
    assert "- rows 3: commit bbbbbbb2222, 2026-12-02 11:00 UTC; rates not measured: the probe failed" in text
    assert "1. GPT" in text and "3. small" in text
    assert "| 1 | stock capped | 24 | - | - |" in text and "out of memory: OutOfMemoryError: x |" in text
    assert "| 1 | torchao | 24 | 0.9 | 1.8 | 20 |" in text
    assert "2 paged, 1 act. paged, float32 moments, optimizer cpu" in text
    assert "| 3 | zero-3 | 4 | - |" in text and "skipped: needs CUDA: ... |" in text
    assert "| 1 | ours | 0.5 | - | - | 8 | 4 | 0.18 | 0.2 | 0.2 | host AdamW | 2.5 |" in text
    assert "| 1 | ours: step / bound (host AdamW, 0.2 s) | 2.5 | <= 1.25 | no |" in text
    assert "| 1 | ours / the fastest peer that fits (torchao) | 0.556 | < 1.0 | yes |" in text


def test_the_plot_of_every_run(tmp_path):
    pytest.importorskip("matplotlib")
    name, note = tables.plot(_measured_payload()["rows"], tmp_path / "workloads-x.png")
    assert (name, note) == ("workloads-x.png", None)
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_suite_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    name, note = tables.plot(_measured_payload()["rows"], tmp_path / "p.png")
    assert name is None and note.startswith("not drawn: matplotlib is not installed")
    assert not (tmp_path / "p.png").exists()


def test_run_measures_each_case_in_its_own_process_and_merges(monkeypatch, tmp_path):
    calls = []

    def fake_subprocess(module, case):
        calls.append((module, case["runner"], case.get("row")))
        if case["runner"] == "probe":
            return dict(PROBE), None
        if case["runner"] == "deepspeed":
            return None, "Traceback (most recent call last):\n  ...\nImportError: no deepspeed here\n[exit status 1]"
        if case["runner"] == "torchao":
            raise subprocess.TimeoutExpired(["python"], 900)
        if case["runner"] == "stock":
            return None, "UserWarning: something\n[exit status -9]"
        return dict(s_per_step=1.0, peak_GiB=2.0, finite=True, trained_params=10), None

    monkeypatch.setattr(wl, "case_in_subprocess", fake_subprocess)
    monkeypatch.setattr(common, "git_commit", lambda: "newcommit")
    table = wl.rows_table(device="cuda")
    stem = tmp_path / f"workloads-{common.machine_slug(wl._machine())}"
    old = [
        dict(
            row=n, workload="w", run=c["label"], runner=c["runner"], cap_GiB=c["cap_gib"], s_per_step=9.0, commit="old"
        )
        for n in (1, 3)
        for c in table[n]["cases"]
    ]
    stem.with_suffix(".json").write_text(json.dumps(dict(suite="workloads", env={}, quick=False, rows=old)))
    env = dict(date="d", commit="newcommit", torch="t", gpu=None, cpu="cpu", cores=2, simd="avx2")

    result = wl.run(rows=[3], runners=["deepspeed", "torchao"], out_dir=tmp_path, device="cuda", env=env)
    assert calls[0][:2] == (wl.MODULE, "probe")
    assert [(runner, row) for _, runner, row in calls[1:]] == [("torchao", 3), ("deepspeed", 3)]
    commits = {(r["row"], r["runner"]): r["commit"] for r in result["rows"]}
    assert commits[(3, "torchao")] == commits[(3, "deepspeed")] == "newcommit"
    assert commits[(3, "stock")] == commits[(3, "trainstream")] == commits[(1, "torchao")] == "old"
    mine = {r["runner"]: r for r in result["rows"] if r["row"] == 3}
    assert mine["deepspeed"]["error"] == "ImportError: no deepspeed here (exit status 1)"
    assert mine["torchao"]["error"] == "timed out after 900 s"
    assert [r["run"] for r in result["rows"]] == [r["run"] for r in old]  # the table's order
    # written after each case: the merged file, its markdown beside it
    written = json.loads(stem.with_suffix(".json").read_text())
    assert {(r["row"], r["runner"], r["commit"]) for r in written["rows"]} == {
        (r["row"], r["runner"], commits[(r["row"], r["runner"])]) for r in result["rows"]
    }
    assert "- rows 3 (2 of its 5 runs): commit newcommit" in stem.with_suffix(".md").read_text()

    calls.clear()
    result = wl.run(rows=[3], out_dir=tmp_path, device="cuda")
    assert [runner for _, runner, _ in calls[1:]] == [c["runner"] for c in table[3]["cases"]]
    stock = next(r for r in result["rows"] if r["row"] == 3 and r["runner"] == "stock")
    assert stock["error"].startswith("killed by signal 9")
    assert "- rows 3: commit newcommit" in result["markdown"] and "- rows 1: commit old" in result["markdown"]
    with pytest.raises(ValueError, match="rows \\[9\\] have no case of the runners \\['torchao'\\]"):
        wl.run(rows=[9], runners=["torchao"], out_dir=tmp_path, device="cuda")


def _toy(number: int, runner: str, **changes) -> dict:
    case = next(c for c in wl.rows_table(quick=True, device="cpu")[number]["cases"] if c["runner"] == runner)
    return dict(case, **changes)


def _check_trained(out: dict) -> None:
    assert "error" not in out, out
    assert out["s_per_step"] > 0 and out["first_step_s"] > 0 and out["host_rss_GiB"] > 0
    assert math.isfinite(out["first_loss"]) and math.isfinite(out["last_loss"]) and out["finite"] is True


def test_a_gpt_row_of_ours_at_toy_size():
    case = _toy(1, "trainstream", wrap=dict(offload=True, activation_offload=True))
    out = cases.run_case(case)
    _check_trained(out)
    assert len(out["losses"]) == case["warmup"] + case["steps"]
    assert out["mode"] == "offload" and out["activation_paged_blocks"] == [0, 1] and out["paged_blocks"] == []
    assert (out["quantize"], out["moment_dtype"], out["optimizer_mode"]) == ("none", "float32", "cpu")
    # resident blocks: every gradient out and every new weight back, the saved activations both ways
    grads = 4 * out["trained_params"]  # fp32
    acts = sum(out["activation_bytes"].values())
    assert out["h2d_bytes"] == out["d2h_bytes"] == grads + acts and acts > 0


def test_a_lora_row_of_ours_and_its_stock_peer_at_toy_size():
    pytest.importorskip("peft")
    ours = cases.run_case(_toy(5, "trainstream"))
    stock = cases.run_case(_toy(5, "stock", cap_gib=None))
    for out in (ours, stock):
        _check_trained(out)
    assert ours["trainable"] == stock["trainable"] > 0
    assert ours["paged_blocks"] == [0, 1] and ours["quantize"] == "none"
    assert "mode" not in stock and "peak_GiB" not in stock  # no device memory on the CPU


def test_the_trainer_row_of_ours_at_toy_size():
    pytest.importorskip("transformers")
    case = _toy(2, "trainer_ours")
    out = cases.run_case(case)
    _check_trained(out)
    assert len(out["losses"]) == case["warmup"] + case["steps"] and "mode" in out
    assert out["wrap_s"] is None  # the Trainer wraps inside train(), in the first step


def test_a_case_that_fails_or_needs_cuda_says_why():
    assert cases.run_case(_toy(1, "torchao")) == {
        "skipped": "needs CUDA: torchao's CPUOffloadOptimizer offloads the state of CUDA parameters"
    }
    assert cases.run_case(_toy(4, "deepspeed"))["skipped"].startswith("needs CUDA: DeepSpeed")
    assert cases.run_case(_toy(9, "interleaved"))["skipped"].startswith("needs CUDA")
    out = cases.run_case(_toy(1, "trainstream", wrap=dict(bogus_option=1)))
    assert out["error"].startswith("ValueError: ") and "bogus_option" in out["error"]
    with pytest.raises(ValueError, match="unknown runner 'fsdp'"):
        cases.run_case(dict(_toy(1, "stock"), runner="fsdp"))


@pytest.mark.gpu
def test_gpu_quick_rows_train_under_their_caps(tmp_path):
    """python -m trainstream.bench workloads --quick --rows 1,5,9 on the GPU: every run of ours,
    stock, the compute bound and QLoRA trains (toy sizes fit every cap), a peer that is not
    installed says so, and each of our runs has its bound."""
    result = wl.run(quick=True, rows=[1, 5, 9], out_dir=tmp_path)
    for r in result["rows"]:
        if r["runner"] in ("trainstream", "stock", "compute", "bnb"):
            assert "error" not in r and r["s_per_step"] > 0 and r["peak_GiB"] > 0, r
        else:
            assert "s_per_step" in r or r.get("error"), r
        if r["runner"] == "trainstream":  # row 9's is held to stock's step, the others to their plan's bytes too
            assert r["vs_bound"] > 0 and (r["row"] == 9 or r["pcie_s"] is not None), r
    assert {r["row"] for r in result["rows"]} == {1, 5, 9}


def _committed(plot=None) -> dict:
    payload = _measured_payload()
    env = dict(date="d", commit="aaaaaaa1111", torch="t", gpu="NVIDIA H200", cpu="cpu", cores=16, simd="avx512")
    return dict(suite="workloads", env=env, plot=plot, **payload, markdown=tables.markdown(payload))


def test_the_docs_section_shows_the_plot_and_the_table():
    from trainstream.bench import readme

    text = "before\n<!-- results:workloads -->\nold\n<!-- /results:workloads -->\nafter\n"
    shown = readme.render(text, {"workloads": [_committed(plot="workloads-nvidia-h200.png")]})
    assert "![workloads: s/step and peak VRAM of every run](../benchmarks/results/workloads-nvidia-h200.png)" in shown
    assert (
        "- rows 1 (2 of its 3 runs): commit aaaaaaa1111" in shown and "old" not in shown and shown.endswith("after\n")
    )
    assert "![" not in readme.render(text, {"workloads": [_committed()]})


def test_the_summary_line_of_each_row():
    from trainstream.bench import readme

    text = "<!-- results:workloads_summary -->\n<!-- /results:workloads_summary -->"
    assert "_No results committed yet._" in readme.render(text, {})
    shown = readme.render(text, {"workloads": [_committed()]})
    assert "| 1 | GPT | 24 | 0.5 | 12 | 2.5 | torchao: 0.9 | aaaaaaa |" in shown
    assert "| 3 | small | 4 | did not train | - | - | none fits | bbbbbbb |" in shown


def test_rows_6_and_8_save_their_memory_timeline(tmp_path):
    pytest.importorskip("peft")
    for n, row in wl.rows_table(quick=True, device="cpu").items():
        for c in row["cases"]:
            assert bool(c.get("memory_plot")) == (n in (6, 8) and c["runner"] == "trainstream"), (n, c["label"])
    out = cases.run_case(_toy(6, "trainstream"))
    _check_trained(out)
    report = json.loads(json.dumps(out["memory_report"]))  # what the child process prints
    name, note = wl._memory_plot(report, tmp_path / "workloads-machine", 6)
    if name is None:
        assert "matplotlib" in note
    else:
        assert name == "workloads-machine-row6-memory.png"
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [dict(row=6, workload="w", run="ours", runner="trainstream", memory_plot=name, memory_plot_note=note)]
    md = tables.markdown(dict(rows=rows, checks=[], quick=False))
    assert "Memory over the run (trainstream.plot_memory):" in md
    assert (f"![memory]({name})" if name else note) in md
