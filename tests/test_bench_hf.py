"""The hf bench suite's cases (bench/hf.py) at toy size on the CPU: each case's function runs,
its row holds the keys the tables read, and the two runs of a comparison start from the same
finite loss (the same weights and batch). The GPU run itself is the lead's (python -m
trainstream.bench hf)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

from trainstream.bench import __main__ as bench_main  # noqa: E402
from trainstream.bench import common, hf  # noqa: E402
from trainstream.bench.__main__ import SUITES  # noqa: E402

TOY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
FULL_KEYS = {"s_per_step", "peak_GiB", "losses", "first_loss", "last_loss", "setup_s", "oom"}
LORA_KEYS = {
    "s_per_step",
    "peak_GiB",
    "host_rss_GiB",
    "load_s",
    "convert_s",
    "setup_s",
    "first_step_s",
    "first_loss",
    "last_loss",
    "oom",
}
ENGINE_KEYS = {"mode", "paged_blocks", "activation_paged_blocks", "recompute_blocks", "planner"}


def toy_case(kind: str, runner: str, **extra) -> dict:
    return dict(kind=kind, runner=runner, device="cpu", config=TOY, batch=2, seq=16, warmup=2, steps=3, **extra)


def _check_row(row: dict, keys: set, wrapped: bool) -> None:
    assert keys <= row.keys() and row["oom"] is False
    assert (ENGINE_KEYS <= row.keys()) == wrapped
    assert row["peak_GiB"] is None  # no device memory on the CPU
    assert row["s_per_step"] > 0
    assert math.isfinite(row["first_loss"]) and math.isfinite(row["last_loss"])
    if wrapped:  # the planner's decisions, each with its step and message (JSON-ready)
        assert all({"step", "kind", "message"} <= d.keys() for d in row["planner"])
        json.dumps(row["planner"])


def test_the_full_fine_tune_rows_of_both_trainers():
    stock = hf.run_case(toy_case("full", "stock"))
    ours = hf.run_case(toy_case("full", "trainstream"))
    _check_row(stock, FULL_KEYS, wrapped=False)
    _check_row(ours, FULL_KEYS, wrapped=True)
    assert len(stock["losses"]) == len(ours["losses"]) == 3
    assert all(math.isfinite(v) for v in stock["losses"] + ours["losses"])
    # the same weights and first batch: the chunked loss against the full logits' under bf16 autocast
    assert ours["first_loss"] == pytest.approx(stock["first_loss"], rel=1e-3)


def test_the_lora_rows_of_trainstream_and_bitsandbytes():
    pytest.importorskip("bitsandbytes")
    qlora = hf.run_case(toy_case("lora", "bnb"))
    checkpointed = hf.run_case(toy_case("lora", "bnb", checkpointing=True))
    ours = hf.run_case(toy_case("lora", "trainstream"))
    for row in (qlora, checkpointed):
        _check_row(row, LORA_KEYS, wrapped=False)
    _check_row(ours, LORA_KEYS, wrapped=True)
    assert qlora["trainable"] == ours["trainable"] > 0
    assert ours["convert_s"] is None and qlora["convert_s"] > 0 and ours["first_step_s"] > 0
    # the same NF4 codes, the same adapters' initialization and batch
    assert ours["first_loss"] == pytest.approx(qlora["first_loss"], rel=1e-3)
    assert checkpointed["first_loss"] == qlora["first_loss"]


def _the_same_base_twice():
    """Two NF4 bases load_model builds from one seed (the toy shapes): ours and the one to convert."""
    from trainstream.integrations.huggingface import load_model

    with __import__("tempfile").TemporaryDirectory() as folder:
        hf.qwen2_config(TOY).save_pretrained(folder)
        torch.manual_seed(0)
        ours = load_model(folder, random_weights=True, quantize="nf4")
        torch.manual_seed(0)
        theirs = load_model(folder, random_weights=True, quantize="nf4")
    return ours, theirs


def test_the_bitsandbytes_base_holds_the_codes_load_model_made():
    bnb = pytest.importorskip("bitsandbytes")
    import transformers  # noqa: F401

    from trainstream.quant import stored

    ours, theirs = _the_same_base_twice()
    want = stored.codes_of(ours.model.layers[1].mlp.down_proj.weight).dequantize()
    hf._to_bitsandbytes(theirs, "cpu")
    q = theirs.model.layers[1].mlp.down_proj
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.bnb_quantized
    got = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).to(want.dtype).view_as(want)
    assert torch.equal(got, want)
    assert not any(stored.codes_of(p) is not None for p in theirs.model.layers.parameters())


@pytest.mark.gpu
def test_gpu_the_bitsandbytes_base_is_made_on_the_device_from_the_same_codes():
    """The codes cross to the GPU and are dequantized there (not on the host): bitsandbytes'
    codes of those values dequantize to load_model's values bit for bit."""
    bnb = pytest.importorskip("bitsandbytes")
    import transformers  # noqa: F401

    from trainstream.quant import stored

    ours, theirs = _the_same_base_twice()
    hf._to_bitsandbytes(theirs, "cuda")
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        want = stored.codes_of(ours.model.layers[1].get_submodule(name).weight).dequantize()
        q = theirs.model.layers[1].get_submodule(name)
        assert isinstance(q, bnb.nn.Linear4bit) and q.weight.bnb_quantized and q.weight.device.type == "cuda"
        got = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).to(want.dtype).view_as(want)
        assert torch.equal(got.cpu(), want), name


def test_the_suite_is_a_gpu_suite_and_its_cases_have_the_published_shapes():
    import transformers

    assert SUITES["hf"][0] is True
    full = [c for c in hf.cases(quick=False) if c["kind"] == "full"]
    low_rank = [c for c in hf.cases(quick=False) if c["kind"] == "lora"]
    assert {(c["runner"], c["cap_gib"]) for c in full} == {("stock", None), ("stock", 24), ("trainstream", 24)}
    assert {(c["runner"], c["cap_gib"]) for c in low_rank} == {("bnb", None), ("bnb", 24), ("trainstream", 24)}
    assert all((c["batch"], c["seq"], c["device"]) == (4, 512, "cuda") for c in full + low_rank)

    def billions(fields) -> float:
        with torch.device("meta"):
            model = transformers.Qwen2ForCausalLM(hf.qwen2_config(fields))
        return sum(p.numel() for p in model.parameters()) / 1e9  # tied embeddings counted once

    assert billions(hf.QWEN2_5_1_5B) == pytest.approx(1.54, abs=0.01)  # the model card's 1.54B
    assert billions(hf.QWEN2_5_14B) == pytest.approx(14.77, abs=0.01)  # and 14.7B


def test_the_rows_are_compared_with_their_uncapped_peer():
    full = dict(kind="full", model="Qwen2.5-1.5B shapes", batch=4, seq=512, warmup=2, steps=10)
    low_rank = dict(kind="lora", model="Qwen2.5-14B shapes", batch=4, seq=512, warmup=2, steps=5)
    rows = [
        dict(full, row=1, run="stock", cap_GiB=None, s_per_step=2.0, first_loss=5.0, losses=[5.0, 4.0]),
        dict(full, row=2, run="stock capped", cap_GiB=24, oom=True),
        dict(full, row=3, run="ours", cap_GiB=24, s_per_step=3.0, first_loss=5.5, losses=[5.5, 3.0]),
        dict(low_rank, row=4, run="qlora", cap_GiB=None, s_per_step=1.0, first_loss=7.0),
        dict(low_rank, row=6, run="ours", cap_GiB=24, s_per_step=4.0, first_loss=7.25),
    ]
    hf.compare(rows)
    assert rows[2]["vs_peer"] == 1.5 and rows[2]["first_loss_diff"] == 0.5 and rows[2]["max_loss_diff"] == 1.0
    assert "vs_peer" not in rows[1]
    assert rows[4]["vs_peer"] == 4.0 and rows[4]["first_loss_diff"] == 0.25 and "max_loss_diff" not in rows[4]
    text = hf.markdown(rows)
    assert "| 3 | ours | 24 | 3 | 1.5 |" in text and "| 2 | stock capped | 24 | - | - |" in text
    assert "Qwen2.5-1.5B shapes" in text and "batch 4x512, 10 steps" in text
    assert "Qwen2.5-14B shapes" in text and "5 timed steps after 2 warm-up" in text


def test_an_unknown_case_kind_is_refused():
    with pytest.raises(ValueError, match="unknown case kind 'dpo'; accepted: \\['full', 'lora'\\]"):
        hf.run_case(dict(toy_case("full", "stock"), kind="dpo"))


def test_a_case_without_timed_steps_is_refused():
    with pytest.raises(ValueError, match="warmup=2 leaves no timed step of steps=2"):
        hf.run_case(dict(toy_case("full", "stock"), steps=2))
    with pytest.raises(ValueError, match="warmup=0 leaves no timed step of steps=3"):
        hf.run_case(dict(toy_case("lora", "bnb"), warmup=0))


@pytest.mark.gpu
def test_gpu_the_quick_suite_runs_every_case():
    """python -m trainstream.bench hf --quick, each case in its own process: every row has its
    figures (nothing runs out of memory at these sizes, under the cap either), and each
    comparison starts from the same loss."""
    pytest.importorskip("bitsandbytes")
    result = hf.run(quick=True)
    rows = result["rows"]
    assert len(rows) == len(hf.cases(quick=True)) == 6
    for row in rows:
        assert "error" not in row, row
        assert row["peak_GiB"] > 0 and math.isfinite(row["first_loss"]) and math.isfinite(row["last_loss"])
    for row in rows[1:3] + rows[4:]:
        assert row["first_loss_diff"] <= 1e-2 * rows[0 if row["kind"] == "full" else 3]["first_loss"]
    assert "| TrainStreamTrainer under a 24 GiB cap |" in result["markdown"]


def test_the_cases_run_one_process_each_and_quick_ones_in_one(monkeypatch):
    calls = []

    def fake_subprocess(module, batch, timeout):
        assert timeout == hf.CASE_TIMEOUT_S <= 540
        calls.append((module, [c["label"] for c in batch]))
        if any(c["cap_gib"] for c in batch) and len(batch) == 1 and batch[0]["kind"] == "full":
            return None, "Traceback ... RuntimeError: the process failed"
        return [dict(s_per_step=1.0, first_loss=5.0, losses=[5.0], steps_seen=c["steps"]) for c in batch], None

    monkeypatch.setattr(hf, "case_in_subprocess", fake_subprocess)
    rows = hf.run(quick=False)["rows"]
    assert [labels for _, labels in calls] == [[c["label"]] for c in hf.cases(quick=False)]
    assert all(module == "trainstream.bench.hf" for module, _ in calls)
    failed = [r for r in rows if "error" in r]
    assert [r["run"] for r in failed] == ["stock Trainer under a 24 GiB cap", "TrainStreamTrainer under a 24 GiB cap"]
    assert all(r["steps_seen"] == r["steps"] == 10 for r in rows if r["kind"] == "full" and "error" not in r)
    calls.clear()
    rows = hf.run(quick=True)["rows"]
    assert len(calls) == 1 and calls[0][1] == [c["label"] for c in hf.cases(quick=True)]
    assert len(rows) == 6 and not any("error" in r for r in rows)


def test_the_case_runner_takes_one_case_or_a_list(monkeypatch):
    monkeypatch.setattr(hf, "CASES", {"full": lambda case: {"steps": case["steps"]}})
    one = toy_case("full", "stock")
    assert json.loads(hf.main(json.dumps(one))) == {"steps": 3}
    assert json.loads(hf.main(json.dumps([one, dict(one, steps=4)]))) == [{"steps": 3}, {"steps": 4}]


# -- choosing rows and merging them into the results (--rows) -----------------------------------


ENV = dict(date="d", commit="newcommit", torch="t", gpu="NVIDIA H200", cpu="cpu", cores=16, simd="avx2")


def test_the_rows_are_numbered_in_the_order_of_the_tables():
    assert hf.ROWS == (1, 2, 3, 4, 5, 6)
    for quick in (False, True):
        assert [c["row"] for c in hf.cases(quick)] == list(hf.ROWS)
    assert [c["kind"] for c in hf.cases(False)] == ["full"] * 3 + ["lora"] * 3


def test_the_rows_flag_of_the_hf_suite_accepts_its_row_numbers_only():
    assert hf.parse_rows("3,1") == [1, 3]
    assert hf.parse_rows(" 6 ,6") == [6]
    for bad in ("0", "7", "1,,3", "a", "", "1-3", "-1"):
        with pytest.raises(ValueError, match="accepted: comma-separated row numbers of the hf suite from 1 to 6"):
            hf.parse_rows(bad)
    with pytest.raises(ValueError, match="--rows '1,7': no row 7"):
        hf.parse_rows("1,7")


def test_the_command_line_gives_the_hf_suite_its_rows(monkeypatch, capsys, tmp_path):
    calls = []

    def fake_run(**kwargs):
        calls.append(kwargs)
        return {"rows": [], "markdown": "the table"}

    monkeypatch.setattr(hf, "run", fake_run)
    monkeypatch.setattr(bench_main, "environment", lambda: ENV)
    monkeypatch.setattr(bench_main.torch.cuda, "is_available", lambda: True)
    assert bench_main.main(["hf", "--rows", "6,4", "--out", str(tmp_path)]) == 0
    assert calls[0]["rows"] == [4, 6] and calls[0]["out_dir"] == tmp_path and calls[0]["env"] is ENV
    assert calls[0]["quick"] is False
    calls.clear()
    assert bench_main.main(["hf", "--out", str(tmp_path)]) == 0
    assert calls[0]["rows"] is None
    for argv, message in (
        (["hf", "--rows", "1,7"], "--rows '1,7': no row 7; accepted: comma-separated row numbers of the hf suite"),
        (["hf", "--rows", "x"], "--rows 'x': accepted: comma-separated row numbers of the hf suite from 1 to 6"),
        (["hf", "workloads", "--rows", "1"], "--rows selects cases of the workloads suite (rows 1-11) or of the hf"),
        (["engine", "--rows", "1"], "or of the hf suite (rows 1-6): run one of them alone"),
        (["hf", "--runners", "stock"], "--runners selects cases of the workloads suite: run it alone"),
    ):
        with pytest.raises(SystemExit):
            bench_main.main(argv)
        assert message in capsys.readouterr().err, argv
    assert len(calls) == 1


def _fake_result(case: dict, s_per_step: float) -> dict:
    return dict(s_per_step=s_per_step, first_loss=5.0 + case["row"], losses=[5.0, 4.0], steps_seen=case["steps"])


def test_chosen_rows_merge_into_the_results_row_by_row(monkeypatch, tmp_path):
    path = tmp_path / "hf-nvidia-h200.json"
    old = [
        dict({k: c[k] for k in hf.CASE_FIELDS}, run=c["label"], cap_GiB=c["cap_gib"], commit="old", date="then")
        for c in hf.cases(quick=False)
    ]
    for r in old:
        r.update(s_per_step=2.0, first_loss=7.0, vs_peer=99.0)
    path.write_text(json.dumps(dict(suite="hf", env={}, quick=False, rows=old)))
    seen = []

    def fake_subprocess(module, batch, timeout):
        assert timeout == hf.CASE_TIMEOUT_S <= 540
        assert module == "trainstream.bench.hf" and len(batch) == 1
        seen.append(batch[0]["row"])
        if len(seen) == 2:  # the first case's row was written before the second ran
            written = {r["row"]: r["commit"] for r in json.loads(path.read_text())["rows"]}
            assert written == {1: "old", 2: "old", 3: "old", 4: "newcommit", 5: "old", 6: "old"}
        return [_fake_result(batch[0], s_per_step=1.0 if batch[0]["row"] == 4 else 3.0)], None

    monkeypatch.setattr(hf, "case_in_subprocess", fake_subprocess)
    monkeypatch.setattr(common, "git_commit", lambda: "newcommit")
    result = hf.run(rows=[6, 4], out_dir=tmp_path, env=ENV)
    assert seen == [4, 6]
    assert [(r["row"], r["commit"]) for r in result["rows"]] == [
        (1, "old"),
        (2, "old"),
        (3, "old"),
        (4, "newcommit"),
        (5, "old"),
        (6, "newcommit"),
    ]
    by_row = {r["row"]: r for r in result["rows"]}
    assert by_row[6]["steps_seen"] == 5 and by_row[6]["case_wall_s"] >= 0 and by_row[6]["date"] != "then"
    # compared again with the peer measured now (row 4, uncapped QLoRA), the stale ratio gone
    assert by_row[6]["vs_peer"] == 3.0 and by_row[5]["vs_peer"] == 2.0 and by_row[2]["vs_peer"] == 1.0
    written = json.loads(path.read_text())
    assert written["suite"] == "hf" and written["env"] == ENV and written["rows"] == result["rows"]
    assert "- rows 1, 2, 3, 5: commit old, then" in result["markdown"]
    assert "- rows 4, 6: commit newcommit," in result["markdown"]
    assert path.with_suffix(".md").read_text().endswith(result["markdown"] + "\n")
    # a quick run never mixes with a full one's results
    seen.clear()
    quick = hf.run(quick=True, rows=[1], out_dir=tmp_path, env=ENV)
    assert [(r["row"], r["commit"]) for r in quick["rows"]] == [(1, "newcommit")]


def test_bad_rows_and_a_results_folder_without_the_machine_are_refused():
    with pytest.raises(ValueError, match="hf bench: rows \\[9\\]; accepted: some of \\[1, 2, 3, 4, 5, 6\\]"):
        hf.run(rows=[9])
    with pytest.raises(ValueError, match="hf bench: rows \\[\\]; accepted"):
        hf.run(rows=[])
    with pytest.raises(ValueError, match="out_dir needs env"):
        hf.run(rows=[1], out_dir=".")


def test_the_nan_check_of_random_weights_finds_a_nan_anywhere():
    from trainstream.integrations.huggingface.loading import _has_nan

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 15, 16, 17, 64, 129):
            for i in range(n):
                x = torch.randn(n).to(dtype)
                assert not _has_nan(x)
                x[i] = float("nan")
                assert _has_nan(x), (dtype, n, i)
                assert _has_nan(x.view(1, n).expand(3, n))
        assert not _has_nan(torch.tensor([float("inf"), -float("inf")], dtype=dtype))
        assert not _has_nan(torch.empty(0, 4, dtype=dtype))


def test_a_quick_run_of_chosen_rows_in_a_real_process_on_the_cpu(tmp_path):
    """Row 4 of --quick (QLoRA) measured in a real process on the CPU, merged into a results
    file holding row 6 of an earlier quick call, and compared with it."""
    pytest.importorskip("bitsandbytes")
    label = hf.cases(quick=True)[5]["label"]
    earlier = dict({k: c for k, c in hf.cases(quick=True)[5].items() if k in hf.CASE_FIELDS}, run=label, cap_GiB=24)
    earlier.update(s_per_step=1.0, first_loss=7.0, commit="old", date="then")
    path = tmp_path / "hf-nvidia-h200-quick.json"  # a quick run's results, apart from the full ones
    path.write_text(json.dumps(dict(suite="hf", env={}, quick=True, rows=[earlier])))
    result = hf.run(quick=True, rows=[4], out_dir=tmp_path, env=ENV, device="cpu")
    assert [r["row"] for r in result["rows"]] == [4, 6]
    four, six = result["rows"]
    assert "error" not in four, four
    assert math.isfinite(four["first_loss"]) and four["s_per_step"] > 0 and four["convert_s"] > 0
    assert four["commit"] != "old" and six["commit"] == "old"
    assert six["first_loss_diff"] == pytest.approx(abs(7.0 - four["first_loss"]))
    assert json.loads(path.read_text())["rows"] == result["rows"]


def test_the_calls_list_says_the_host_of_each_call():
    rows = [
        dict(row=1, commit="aaa", date="d1", cpu="Xeon", cores=16),
        dict(row=2, commit="aaa", date="d1", cpu="Xeon", cores=16),
        dict(row=4, commit="aaa", date="d1", cpu="EPYC", cores=16),
        dict(row=5, commit="old", date="d0"),  # measured before rows kept their host
    ]
    assert hf._calls(rows).splitlines() == [
        "- rows 1, 2: commit aaa, d1, Xeon, 16 cores",
        "- rows 4: commit aaa, d1, EPYC, 16 cores",
        "- rows 5: commit old, d0",
    ]
