"""Suite `workloads` (issue 24): workloads a user recognises, each TrainStream run beside the peers
a user would pick instead, measured in the same call.

rows_table() holds the issue's rows 1-11 and their cases: each TrainStream run and the peers
beside it (stock PyTorch uncapped and under the row's cap, the compute bound, bitsandbytes QLoRA
for LoRA rows, torchao's CPUOffloadOptimizer and DeepSpeed ZeRO-2 / ZeRO-3 offload for full
fine-tunes). Every case runs in its own process (bench/workload_cases.py says what one measures)
under the row's VRAM cap (``set_per_process_memory_fraction``): a cap, pinned memory, an
out-of-memory failure and the peak host RSS stay its own. Before the cases, a probe process
measures the rates the bounds divide by (pinned PCIe copies, the host AdamW, a bf16 matmul).

``--rows 1,3,9`` runs some rows, ``--runners deepspeed,torchao`` only those runners' cases of
them: the results merge into benchmarks/results/workloads-<gpu>.json run by run (a run measured
again replaces the one of the same row and label; each keeps its commit, date and the rates of
its own call), so the table can be built over several 10-minute calls, and is written after
every case. Each row's bounds and checks are worked out from the merged runs
(bench/workload_tables.py).

``--quick``: every row at toy sizes on the device there is (the CPU in CI); runners that need
CUDA (torchao, DeepSpeed, the interleaved runner of row 9) are reported as skipped, with why.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import call_stamp, case_in_subprocess, parse_row_numbers, result_stem, write_result
from .models import GPT_1_9B, GPTConfig, hub_config
from .workload_cases import CASES
from .workload_tables import OURS, add_bounds, markdown, plot, row_checks

SUITE = "workloads"
MODULE = "trainstream.bench.workload_cases"  # runs one case in its own process
CAP_GIB = 24
GPT_3_6B = GPTConfig(dim=3072, layers=30, heads=24)  # 3.6B parameters with the 1.9B's vocabulary
GPT_85M = GPTConfig(dim=768, layers=12, heads=12)  # the planner suite's (85M in its blocks)
GPT_BATCH = dict(batch=8, seq=512)
HF_BATCH = dict(batch=4, seq=512)
STEPS = dict(warmup=2, steps=5)
# The planner settles in a run's first steps (measured peaks, moves applied by the 4th forward,
# as the planner suite found): TrainStream's runs are timed after these.
OURS_WARMUP = 5
TRAINER_STEPS = dict(warmup=2, steps=8)  # row 2: 10 steps in all, every loss kept
INTERLEAVED = dict(warmup=4, steps=20, windows=20)  # the planner suite's 85M sweep

# --quick: toy sizes of the same layouts.
TOY_GPT = GPTConfig(dim=64, layers=2, heads=4, vocab=256)
_TOY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TOY_BATCH = dict(batch=2, seq=32)
TOY_STEPS = dict(warmup=2, steps=3)
TOY_INTERLEAVED = dict(warmup=2, steps=3, windows=3)

TORCHAO = "torchao CPUOffloadOptimizer(offload_gradients=True)"


def _zero(stage: int) -> str:
    moved = "optimizer" if stage == 2 else "optimizer and parameters"
    return f"DeepSpeed ZeRO-{stage}, {moved} offloaded to the CPU"


def _cap(cap) -> str:
    return f"under the {cap} GiB cap"


def rows_table(quick: bool = False, device: str = "cuda") -> dict[int, dict]:
    """Row number -> {"title", "cap_gib", "cases"}: every case a dict run_case() takes."""
    steps = TOY_STEPS if quick else STEPS

    def gpt(cfg):
        return {
            "kind": "gpt",
            "name": "toy" if quick else None,
            "config": dataclasses.asdict(TOY_GPT if quick else cfg),
        }

    def hf(name, dtype="bfloat16"):
        fields = dict(hub_config(name), **_TOY_SIZES) if quick else hub_config(name)
        return {"kind": "hf", "name": name, "config": fields, "dtype": dtype}

    def case(runner, label, model, cap, train="full", **extra):
        shape = TOY_BATCH if quick else (GPT_BATCH if model["kind"] == "gpt" else HF_BATCH)
        warm = dict(warmup=OURS_WARMUP) if runner == "trainstream" and not quick else {}
        return dict(
            dict(shape, **steps, device=device, runner=runner, label=label, model=model, cap_gib=cap, train=train),
            **warm,
            **extra,
        )

    def full_peers(model, cap, stock_uncapped=True):
        out = [case("compute", "forward + backward only, uncapped (the compute bound)", model, None)]
        if stock_uncapped:
            out.append(case("stock", "stock: torch.optim.AdamW(fused=True), uncapped", model, None))
        return out + [
            case("stock", f"stock {_cap(cap)}", model, cap),
            case("torchao", f"{TORCHAO} {_cap(cap)}", model, cap),
            case("deepspeed", f"{_zero(2)}, {_cap(cap)}", model, cap, stage=2),
            case("deepspeed", f"{_zero(3)}, {_cap(cap)}", model, cap, stage=3),
        ]

    def lora_peers(model, cap, stock=True):
        out = [case("compute", "forward + backward only, bf16 base, uncapped (the compute bound)", model, None, "lora")]
        if stock:
            out.append(case("stock", "stock: bf16 base, fused AdamW, uncapped", model, None, "lora"))
        return out + [
            case("stock", f"stock: bf16 base {_cap(cap)}", model, cap, "lora"),
            case(
                "bnb",
                f"bitsandbytes QLoRA (NF4 Linear4bit, gradient checkpointing) {_cap(cap)}",
                model,
                cap,
                "lora",
                checkpointing=True,
            ),
        ]

    gpt_1_9b, gpt_3_6b = gpt(GPT_1_9B), gpt(GPT_3_6B)
    qwen_7b, qwen_14b = hf("qwen2.5-7b"), hf("qwen2.5-14b")
    trainer = hf("qwen2.5-1.5b", dtype="float32")
    trainer_steps = TOY_STEPS if quick else TRAINER_STEPS
    rows = {
        1: dict(
            title="1.8B GPT (the engine suite's 1.9B), fp32 weights under bf16 autocast, batch 8x512",
            cap_gib=CAP_GIB,
            cases=full_peers(gpt_1_9b, CAP_GIB)
            + [
                case("trainstream", f"TrainStream defaults {_cap(CAP_GIB)}", gpt_1_9b, CAP_GIB, wrap={}),
                case(
                    "trainstream",
                    f"TrainStream, every block's activations paged, {_cap(CAP_GIB)}",
                    gpt_1_9b,
                    CAP_GIB,
                    wrap=dict(activation_offload=True),
                ),
            ],
        ),
        2: dict(
            title="Qwen2.5-1.5B shapes, full fine-tune through the Trainer (fp32 under bf16=True), batch 4x512, "
            "10 steps",
            cap_gib=CAP_GIB,
            cases=[
                case("compute", "forward + backward only, uncapped (the compute bound)", trainer, None),
                case("trainer_stock", "stock transformers.Trainer, uncapped", trainer, None, **trainer_steps),
                case("trainer_stock", f"stock transformers.Trainer {_cap(CAP_GIB)}", trainer, CAP_GIB, **trainer_steps),
                case("trainer_ours", f"TrainStreamTrainer {_cap(CAP_GIB)}", trainer, CAP_GIB, **trainer_steps),
            ],
        ),
        3: dict(
            title="1.8B GPT, every block paged, bf16 moments, 4 GiB cap",
            cap_gib=4,
            cases=[
                case("compute", "forward + backward only, uncapped (the compute bound)", gpt_1_9b, None),
                case("stock", f"stock {_cap(4)}", gpt_1_9b, 4),
                case("torchao", f"{TORCHAO} {_cap(4)}", gpt_1_9b, 4),
                case("deepspeed", f"{_zero(3)}, {_cap(4)}", gpt_1_9b, 4, stage=3),
                case(
                    "trainstream",
                    "TrainStream, param_offload=True, moment_dtype='bfloat16', under the 4 GiB cap",
                    gpt_1_9b,
                    4,
                    wrap=dict(param_offload=True, moment_dtype="bfloat16"),
                ),
            ],
        ),
        4: dict(
            title="3.6B GPT (d=3072, 30 blocks), full fine-tune, batch 8x512",
            cap_gib=CAP_GIB,
            cases=full_peers(gpt_3_6b, CAP_GIB)
            + [case("trainstream", f"TrainStream defaults {_cap(CAP_GIB)}", gpt_3_6b, CAP_GIB, wrap={})],
        ),
        5: dict(
            title="LoRA r=16, Qwen2.5-7B shapes, bf16 base, every block paged, 8 GiB cap",
            cap_gib=8,
            cases=lora_peers(qwen_7b, 8)
            + [
                case(
                    "trainstream",
                    "TrainStream, param_offload=True, bf16 base, under the 8 GiB cap",
                    qwen_7b,
                    8,
                    "lora",
                    load="none",
                    wrap=dict(param_offload=True, quantize="none"),
                )
            ],
        ),
        6: dict(
            title="LoRA r=16, Qwen2.5-14B shapes, bf16 base: the planner keeps what fits resident, streams the rest",
            cap_gib=CAP_GIB,
            cases=lora_peers(qwen_14b, CAP_GIB)
            + [
                case(
                    "trainstream",
                    f"TrainStream defaults, bf16 base (quantize='none') {_cap(CAP_GIB)}",
                    qwen_14b,
                    CAP_GIB,
                    "lora",
                    load="none",
                    wrap=dict(quantize="none"),
                    memory_plot=True,
                )
            ],
        ),
        7: dict(
            title="LoRA r=16, Qwen2.5-14B shapes, NF4 base chosen by quantize='auto', prefer='speed'",
            cap_gib=CAP_GIB,
            cases=lora_peers(qwen_14b, CAP_GIB, stock=False)
            + [
                case(
                    "trainstream",
                    f"TrainStream, bf16 base loaded, wrap(quantize='auto', prefer='speed') {_cap(CAP_GIB)}",
                    qwen_14b,
                    CAP_GIB,
                    "lora",
                    load="none",
                    wrap=dict(quantize="auto", prefer="speed"),
                )
            ],
        ),
        8: dict(
            title="LoRA r=16, Qwen2.5-32B shapes, NF4 base from load_model(random_weights=True, quantize='nf4')",
            cap_gib=CAP_GIB,
            cases=lora_peers(hf("qwen2.5-32b"), CAP_GIB)
            + [
                case(
                    "trainstream",
                    f"TrainStream defaults, NF4 base {_cap(CAP_GIB)}",
                    hf("qwen2.5-32b"),
                    CAP_GIB,
                    "lora",
                    load="nf4",
                    wrap={},
                    memory_plot=True,
                )
            ],
        ),
        9: dict(
            title="85M GPT that fits: offload='auto' against stock, timed windows interleaved in one process",
            cap_gib=None,
            cases=[
                case(
                    "interleaved",
                    "stock and TrainStream defaults, timed windows in turns",
                    gpt(GPT_85M),
                    None,
                    labels=["stock: torch.optim.AdamW(fused=True)", "TrainStream defaults (offload='auto')"],
                    **(TOY_INTERLEAVED if quick else INTERLEAVED),
                )
            ],
        ),
        10: dict(
            title="Qwen2.5-7B shapes, full fine-tune of every parameter, bf16 weights, bf16 moments",
            cap_gib=CAP_GIB,
            cases=full_peers(qwen_7b, CAP_GIB)
            + [
                case(
                    "trainstream",
                    f"TrainStream, moment_dtype='bfloat16' {_cap(CAP_GIB)}",
                    qwen_7b,
                    CAP_GIB,
                    load="none",
                    wrap=dict(moment_dtype="bfloat16"),
                )
            ],
        ),
        11: dict(
            title="LoRA r=16 on a Llama-3-70B-shaped NF4 base from load_model(random_weights=True)",
            cap_gib=CAP_GIB,
            cases=lora_peers(hf("llama-3-70b"), CAP_GIB, stock=False)
            + [
                case(
                    "trainstream",
                    f"TrainStream defaults, NF4 base {_cap(CAP_GIB)}",
                    hf("llama-3-70b"),
                    CAP_GIB,
                    "lora",
                    load="nf4",
                    wrap={},
                )
            ],
        ),
    }
    for number, row in rows.items():
        for c in row["cases"]:
            c["row"] = number
    return rows


ROWS = tuple(rows_table())


RUNNERS = tuple(r for r in CASES if r != "probe")  # what --runners accepts


def parse_runners(text: str) -> list[str]:
    """'deepspeed,torchao' -> those runners' cases only; anything else a ValueError naming the
    accepted runners."""
    names = sorted({p.strip() for p in str(text).split(",")})
    unknown = [n for n in names if n not in RUNNERS]
    if unknown or not names:
        raise ValueError(f"--runners {text!r}: no runner {unknown[0]!r}; accepted: {', '.join(RUNNERS)}")
    return names


def parse_rows(text: str) -> list[int]:
    """'1,3,9' -> [1, 3, 9]; anything else a ValueError naming the accepted row numbers."""
    return parse_row_numbers(text, ROWS, "row numbers", "1,3,9")


# -- the suite: every case in its own process --------------------------------------------------------


def _why(tail: str) -> str:
    """A failed case's process in a line, from the tail of its output (case_in_subprocess):
    the exception it died of, or the signal that killed it."""
    lines = [line.strip() for line in tail.strip().splitlines() if line.strip()]
    status = None
    if lines and lines[-1].startswith("[exit status "):
        status = int(lines.pop()[len("[exit status ") : -1])
    if status is not None and status < 0:
        return f"killed by signal {-status} (the kernel's out-of-memory killer sends 9: host RAM?)"
    reason = lines[-1][:300] if lines else "no output"
    return reason if status is None else f"{reason} (exit status {status})"


def _measure(case: dict) -> list[dict]:
    """The case's results from its own process: one, or one per run of an interleaved case."""
    t = time.perf_counter()
    try:
        result, error = case_in_subprocess(MODULE, case)
    except subprocess.TimeoutExpired as e:
        result, error = None, f"timed out after {e.timeout:.0f} s"
    wall = time.perf_counter() - t
    if error is not None:
        result = {"error": _why(error)}
    runs = result.pop("runs", None)
    if runs is None:
        return [dict(result, case_wall_s=wall)]
    return [dict(r, case_wall_s=wall) for r in runs]


def _progress(cases: list):
    """(the cases, under a tqdm bar where tqdm is installed; a function that prints a line
    without breaking the bar)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _numbered(cases), print
    bar = tqdm(cases, desc=SUITE, unit="case", file=sys.stdout)

    def labelled():
        for case in bar:
            bar.set_postfix_str(f"row {case['row']}: {case['label'][:60]}")
            yield case

    return labelled(), lambda text: tqdm.write(text, file=sys.stdout)


def _numbered(cases: list):
    for i, case in enumerate(cases):
        print(f"  [{i + 1}/{len(cases)}] row {case['row']}: {case['label']}", flush=True)
        yield case


def run(
    *,
    quick: bool = False,
    rows=None,
    runners=None,
    out_dir: Path = Path("benchmarks/results"),
    device: str | None = None,
    env: dict | None = None,
) -> dict:
    """The chosen rows (default: all; with `runners`, only those runners' cases of them),
    merged into out_dir's results of this suite on this machine run by run: a run measured now
    replaces the one of the same row and label, the others stay as they were measured. The PNG
    beside them. With `env` (the machine's description) the merged results are written after
    every case, so that a call cut short keeps what it finished."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    chosen = list(rows) if rows else list(ROWS)
    table = rows_table(quick, device)
    todo = [c for n in chosen for c in table[n]["cases"] if runners is None or c["runner"] in runners]
    if not todo:
        raise ValueError(f"workloads: rows {chosen} have no case of the runners {sorted(runners)}")
    stamp = call_stamp()
    stem = Path(out_dir) / result_stem(SUITE, _machine(), quick)
    previous = _previous(stem.with_suffix(".json"))
    probe, *_ = _measure(dict(runner="probe", row=0, label="bandwidths and rates", device=device, quick=quick))
    probe.pop("case_wall_s", None)
    cases, say = _progress(todo)
    new, payload = [], None
    for case in cases:
        for result in _measure(case):
            report = result.pop("memory_report", None)
            if report is not None:  # rows 6 and 8: the run's memory timeline, beside the JSON
                result["memory_plot"], result["memory_plot_note"] = _memory_plot(report, stem, case["row"])
            run_row = dict(
                row=case["row"],
                workload=table[case["row"]]["title"],
                run=result.pop("label", case["label"]),
                runner=result.pop("runner", case["runner"]),
                cap_GiB=case["cap_gib"] if device.startswith("cuda") else None,  # no cap applies on the CPU
                **result,
                **stamp,
                rates=probe,
            )
            new.append(run_row)
            say(f"    {json.dumps({k: v for k, v in run_row.items() if k not in ('losses', 'rates')})}")
        payload = merge(previous, new, quick, table)
        payload["plot"], payload["plot_note"] = plot(payload["rows"], stem.with_suffix(".png"))
        if env is not None:
            write_result(Path(out_dir), SUITE, env, dict(payload), markdown(payload), quick=quick)
    payload["markdown"] = markdown(payload)
    return payload


def _memory_plot(report: dict, stem: Path, row: int) -> tuple[str | None, str | None]:
    """trainstream.plot_memory of a case's memory_report(), as STEM-row<N>-memory.png: its
    file name, or None and why not (matplotlib missing)."""
    from ..plot import plot_memory

    path = stem.parent / f"{stem.name}-row{row}-memory.png"
    try:
        plot_memory(report, path, title=f"workloads row {row}: the planner's moves and each step's peak")
    except ImportError as e:
        return None, str(e).split("\n")[0]
    return path.name, None


def _machine() -> dict:
    from .. import _native

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "cores": _native.lib().available_cores()}


def _previous(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def merge(previous: dict | None, runs: list[dict], quick: bool, table: dict) -> dict:
    """`runs` with `previous`'s runs that this call did not measure again (by row and label;
    each keeps its own commit, date and rates), in the table's order, and every row's bounds
    and checks worked out again from them. A quick run and a full one never mix."""
    fresh = {(r["row"], r["run"]) for r in runs}
    kept = []
    if previous is not None and bool(previous.get("quick")) == bool(quick):
        kept = [r for r in previous.get("rows", []) if (r["row"], r["run"]) not in fresh]
    order = {
        (n, label): i
        for n, row in table.items()
        for i, label in enumerate(label for c in row["cases"] for label in c.get("labels", [c["label"]]))
    }
    merged = sorted(kept + runs, key=lambda r: (r["row"], order.get((r["row"], r["run"]), len(order))))
    checks = []
    for n in sorted({r["row"] for r in merged}):
        row_runs = [r for r in merged if r["row"] == n]
        add_bounds(row_runs)
        caps = [r["cap_GiB"] for r in row_runs if r["runner"] in OURS]
        cap = caps[0] if caps else table[n]["cap_gib"] if n in table else None
        checks += row_checks(n, row_runs, cap)
    return dict(quick=quick, rows=merged, checks=checks)
