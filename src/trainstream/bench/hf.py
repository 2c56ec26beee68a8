"""Suite `hf` (GPU): the Hugging Face path (issue 21) against its stock peers, in one run.

- full: a full fine-tune of a Qwen2.5-1.5B-shaped model (transformers' Qwen2Config with the
  published sizes, random weights from one seed, fp32 weights under TrainingArguments(bf16=True),
  fused AdamW), 10 steps on batches of 4x512 random token ids, through TrainStreamTrainer under a
  24 GiB VRAM cap and through the stock transformers.Trainer uncapped and under the same cap
  (where it runs out of memory, that is the result). The same seed, data and arguments; the
  losses side by side (TrainStream computes the chunked loss, the stock Trainer the full
  logits'), s/step the median interval between the Trainer's step ends after 2 warm-up steps.
- lora: LoRA r=16 from peft on every Linear of the blocks over a Qwen2.5-14B-shaped NF4 base
  that ``load_model(random_weights=True, quantize="nf4")`` builds, TrainStream under a 24 GiB cap
  against bitsandbytes QLoRA (Linear4bit, NF4, block 64, no double quantization) uncapped and,
  with gradient checkpointing, under the same cap. The bitsandbytes base is the same one: built
  by load_model, then each block Linear's codes dequantized and quantized again by bitsandbytes
  on the GPU (NF4 values quantize to themselves: the same codes), one tensor at a time, so the
  first losses agree. A plain loop, the same batch every step, 5 timed steps after 5 warm-up
  for every row: wrap()'s planner replans after each of its first steps (Adapter.SETTLE_STEPS),
  and the first pass of the placement it settles on pins its activations' host memory
  (seconds on a 14B): timed from the third step, row 6's mean carried that pass.

Every case runs in its own process (``python -m trainstream.bench.hf CASE``): a VRAM cap and an
out-of-memory failure stay in it, and its peak host RSS is its own (``--quick``: the tiny cases
one after another in one process). ``run_case`` takes a ``device`` and a ``config`` (Qwen2Config
fields), so the tests run each case at toy size on the CPU. Peak VRAM:
``torch.cuda.max_memory_allocated()`` over the whole run of the case. A LoRA case says each
phase's seconds on stderr as it ends (load_model, the conversion to bitsandbytes, peft and wrap
or .to(device), the first step); its row keeps them.

Rows: 1-3 the full fine-tunes (stock, stock capped, TrainStreamTrainer capped), 4-6 the LoRA
runs (QLoRA, QLoRA checkpointed and capped, TrainStream capped), as cases() lists them.
``python -m trainstream.bench hf --rows 4,6`` runs only those and merges them into
benchmarks/results/hf-<gpu>.json row by row (a row measured again replaces its old result, the
others stay, each with the commit and date of the call that measured it), written after every
case, so that a call cut short keeps the rows it finished; the markdown is written again from
the merged rows.

In calls of at most 10 minutes (the device's limit): rows 1,2,3 together (about 150 s for the
three on the H200), then the LoRA rows. A LoRA case's own work before its first step is mostly
load_model's random init of the 14.8G values, drawn on every core (random_draws.py; one thread
draws 5-10 ns a value). A row's case_wall_s (its process, imports included) says how long the
case took: rows whose sum stays under about 500 s can share a call (CASE_TIMEOUT_S stops any
one case at 540 s).
"""

from __future__ import annotations

import gc
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..engine.adapt import Adapter
from ..sizes import GiB
from .common import (
    call_stamp,
    cap_vram,
    case_in_subprocess,
    host_of,
    markdown_table,
    parse_row_numbers,
    result_stem,
    write_result,
)
from .lora import LINEARS
from .models import PUBLISHED

SUITE = "hf"
CAP_GIB = 24
QWEN2_5_1_5B = PUBLISHED["qwen2.5-1.5b"][1]
QWEN2_5_14B = PUBLISHED["qwen2.5-14b"][1]
QUICK = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=1024,
)
FULL_STEPS = dict(warmup=2, steps=10)
# Warm-up past the planner's settling steps and the first pass of the settled placement.
LORA_STEPS = dict(warmup=Adapter.SETTLE_STEPS + 2, steps=5)
BATCH, SEQ = 4, 512
# A case's process is stopped after this long: within one device call (at most 600 s, its start
# included), so that a case that cannot finish in a call leaves a row saying so, with the tail of
# its stderr (the phases it finished), where the call's limit would leave nothing.
CASE_TIMEOUT_S = 540


def qwen2_config(fields: dict):
    import transformers

    config = transformers.Qwen2Config(**fields)
    config.use_cache = False
    return config


class TokenRows(torch.utils.data.Dataset):
    """`rows` rows of `seq` random token ids from one seed; the labels are the ids (the model
    shifts them)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int = 1):
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _sync(device: str, opt=None) -> None:
    """Wait for the device and, with TrainStream, for host updates still in flight."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if opt is not None and hasattr(opt, "synchronize"):
        opt.synchronize()


def _peak_vram_gib(device: str):
    return torch.cuda.max_memory_allocated() / GiB if device.startswith("cuda") else None


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # ru_maxrss: KiB on Linux


def _engine_facts(model) -> dict:
    """What the engine chose, for the row (nothing when the model was not wrapped): how many
    blocks it pages, pages the activations of and recomputes, and every planner decision of the
    run with its numbers (memory_report's plan history: the predicted step beside the measured
    one, in the JSON only), so that one run says why a row is as slow as it is."""
    import trainstream

    try:
        report = trainstream.memory_report(model)
    except ValueError:
        return {}
    return {
        "mode": report["mode"],
        "paged_blocks": len(report["params"]["paged_blocks"]),
        "activation_paged_blocks": len(report["params"]["activation_paged_blocks"]),
        "recompute_blocks": len(report["params"]["recompute_blocks"]),
        "planner": json.loads(json.dumps(report["plan"]["history"], default=_plain)),
    }


def _plain(value):
    """What json cannot write, as it can: a set of blocks as a sorted list, anything else as text."""
    return sorted(value) if isinstance(value, (set, frozenset)) else str(value)


# -- full fine-tune through the Trainer ------------------------------------------------------------


def _step_end_times(device: str):
    """A TrainerCallback that keeps the wall time at each optimizer step's end (the device
    synchronized first): the intervals are the steps' times, host work included, since a step
    waits for what the previous one left in flight."""
    import transformers

    class StepEndTimes(transformers.TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            self.times.append(time.perf_counter())

    return StepEndTimes()


def full_fine_tune(case: dict) -> dict:
    """One Trainer run: case["runner"] "stock" (transformers.Trainer) or "trainstream"
    (TrainStreamTrainer with its defaults); the row's figures."""
    import transformers

    from ..integrations.huggingface import TrainStreamTrainer

    device = case["device"]
    config = qwen2_config(case["config"])
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)  # fp32, initialized by transformers from seed 0
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            use_cpu=device == "cpu",
            report_to="none",
            per_device_train_batch_size=case["batch"],
            max_steps=case["steps"],
            learning_rate=1e-5,
            bf16=True,
            optim="adamw_torch_fused",
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            log_level="error",
            seed=0,
        )
        data = TokenRows(case["batch"] * case["steps"], case["seq"], config.vocab_size)
        timer = _step_end_times(device)
        if case["runner"] == "trainstream":
            trainer = TrainStreamTrainer(model=model, args=args, train_dataset=data, callbacks=[timer], trainstream={})
        else:
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
        setup_s = time.perf_counter() - t0
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    intervals = [b - a for a, b in zip(timer.times, timer.times[1:])][case["warmup"] - 1 :]
    return {
        "s_per_step": statistics.median(intervals),
        "peak_GiB": _peak_vram_gib(device),
        "losses": losses,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "setup_s": setup_s,
        "oom": False,
        **_engine_facts(trainer.model),
    }


# -- LoRA over an NF4 base ---------------------------------------------------------------------------


def _to_bitsandbytes(model, device: str) -> None:
    """Every block Linear whose weight holds NF4 codes (load_model's) as bitsandbytes'
    Linear4bit of the same values, quantized by bitsandbytes where it is moved (`device`), one
    at a time: the dequantized NF4 values quantize to the same codes, and the base never
    exists in bf16 as a whole. The codes cross to the device and are dequantized there: a
    quarter of the bf16 bytes cross, and no bf16 copy is written on the host."""
    import bitsandbytes as bnb

    from ..quant import stored

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LINEARS:
                linear = getattr(parent, name, None)
                if linear is None or stored.codes_of(linear.weight) is None:
                    continue
                codes = stored.take(linear.weight)  # the hooks no longer serve this weight
                if codes.format != "nf4":
                    raise ValueError(f"hf bench: {name} holds {codes.format} codes; bitsandbytes' QLoRA is NF4")
                q = bnb.nn.Linear4bit(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=False,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(
                    codes.to(device).dequantize(),  # quantized again by bitsandbytes at q.to(device)
                    requires_grad=False,
                    compress_statistics=False,
                    quant_type="nf4",
                    blocksize=codes.block_size,
                )
                if linear.bias is not None:
                    q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
                setattr(parent, name, q.to(device))


def _checkpoint_layers(model) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant (the
    frozen embedding's output needs no grad for it); the older name on older transformers."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _phase(case: dict, what: str, t0: float) -> float:
    """Seconds since `t0`, also said on stderr as soon as the phase ends: a case run by hand
    (python -m trainstream.bench.hf CASE) shows where its time goes before its row exists."""
    seconds = time.perf_counter() - t0
    print(f"hf bench, {case.get('label', case['runner'])}: {what} {seconds:.1f} s", file=sys.stderr, flush=True)
    return seconds


def lora(case: dict) -> dict:
    """One LoRA run: case["runner"] "trainstream" (wrap() with its defaults) or "bnb"
    (bitsandbytes' Linear4bit, fused torch AdamW, gradient checkpointing if
    case["checkpointing"]); the row's figures."""
    import peft

    from ..integrations.huggingface import load_model

    device = case["device"]
    with tempfile.TemporaryDirectory() as folder:
        qwen2_config(case["config"]).save_pretrained(folder)  # config.json only: random weights
        t0 = time.perf_counter()
        torch.manual_seed(0)
        base = load_model(folder, random_weights=True, quantize="nf4")
        load_s = _phase(case, "load_model", t0)
        t0 = time.perf_counter()
        if case["runner"] == "bnb":
            _to_bitsandbytes(base, device)
        convert_s = _phase(case, "to bitsandbytes", t0) if case["runner"] == "bnb" else None
    t0 = time.perf_counter()
    lora_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LINEARS), bias="none")
    model = peft.get_peft_model(base, lora_config).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if case["runner"] == "trainstream":
        import trainstream

        model, opt = trainstream.wrap(model, torch.optim.AdamW(trainable, lr=1e-4), device=device)
    else:
        model = model.to(device)
        if case.get("checkpointing"):
            _checkpoint_layers(model.get_base_model())
        opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    setup_s = _phase(case, "peft and wrap" if case["runner"] == "trainstream" else "peft and .to(device)", t0)
    vocab = case["config"]["vocab_size"]
    ids = torch.randint(0, vocab, (case["batch"], case["seq"]), generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first = float(step().detach())
    first_step_s = _phase(case, "first step", t0)
    for _ in range(case["warmup"] - 1):
        step()
    _sync(device, opt)
    t = time.perf_counter()
    for _ in range(case["steps"]):
        loss = step()
    _sync(device, opt)
    s_per_step = (time.perf_counter() - t) / case["steps"]
    return {
        "s_per_step": s_per_step,
        "peak_GiB": _peak_vram_gib(device),
        "host_rss_GiB": _peak_rss_gib(),
        "load_s": load_s,
        "convert_s": convert_s,
        "setup_s": setup_s,
        "first_step_s": first_step_s,
        "first_loss": first,
        "last_loss": float(loss.detach()),
        "trainable": sum(p.numel() for p in trainable),
        "oom": False,
        **_engine_facts(model),
    }


CASES = {"full": full_fine_tune, "lora": lora}


def run_case(case: dict) -> dict:
    """One case, in this process: case["kind"] "full" or "lora", "runner", "device", "config"
    (Qwen2Config fields), "batch", "seq", "warmup", "steps", and "cap_gib" (a VRAM cap, CUDA
    only; None: none). Running out of device memory is a result: {"oom": True, "error"}."""
    if case["kind"] not in CASES:
        raise ValueError(f"hf bench: unknown case kind {case['kind']!r}; accepted: {list(CASES)}")
    # full: the timed intervals are those between step ends after the first `warmup` steps
    # of `steps`; lora: `steps` timed steps come after `warmup` untimed ones.
    timed = case["steps"] - case["warmup"] if case["kind"] == "full" else case["steps"]
    if case["warmup"] < 1 or timed < 1:
        raise ValueError(f"hf bench: warmup={case['warmup']} leaves no timed step of steps={case['steps']}")
    if case["device"].startswith("cuda"):
        # A case's cap, or none: the cases of --quick run one after another in one process.
        gc.collect()
        torch.cuda.empty_cache()
        if case.get("cap_gib"):
            cap_vram(case["cap_gib"])
        else:
            torch.cuda.set_per_process_memory_fraction(1.0)
    try:
        return CASES[case["kind"]](case)
    except torch.OutOfMemoryError as e:
        return {"oom": True, "error": str(e).split("\n")[0][:200]}


def cases(quick: bool, device: str = "cuda") -> list[dict]:
    """The suite's cases in the order of its rows, each with its row number (what --rows
    selects), the label of its row and the name of its model's shapes."""
    shapes = dict(device=device, batch=2 if quick else BATCH, seq=128 if quick else SEQ)
    full = dict(shapes, kind="full", config=QUICK if quick else QWEN2_5_1_5B, **FULL_STEPS)
    low_rank = dict(shapes, kind="lora", config=QUICK if quick else QWEN2_5_14B, **LORA_STEPS)
    if quick:
        full.update(steps=4, model="quick shapes (2 layers, hidden 256)")
        low_rank.update(steps=2, model="quick shapes (2 layers, hidden 256)")
    else:
        full["model"], low_rank["model"] = "Qwen2.5-1.5B shapes", "Qwen2.5-14B shapes"
    todo = [
        dict(full, runner="stock", cap_gib=None, label="stock Trainer"),
        dict(full, runner="stock", cap_gib=CAP_GIB, label=f"stock Trainer under a {CAP_GIB} GiB cap"),
        dict(full, runner="trainstream", cap_gib=CAP_GIB, label=f"TrainStreamTrainer under a {CAP_GIB} GiB cap"),
        dict(low_rank, runner="bnb", cap_gib=None, label="bitsandbytes QLoRA"),
        dict(
            low_rank,
            runner="bnb",
            cap_gib=CAP_GIB,
            checkpointing=True,
            label=f"bitsandbytes QLoRA, gradient checkpointing, under a {CAP_GIB} GiB cap",
        ),
        dict(low_rank, runner="trainstream", cap_gib=CAP_GIB, label=f"TrainStream under a {CAP_GIB} GiB cap"),
    ]
    return [dict(case, row=number) for number, case in enumerate(todo, start=1)]


ROWS = tuple(c["row"] for c in cases(quick=False))  # what --rows accepts


def parse_rows(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; anything else a ValueError naming the flag and the accepted rows."""
    return parse_row_numbers(text, ROWS, "row numbers of the hf suite", "1,2,3")


# What a row repeats of its case, for the table's heading.
CASE_FIELDS = ("row", "kind", "model", "batch", "seq", "warmup", "steps")
# What compare() works out from a row and its peer: stale once the peer is measured again.
COMPARED = ("vs_peer", "first_loss_diff", "max_loss_diff")


def compare(rows: list[dict]) -> None:
    """Each row against its peer: the full fine-tunes' step time and losses against the
    uncapped stock Trainer's, the LoRA runs' first loss against uncapped QLoRA's (the peer's
    row may come from another call: each row says its commit and date)."""
    peers = {
        kind: next((r for r in rows if r["kind"] == kind and r["cap_GiB"] is None and "first_loss" in r), None)
        for kind in CASES
    }
    for r in rows:
        for key in COMPARED:
            r.pop(key, None)
        peer = peers[r["kind"]]
        if peer is None or "first_loss" not in r:
            continue
        r["vs_peer"] = r["s_per_step"] / peer["s_per_step"]
        r["first_loss_diff"] = abs(r["first_loss"] - peer["first_loss"])
        if "losses" in r and len(r["losses"]) == len(peer["losses"]):
            r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], peer["losses"]))


def merge(previous: dict | None, rows: list[dict], quick: bool) -> dict:
    """`rows` with `previous`'s rows that this call did not measure again (by row number and
    run label; each keeps its own commit and date), in the suite's order, compared again. A
    quick run and a full one never mix (a payload that does not say which it is mixes with
    neither), and a previous row that is none of the suite's cases now is dropped."""
    fresh = {(r["row"], r["run"]) for r in rows}
    order = {(c["row"], c["label"]): i for i, c in enumerate(cases(quick))}
    kept = []
    if previous is not None and "quick" in previous and bool(previous["quick"]) == bool(quick):
        kept = [
            r
            for r in previous.get("rows", [])
            if (r.get("row"), r.get("run")) in order and (r.get("row"), r.get("run")) not in fresh
        ]
    merged = sorted(kept + rows, key=lambda r: order.get((r.get("row"), r.get("run")), len(order)))
    compare(merged)
    return {"quick": quick, "rows": merged}


def _measured(batch: list[dict]) -> list[dict]:
    """Each case's result from one process running `batch`, or the error of that process;
    the process's wall time (imports included) with each."""
    t = time.perf_counter()
    results, error = case_in_subprocess("trainstream.bench.hf", batch, timeout=CASE_TIMEOUT_S)
    wall = time.perf_counter() - t
    results = results if error is None else [{"error": error[-300:]}] * len(batch)
    return [dict(result, case_wall_s=wall) for result in results]


def _previous(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run(
    *, quick: bool = False, rows=None, out_dir: Path | None = None, env: dict | None = None, device: str = "cuda"
) -> dict:
    """The chosen rows (numbers of cases(); default: all), each case in its own process; with
    `quick`, all in one process after another (a second import of transformers, peft and
    bitsandbytes would cost more than the tiny cases themselves; their host RSS is then the
    process's peak so far). With `out_dir` (and `env`, the machine's description), the rows
    merge into out_dir's hf-<machine>.json row by row (merge()) and the merged results are
    written after every process, so that a call cut short keeps what it finished. `device`:
    where the cases run (the CPU only for the tests' quick runs: no cap applies there)."""
    if out_dir is not None and env is None:
        raise ValueError("hf bench: out_dir needs env (the machine's description, bench.common.environment())")
    chosen = cases(quick, device)
    if rows is not None:
        unknown = sorted(set(rows) - set(ROWS))
        if unknown or not rows:
            raise ValueError(f"hf bench: rows {sorted(rows)}; accepted: some of {list(ROWS)}")
        chosen = [case for case in chosen if case["row"] in rows]
    stamp = call_stamp()
    path = Path(out_dir) / f"{result_stem(SUITE, env, quick)}.json" if out_dir is not None else None
    previous = _previous(path) if path is not None else None
    batches = [chosen] if quick else [[case] for case in chosen]
    new, payload = [], None
    for batch in batches:
        print(
            "  " + "; ".join(f"row {case['row']}, {case['kind']}: {case['label']}" for case in batch) + " ...",
            flush=True,
        )
        for case, result in zip(batch, _measured(batch)):
            row = {**{k: case[k] for k in CASE_FIELDS}, "run": case["label"], "cap_GiB": case["cap_gib"], **result}
            new.append(dict(row, **stamp))
            print(f"    {json.dumps(new[-1])}", flush=True)
        payload = merge(previous, new, quick)
        if path is not None:
            write_result(path.parent, SUITE, env, dict(payload), markdown(payload["rows"]), quick=quick)
    payload["markdown"] = markdown(payload["rows"])
    return payload


def _calls(rows: list[dict]) -> str:
    """Which call measured which rows: one line per commit, date and host."""
    calls: dict = {}
    for r in rows:
        calls.setdefault((r.get("commit"), r.get("date"), host_of(r)), []).append(str(r.get("row")))
    return "\n".join(
        f"- rows {', '.join(numbers)}: commit {str(commit)[:12]}, {date}{host}"
        for (commit, date, host), numbers in calls.items()
    )


def markdown(rows: list[dict]) -> str:
    full = markdown_table(
        [
            ("row", "row"),
            ("run", "run"),
            ("cap_GiB", "VRAM cap GiB"),
            ("s_per_step", "s/step"),
            ("vs_peer", "x stock"),
            ("peak_GiB", "peak GiB"),
            ("first_loss", "first loss"),
            ("last_loss", "last loss"),
            ("max_loss_diff", "max loss diff vs stock"),
            ("mode", "engine mode"),
            ("paged_blocks", "blocks paged"),
            ("oom", "out of memory"),
            ("error", "error"),
        ],
        [r for r in rows if r["kind"] == "full"],
    )
    low_rank = markdown_table(
        [
            ("row", "row"),
            ("run", "run"),
            ("cap_GiB", "VRAM cap GiB"),
            ("s_per_step", "s/step"),
            ("vs_peer", "x QLoRA"),
            ("peak_GiB", "peak GiB"),
            ("host_rss_GiB", "peak host RSS GiB"),
            ("load_s", "load s"),
            ("convert_s", "to bitsandbytes s"),
            ("setup_s", "setup s"),
            ("first_step_s", "first step s"),
            ("first_loss", "first loss"),
            ("last_loss", "last loss"),
            ("first_loss_diff", "first loss diff vs QLoRA"),
            ("paged_blocks", "blocks paged"),
            ("activation_paged_blocks", "activations paged"),
            ("recompute_blocks", "blocks recomputed"),
            ("oom", "out of memory"),
            ("error", "error"),
        ],
        [r for r in rows if r["kind"] == "lora"],
    )
    text = [f"Measured (each call: the rows it ran, at which commit):\n\n{_calls(rows)}"]
    for kind, table in (("full", full), ("lora", low_rank)):
        case = next((r for r in rows if r["kind"] == kind), None)
        if case is None:
            continue
        batch = f"batch {case['batch']}x{case['seq']}"
        if kind == "full":
            text.append(
                f"Full fine-tune, {case['model']}, random weights, fp32 weights under bf16 autocast, fused AdamW, "
                f"{batch}, {case['steps']} steps (s/step: the median step after {case['warmup']} warm-up steps)."
            )
        else:
            text.append(
                f"LoRA r=16 on every Linear of the blocks, {case['model']}, NF4 base from "
                "load_model(random_weights=True) (load s); bitsandbytes' base: the same codes, quantized again by "
                f"bitsandbytes on the device (bench/hf.py; to bitsandbytes s); setup s: peft and wrap() or .to(device); {batch}, {case['steps']} timed steps "
                f"after {case['warmup']} warm-up; peak host RSS: the process's, loading included."
            )
        text.append(table)
    return "\n\n".join(text)


def main(argument: str) -> str:
    """`python -m trainstream.bench.hf CASES`: one case (a JSON object) or several (a list),
    run in this process; their results as the last line of output, in the same shape."""
    given = json.loads(argument)
    return json.dumps([run_case(c) for c in given] if isinstance(given, list) else run_case(given))


if __name__ == "__main__":
    print(main(sys.argv[1]), flush=True)
