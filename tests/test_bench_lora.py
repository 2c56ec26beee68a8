"""The lora suite's arithmetic and case list (its cases themselves need a GPU)."""

import pytest

from trainstream.bench import lora


def test_the_union_of_intervals_counts_overlaps_once():
    assert lora._union_us([]) == 0
    assert lora._union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert lora._union_us([(0, 10), (2, 3), (10, 11)]) == 11


def test_the_7b_rows_run_only_in_the_full_suite():
    assert all(c["size"] == "quick" for c in lora.cases(quick=True))
    full = lora.cases(quick=False)
    big = [c for c in full if c["size"] == "qwen2.5-7b"]
    assert {c["runner"] for c in big} == {"stock", "bnb", "trainstream"}
    # The compute bound, and the same with every block recomputed (the capped row's recompute).
    assert [c.get("compute_only", False) for c in big].count(True) == 2
    assert [c.get("checkpointing", False) for c in big if c.get("compute_only")] == [False, True]
    assert all(c.get("cap_gib") == lora.CAP_GIB for c in big if not c.get("compute_only"))
    with pytest.raises(ValueError, match="size must be one of"):
        lora._config("13b")


def _row(model, runner, run, **values):
    return dict(model=model, runner=runner, run=run, compute_only="forward + backward only" in run, **values)


def test_the_checks_read_the_targets_from_the_rows():
    rows = [
        _row("3b", "stock", "stock", s_per_step=0.2, peak_GiB=17.0),
        _row("3b", "bnb", "bnb", s_per_step=0.3, peak_GiB=13.0),
        _row(
            "3b", "trainstream", "TrainStream, NF4 base, weights resident", s_per_step=0.21, peak_GiB=12.0, gpu_busy=0.8
        ),
        _row("3b", "trainstream", "TrainStream, int8 base, weights resident", s_per_step=0.22, peak_GiB=12.5),
        _row("qwen2.5-7b", "stock", "7B: forward + backward only, uncapped (the compute bound)", s_per_step=0.5),
        _row("qwen2.5-7b", "trainstream", "7B: TrainStream", s_per_step=0.9, pcie_s=0.6, wrap_s=3.0, first_step_s=1.5),
    ]
    values = {c["check"]: c["value"] for c in lora._checks(rows)}
    assert values["NF4 resident: step / stock bf16 LoRA"] == pytest.approx(0.21 / 0.2)
    assert values["NF4 resident: bitsandbytes QLoRA step / ours"] == pytest.approx(0.3 / 0.21)
    assert values["int8 resident: step / NF4 resident"] == pytest.approx(0.22 / 0.21)
    assert values["NF4 resident: GPU busy share of the step (profiler)"] == 0.8
    bound = next(c for c in lora._checks(rows) if c["check"].startswith("under the cap"))
    assert bound["value"] == pytest.approx(0.9 / 0.6)  # PCIe is the larger bound here
    assert values["time to first step (wrap() + the first step), s"] == pytest.approx(4.5)
    assert {c["model"] for c in lora._checks(rows)} == {"3b", "qwen2.5-7b"}
    # A row that did not run (out of memory) gives no check, and nothing fails.
    assert lora._checks([_row("3b", "stock", "stock", oom=True)]) == []


def test_the_capped_rows_compute_bound_counts_the_blocks_it_recomputes():
    # Recomputing all 28 blocks added 0.2 s to the 0.5 s compute; the capped run recomputed 14
    # of them: its compute bound is 0.6 s, above its 0.3 s of PCIe.
    compute = _row("qwen2.5-7b", "stock", "7B: forward + backward only, uncapped (the compute bound)", s_per_step=0.5)
    recomputed = _row(
        "qwen2.5-7b",
        "stock",
        "7B: forward + backward only, every block recomputed (gradient checkpointing), uncapped",
        s_per_step=0.7,
    )
    ours = _row(
        "qwen2.5-7b",
        "trainstream",
        "7B: TrainStream",
        s_per_step=0.72,
        pcie_s=0.3,
        wrap_s=1.0,
        first_step_s=1.0,
        recompute_blocks=14,
        blocks=28,
    )
    bound = next(c for c in lora._checks([compute, recomputed, ours]) if c["check"].startswith("under the cap"))
    assert bound["value"] == pytest.approx(0.72 / 0.6) and "with 14 of 28 blocks recomputed" in bound["check"]
    # Without the recomputed row the bound is the plain compute, and the label says so.
    bound = next(c for c in lora._checks([compute, ours]) if c["check"].startswith("under the cap"))
    assert bound["value"] == pytest.approx(0.72 / 0.5) and "recompute not measured" in bound["check"]


def test_a_case_past_its_timeout_is_an_error_row_not_a_crash():
    from trainstream.bench.common import case_in_subprocess

    result, error = case_in_subprocess("trainstream.bench.lora", {"sleep": True}, timeout=0.01)
    assert result is None and error.endswith("[timed out after 0.01 s]")


def test_the_step_time_checks_read_the_same_process_medians_where_they_ran():
    rows = [
        _row("3b", "stock", "stock", s_per_step=0.2, peak_GiB=17.0),
        _row("3b", "bnb", "bnb", s_per_step=0.3, peak_GiB=13.0),
        _row("3b", "trainstream", "TrainStream, NF4 base, weights resident", s_per_step=0.21, peak_GiB=12.0),
        _row("3b", "trainstream", "TrainStream, int8 base, weights resident", s_per_step=0.22, peak_GiB=12.5),
        _row(
            "3b",
            "interleaved",
            "weights resident, one process",
            s_per_step_by_run={"stock": 0.18, "bitsandbytes": 0.27, "NF4": 0.19, "int8": 0.2},
        ),
    ]
    values = {c["check"]: c["value"] for c in lora._checks(rows)}
    where = " (one process, windows alternating)"
    assert values["NF4 resident: step / stock bf16 LoRA" + where] == pytest.approx(0.19 / 0.18)
    assert values["NF4 resident: bitsandbytes QLoRA step / ours" + where] == pytest.approx(0.27 / 0.19)
    assert values["int8 resident: step / NF4 resident" + where] == pytest.approx(0.2 / 0.19)
    # The peak still comes from the runs' own processes.
    assert values["NF4 resident: peak GiB (bitsandbytes' peak)"] == 12.0
    md = lora.markdown(rows, lora._checks(rows), quick=False)
    assert "windows alternating" in md and "| NF4 | 0.19 |" in md
    # The case runs the four resident runners under the names the checks read.
    (case,) = [c for c in lora.cases(quick=False) if c.get("interleaved")]
    assert tuple(case["runs"]) == lora.INTERLEAVED
    assert {r["runner"] for r in case["runs"].values()} == {"stock", "bnb", "trainstream"}
