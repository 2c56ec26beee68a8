"""Suite `workloads` (issue 24): workloads a user recognises, each TrainStream run beside the peers
a user would pick instead, measured in one run.

ROWS holds the issue's rows 1-11 (``--rows 1,3,9`` runs some; their results merge into
benchmarks/results/workloads-<gpu>.json by row, each row keeping the commit and date it was
measured at, so the table can be built over several calls). Every case runs in its own process
(``python -m trainstream.bench.workloads CASE``) under the row's VRAM cap
(``set_per_process_memory_fraction``): a cap, pinned memory, an out-of-memory failure and the peak
host RSS stay its own. Hugging Face architectures have their published shapes (bench/models.py
PUBLISHED) and random weights; GPTs are bench/models.py's.

A case reports s/step (the median interval between step ends after the warm-up steps, the
device synchronized at each end; the last step also waits for the host work it left, so host
work is inside the intervals), peak VRAM (``torch.cuda.max_memory_allocated`` over the whole
case), peak host RSS (``getrusage`` of the case's own process), load, wrap and time to the first
step's end (from the case's start), the first and last loss, and what the planner chose.

The row's physical bound is the largest of: compute (the row's forward + backward with no
optimizer, measured in the same run where the model fits uncapped on the GPU; else derived:
6 (full) or 4 (frozen base) x matmul parameters x tokens at the bf16 matmul rate measured in the
same run, attention's own products left out, so it is lower than any real step); PCIe (the
bytes the plan moves, from the run's own byte counts and memory_report, at the pinned rates
measured in the same run: bytes moving both ways at once at the rate of copies in both
directions, the rest at its one-way rate); and the host AdamW (trained parameters at the
host AdamW's rate for the run's moment dtype, measured in the same run). The bandwidths come
from one probe process per call (the engine suite's pinned-copy measurement).

``--quick``: every row at toy sizes on the device there is (the CPU in CI); runners that need
CUDA (torchao, DeepSpeed, the interleaved runner of row 9) are reported as skipped, with why.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..sizes import GiB
from .common import cap_vram, case_in_subprocess, git_commit, machine_slug, markdown_table, write_result
from .models import GPT_1_9B, GPTConfig, hub_config

SUITE = "workloads"
MODULE = "trainstream.bench.workloads"
CAP_GIB = 24
LORA_RANK = 16
GPT_3_6B = GPTConfig(dim=3072, layers=30, heads=24)  # 3.6B parameters with the 1.9B's vocabulary
GPT_85M = GPTConfig(dim=768, layers=12, heads=12)  # the planner suite's (85M in its blocks)
GPT_BATCH = dict(batch=8, seq=512)
HF_BATCH = dict(batch=4, seq=512)
STEPS = dict(warmup=2, steps=5)
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

# Runners: which case function runs them, and which need CUDA (on the CPU they are skipped).
OURS = ("trainstream", "trainer_ours")
NEEDS_CUDA = {
    "torchao": "torchao's CPUOffloadOptimizer offloads the state of CUDA parameters",
    "deepspeed": "DeepSpeed's ZeRO offload runs on an accelerator",
    "interleaved": "the planner suite's interleaved runner trains on CUDA",
}
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
        return dict(
            dict(shape, **steps, device=device, runner=runner, label=label, model=model, cap_gib=cap, train=train),
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
# Extra targets beyond the bound and the peers (issue 24).
MAX_S_PER_STEP = {10: 1.5}
RATIO_TARGET = 1.25


RUNNERS = (
    "compute",
    "stock",
    "trainstream",
    "bnb",
    "torchao",
    "deepspeed",
    "trainer_stock",
    "trainer_ours",
    "interleaved",
)


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
    accepted = f"accepted: comma-separated row numbers from {ROWS[0]} to {ROWS[-1]}, e.g. '1,3,9'"
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--rows {text!r}: {accepted}")
    numbers = sorted({int(p) for p in parts})
    unknown = [n for n in numbers if n not in ROWS]
    if unknown:
        raise ValueError(f"--rows {text!r}: no row {unknown[0]}; {accepted}")
    return numbers


# -- one case, in its own process ------------------------------------------------------------------


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # ru_maxrss: KiB on Linux


def _first_line(e: BaseException) -> str:
    text = str(e).strip().split("\n")[0][:240]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _build_gpt(model_spec: dict, on: str):
    from .models import GPT

    torch.manual_seed(0)
    with torch.device(on):
        return GPT(GPTConfig(**model_spec["config"]))


def _build_hf(model_spec: dict, on: str):
    """The architecture at its shapes on `on`, initialized by transformers (values are
    random: only the shapes are measured), in the spec's dtype."""
    import transformers

    config = transformers.AutoConfig.for_model(**model_spec["config"])
    config.use_cache = False
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(_dtype(model_spec["dtype"]))
    try:
        with torch.device(on):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    return model


def _load_hf(model_spec: dict, quantize: str):
    """load_model(random_weights=True) from the spec's config.json: block weights quantized as
    they are made when `quantize` says so; in host memory."""
    from ..integrations.huggingface import load_model

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(model_spec["config"]))
        torch.manual_seed(0)
        model = load_model(folder, random_weights=True, quantize=quantize, dtype=_dtype(model_spec["dtype"]))
    model.config.use_cache = False
    return model


def _add_lora(model):
    import peft

    from .lora import LINEARS

    config = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=list(LINEARS), bias="none"
    )
    return peft.get_peft_model(model, config)


def _blocks(model, hf: bool) -> list:
    if hf:
        from ..integrations.huggingface.wrap import decoder_layers

        layers = decoder_layers(model)
        if layers:
            return layers
    from ..engine.blocks import find_blocks

    return find_blocks(model).blocks


def block_facts(model, blocks: list, autocast: bool) -> dict:
    """Byte counts of the model as it is before wrap(), for the PCIe bound: per block, the
    trained bytes (a gradient goes out, new weights come back to a resident block) and the
    bytes one crossing of its weights moves (stored codes as stored; under bf16 autocast an
    fp32 matrix travels as bf16, as the engine fetches it); the trained bytes outside the
    blocks; and the matmul parameters (2-D weights but embeddings), for a derived compute
    bound."""
    from ..quant import stored

    def crossing(p) -> int:
        codes = stored.codes_of(p)
        if codes is not None:
            return codes.nbytes
        if autocast and p.dtype == torch.float32 and p.dim() == 2:
            return p.numel() * 2
        return p.numel() * p.element_size()

    inside, per_block, stored_codes = set(), [], False
    for block in blocks:
        trained = fetch_trained = fetch_frozen = 0
        for p in block.parameters():
            inside.add(id(p))
            stored_codes = stored_codes or stored.codes_of(p) is not None
            if p.requires_grad:
                trained += p.numel() * p.element_size()
                fetch_trained += crossing(p)
            else:
                fetch_frozen += crossing(p)
        per_block.append(dict(trained_bytes=trained, fetch_trained=fetch_trained, fetch_frozen=fetch_frozen))
    params = list(model.parameters())
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}

    def numel(p) -> int:
        codes = stored.codes_of(p)
        return math.prod(codes.shape) if codes is not None else p.numel()

    return dict(
        blocks=per_block,
        outside_trained_bytes=sum(
            p.numel() * p.element_size() for p in params if p.requires_grad and id(p) not in inside
        ),
        trained_params=sum(p.numel() for p in params if p.requires_grad),
        matmul_params=sum(numel(p) for p in params if (p.dim() == 2 or stored.codes_of(p)) and id(p) not in embeddings),
        stored_codes=stored_codes,
    )


def plan_facts(model) -> dict:
    """What the engine chose (memory_report), for the row; {} for a model it does not hold."""
    import trainstream

    try:
        report = trainstream.memory_report(model)
    except ValueError:
        return {}
    plan = report["plan"]
    return dict(
        mode=report["mode"],
        paged_blocks=list(report["params"]["paged_blocks"]),
        activation_paged_blocks=list(report["params"]["activation_paged_blocks"]),
        quantize=report["params"]["quantize"],
        quantized_bytes=[plan["quantized"]["bytes_before"], plan["quantized"]["bytes_after"]],
        moment_dtype=plan["moment_dtype"],
        optimizer_mode=plan["optimizer_mode"],
        activation_bytes={int(k): int(v) for k, v in plan["activation_bytes_per_block"].items()},
        plan_moves=sum(1 for h in plan["history"] if h["kind"] == "applied"),
    )


def step_traffic(facts: dict, plan: dict) -> dict:
    """Bytes one training step moves over PCIe each way, from block_facts() and plan_facts().

    Host AdamW (optimizer_mode "cpu"): every gradient goes out; new weights come back to each
    resident unit; a paged block's weights come in twice (forward, backward), but the stack's
    last block once (its weights stay from its forward to its backward). optimizer_mode "gpu":
    gradients stay, both moments cross each way instead. A paged block's saved activations go
    out and come back once. A model the engine switched to stock training moves nothing.
    Weights quantized by wrap() (not stored as codes before it) count at the quantized size."""
    if plan.get("mode") == "stock":
        return dict(h2d_bytes=0, d2h_bytes=0)
    blocks = facts["blocks"]
    paged, act_paged = set(plan["paged_blocks"]), set(plan["activation_paged_blocks"])
    before, after = plan.get("quantized_bytes") or (0, 0)
    frozen_scale = after / before if before and not facts["stored_codes"] and plan["quantize"] != "none" else 1.0
    last = len(blocks) - 1
    fetches = sum(
        (b["fetch_trained"] + b["fetch_frozen"] * frozen_scale) * (1 if i == last else 2)
        for i, b in enumerate(blocks)
        if i in paged
    )
    acts = sum(plan["activation_bytes"].get(i, 0) for i in act_paged)
    trained = sum(b["trained_bytes"] for b in blocks) + facts["outside_trained_bytes"]
    if plan["optimizer_mode"] == "gpu":
        moment_size = 2 if plan["moment_dtype"] == "bfloat16" else 4
        moments = 2 * moment_size * facts["trained_params"]
        return dict(h2d_bytes=int(fetches + acts + moments), d2h_bytes=int(acts + moments))
    resident_trained = trained - sum(b["trained_bytes"] for i, b in enumerate(blocks) if i in paged)
    return dict(h2d_bytes=int(fetches + acts + resident_trained), d2h_bytes=int(acts + trained))


def _timed_steps(step, settle, case: dict, t0: float) -> dict:
    """warmup + steps training steps; s/step the median interval between step ends after the
    warm-up (each end waits for the device; the last also for the host work left)."""
    ends, losses = [], []
    for i in range(case["warmup"] + case["steps"]):
        losses.append(float(step()))
        _sync(case["device"])
        if i == case["warmup"] + case["steps"] - 1:
            settle()
        ends.append(time.perf_counter())
    intervals = [b - a for a, b in zip(ends[case["warmup"] - 1 :], ends[case["warmup"] :])]
    return dict(
        s_per_step=statistics.median(intervals),
        first_step_s=ends[0] - t0,
        first_loss=losses[0],
        last_loss=losses[-1],
        losses=losses,
        finite=all(math.isfinite(v) for v in losses),
    )


def _deepspeed(model, case: dict):
    """deepspeed.initialize() alone, one process, no launcher. With no ops built, its CPU Adam
    needs a JIT build; where that fails, ZeRO-Offload runs torch's AdamW on the CPU
    (torch_adam) and the row says why."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + case["row"]), RANK="0", LOCAL_RANK="0")
    os.environ["WORLD_SIZE"] = "1"
    import deepspeed

    zero = {"stage": case["stage"], "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if case["stage"] == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": case["batch"],
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
        return engine, None
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - the op build's failure is the row's note
        config["optimizer"]["params"]["torch_adam"] = True
        config["zero_force_ds_cpu_optimizer"] = False  # DeepSpeed refuses another CPU optimizer otherwise
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
        return engine, f"DeepSpeedCPUAdam did not build ({_first_line(e)}): torch AdamW on the CPU in its place"


def train_case(case: dict) -> dict:
    """One run of a model in a plain loop: runner "compute" (forward + backward only),
    "stock", "trainstream", "bnb", "torchao" or "deepspeed"."""
    t0 = time.perf_counter()
    runner, device, spec = case["runner"], case["device"], case["model"]
    hf, lora = spec["kind"] == "hf", case["train"] == "lora"
    cuda = device.startswith("cuda")
    autocast = cuda and (spec["kind"] == "gpt" or spec.get("dtype") == "float32")
    if runner in ("trainstream", "bnb"):
        model = (
            _load_hf(spec, "nf4" if runner == "bnb" else case.get("load", "none")) if hf else _build_gpt(spec, "cpu")
        )
        if runner == "bnb":
            from .hf import _to_bitsandbytes

            _to_bitsandbytes(model, device)
    else:
        on = "cpu" if runner == "deepspeed" else device
        model = _build_hf(spec, on) if hf else _build_gpt(spec, on)
    if lora:
        model = _add_lora(model)
    model.train()
    load_s = time.perf_counter() - t0
    trainable = [p for p in model.parameters() if p.requires_grad]
    out, facts, opt, engine = {}, None, None, None
    t = time.perf_counter()
    if runner == "trainstream":
        import trainstream

        facts = block_facts(model, _blocks(model, hf), autocast)
        base_opt = torch.optim.AdamW(trainable, lr=1e-4)
        if hf:
            from ..integrations.huggingface import wrap_hf

            model, opt = wrap_hf(model, base_opt, device=device, **case["wrap"])
        else:
            model, opt = trainstream.wrap(model, base_opt, device=device, **case["wrap"])
    elif runner in ("stock", "bnb"):
        model = model.to(device)
        if case.get("checkpointing"):
            from .hf import _checkpoint_layers

            _checkpoint_layers(model.get_base_model())
        opt = torch.optim.AdamW(trainable, lr=1e-4, fused=cuda)
    elif runner == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(trainable, torch.optim.AdamW, offload_gradients=True, lr=1e-4, fused=True)
    elif runner == "deepspeed":
        engine, note = _deepspeed(model, case)
        if note:
            out["note"] = note
    elif runner != "compute":
        raise ValueError(f"workloads: unknown runner {runner!r}")
    wrap_s = time.perf_counter() - t

    vocab = spec["config"]["vocab"] if not hf else spec["config"]["vocab_size"]
    ids = torch.randint(0, vocab, (case["batch"], case["seq"]), generator=torch.Generator().manual_seed(1)).to(device)
    target = torch.roll(ids, -1, 1)
    caller = engine if engine is not None else model

    def step():
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = caller(input_ids=ids, labels=ids).loss if hf else caller(ids, target)
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            if opt is None:
                for p in trainable:
                    p.grad = None
            else:
                opt.step()
                opt.zero_grad()
        return loss.detach()

    def settle():
        if hasattr(opt, "synchronize"):
            opt.synchronize()

    out.update(_timed_steps(step, settle, case, t0))
    out.update(
        load_s=load_s, wrap_s=wrap_s, trainable=sum(p.numel() for p in trainable), tokens=case["batch"] * case["seq"]
    )
    if facts is not None:
        plan = plan_facts(model)
        out.update(plan, trained_params=facts["trained_params"], matmul_params=facts["matmul_params"])
        if plan:
            out.update(step_traffic(facts, plan))
    elif runner == "compute":
        out["matmul_params"] = block_facts(model, [], False)["matmul_params"]
    return out


def trainer_case(case: dict) -> dict:
    """Row 2: one transformers Trainer run (runner "trainer_stock") or TrainStreamTrainer with
    its defaults ("trainer_ours"), the hf suite's data and arguments; every step's loss."""
    import transformers

    from ..integrations.huggingface import TrainStreamTrainer
    from .hf import TokenRows, _step_end_times

    t0 = time.perf_counter()
    device = case["device"]
    model = _build_hf(case["model"], "cpu")  # fp32; the Trainer moves it
    load_s = time.perf_counter() - t0
    total = case["warmup"] + case["steps"]
    ours = case["runner"] == "trainer_ours"
    facts = block_facts(model, _blocks(model, True), device.startswith("cuda")) if ours else None
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            use_cpu=device == "cpu",
            report_to="none",
            per_device_train_batch_size=case["batch"],
            max_steps=total,
            learning_rate=1e-5,
            bf16=device.startswith("cuda"),
            optim="adamw_torch_fused",
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            log_level="error",
            seed=0,
        )
        data = TokenRows(case["batch"] * total, case["seq"], case["model"]["config"]["vocab_size"])
        timer = _step_end_times(device)
        t = time.perf_counter()
        kind = TrainStreamTrainer if ours else transformers.Trainer
        extra = {"trainstream": {}} if ours else {}
        trainer = kind(model=model, args=args, train_dataset=data, callbacks=[timer], **extra)
        wrap_s = time.perf_counter() - t  # TrainStreamTrainer wraps when train() starts: in the first step
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    intervals = [b - a for a, b in zip(timer.times[case["warmup"] - 1 :], timer.times[case["warmup"] :])]
    out = dict(
        s_per_step=statistics.median(intervals),
        first_step_s=timer.times[0] - t0,
        first_loss=losses[0],
        last_loss=losses[-1],
        losses=losses,
        finite=all(math.isfinite(v) for v in losses),
        load_s=load_s,
        wrap_s=wrap_s,
    )
    if facts is not None:
        plan = plan_facts(trainer.model)
        out.update(plan, trained_params=facts["trained_params"], matmul_params=facts["matmul_params"])
        if plan:
            out.update(step_traffic(facts, plan))
    return out


def interleaved_case(case: dict) -> dict:
    """Row 9: the planner suite's sweep of the 85M GPT, stock and the defaults alive in one
    process, their timed windows in turns; one run each."""
    from . import planner

    runs = planner.run_sweep(
        dict(
            model="gpt-85m",
            cap_gib=None,
            settings=["stock", {}],
            warmup=case["warmup"],
            steps=case["steps"],
            windows=case["windows"],
            interleave=True,
        )
    )
    out = []
    for label, runner, r in zip(case["labels"], ("stock", "trainstream"), runs):
        out.append(
            dict(
                label=label,
                runner=runner,
                s_per_step=r["s_per_step"],
                window_s_per_step=r["window_s_per_step"],
                peak_GiB=r["peak_GiB"],
                last_loss=r["loss"],
                wrap_s=r["wrap_s"],
                finite=math.isfinite(r["loss"]),
                **{k: r[k] for k in ("mode", "paged_blocks", "activation_paged_blocks", "moves") if k in r},
            )
        )
    return {"runs": out}


def probe_case(case: dict) -> dict:
    """What the bounds divide by, measured now: pinned PCIe copies (the engine suite's
    measurement), the host AdamW's rate for fp32 and bf16 moments, the bf16 matmul rate."""
    from .common import cuda_median_seconds, median_seconds

    quick, cuda = case["quick"], case["device"].startswith("cuda")
    out = {}
    if cuda:
        from .optimizer_gpu import pcie_GBps

        out["pcie_GBps"] = pcie_GBps(1 << (26 if quick else 30))
    out["host_adamw_params_per_s"] = {d: _host_adamw_rate(d, quick) for d in ("float32", "bfloat16")}
    n = 256 if quick else 8192
    a = torch.randn(n, n, device=case["device"], dtype=torch.bfloat16)
    b = torch.randn(n, n, device=case["device"], dtype=torch.bfloat16)
    if cuda:
        seconds = cuda_median_seconds(lambda: a @ b, iters=10)
    else:
        seconds = median_seconds(lambda: a @ b, iters=3)
    out["matmul_TFLOPs"] = 2 * n**3 / seconds / 1e12
    return out


def _host_adamw_rate(moment_dtype: str, quick: bool) -> float:
    """Parameters per second of the host AdamW with fp32 gradients and `moment_dtype` moments,
    at a size far beyond any cache (the engine suite's: 24 x 4096 x 4096), median of 5 steps
    after one that wakes the pool."""
    from ..ops import adamw_step

    count, numel = (2, 1 << 18) if quick else (24, 4096 * 4096)
    dtype = _dtype(moment_dtype)
    params, grads = ([torch.zeros(numel) for _ in range(count)] for _ in range(2))
    m, v = ([torch.zeros(numel, dtype=dtype) for _ in range(count)] for _ in range(2))
    times = []
    for step in range(1, 7):
        t = time.perf_counter()
        adamw_step(params, grads, m, v, [step] * count, lr=1e-4, weight_decay=0.01, seeds=[1] * count).wait()
        times.append(time.perf_counter() - t)
    return count * numel / statistics.median(times[1:])


CASES = {
    "compute": train_case,
    "stock": train_case,
    "trainstream": train_case,
    "bnb": train_case,
    "torchao": train_case,
    "deepspeed": train_case,
    "trainer_stock": trainer_case,
    "trainer_ours": trainer_case,
    "interleaved": interleaved_case,
    "probe": probe_case,
}


def run_case(case: dict) -> dict:
    """One case, in this process. Running out of memory is a result ({"oom": True, "error"}),
    and so is a peer that will not import or run ({"error": its exception's first line}); a
    runner that needs CUDA on a machine without it is {"skipped": why}."""
    runner = case["runner"]
    if runner not in CASES:
        raise ValueError(f"workloads: unknown runner {runner!r}; accepted: {sorted(CASES)}")
    cuda = case["device"].startswith("cuda")
    if not cuda and runner in NEEDS_CUDA:
        return {"skipped": f"needs CUDA: {NEEDS_CUDA[runner]}"}
    if cuda:
        cap_vram(case.get("cap_gib"))
    try:
        out = CASES[runner](case)
    except torch.OutOfMemoryError as e:
        out = {"oom": True, "error": _first_line(e)}
    except MemoryError as e:  # DoesNotFit: wrap() or load_model() refused before anything moved
        out = {"oom": True, "error": _first_line(e)}
    except Exception as e:  # noqa: BLE001 - a peer that will not run says why in its row
        out = {"error": _first_line(e)}
    if isinstance(out, dict) and "runs" not in out:
        out["host_rss_GiB"] = _peak_rss_gib()
        if cuda and "peak_GiB" not in out:
            out["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
    return out


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
    stamp = dict(commit=git_commit(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    stem = Path(out_dir) / f"{SUITE}-{machine_slug(_machine())}"
    previous = _previous(stem.with_suffix(".json"))
    probe, *_ = _measure(dict(runner="probe", row=0, label="bandwidths and rates", device=device, quick=quick))
    probe.pop("case_wall_s", None)
    cases, say = _progress(todo)
    new, payload = [], None
    for case in cases:
        for result in _measure(case):
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
            write_result(Path(out_dir), SUITE, env, dict(payload), markdown(payload))
    payload["markdown"] = markdown(payload)
    return payload


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


# -- bounds and checks (arithmetic on the measured numbers) ------------------------------------------


def pcie_seconds(h2d_bytes: float, d2h_bytes: float, bw: dict) -> float:
    """The least time the copies can take: bytes moving both ways at once at the measured rate
    of copies in both directions (each way), what is left of one direction at its own rate."""
    both = min(h2d_bytes, d2h_bytes)
    return (
        both / (bw["bidir_each_way"] * 1e9)
        + (h2d_bytes - both) / (bw["h2d"] * 1e9)
        + (d2h_bytes - both) / (bw["d2h"] * 1e9)
    )


def _ok(r: dict) -> bool:
    return "s_per_step" in r and not r.get("oom") and "error" not in r


def add_bounds(runs: list[dict]) -> None:
    """Each TrainStream run of a row gains its bound (compute, PCIe, host AdamW: at the rates
    measured in its own call, its "rates") and its ratio."""
    compute = next((r for r in runs if r["runner"] == "compute"), None)
    stock = next((r for r in runs if r["runner"] == "stock" and _ok(r)), None)
    for r in runs:
        if r["runner"] not in OURS or not _ok(r):
            continue
        probe = r.get("rates") or {}
        if compute is not None and _ok(compute):
            compute_s, how = compute["s_per_step"], "measured: forward + backward, uncapped"
        elif "window_s_per_step" in r and stock is not None:
            compute_s, how = stock["s_per_step"], "stock's step, interleaved in the same process"
        elif r.get("matmul_params") and r.get("tokens") and probe.get("matmul_TFLOPs"):
            # A frozen base (LoRA) makes no weight gradients: 4 products per weight, not 6.
            factor = 4 if r.get("trained_params", 0) < r["matmul_params"] / 2 else 6
            rate = probe["matmul_TFLOPs"]
            compute_s = factor * r["matmul_params"] * r["tokens"] / (rate * 1e12)
            how = f"derived: {factor} x {r['matmul_params'] / 1e9:.3g}B x {r['tokens']} tokens at {rate:.3g} TFLOP/s"
        else:
            compute_s, how = None, None
        pcie_s = None
        if "pcie_GBps" in probe and "h2d_bytes" in r:
            pcie_s = pcie_seconds(r["h2d_bytes"], r["d2h_bytes"], probe["pcie_GBps"])
        host_s = None
        rates = probe.get("host_adamw_params_per_s")
        if rates and r.get("optimizer_mode") == "cpu" and r.get("mode") != "stock" and r.get("trained_params"):
            host_s = r["trained_params"] / rates[r.get("moment_dtype", "float32")]
        parts = {"compute": compute_s, "PCIe": pcie_s, "host AdamW": host_s}
        known = {k: v for k, v in parts.items() if v is not None}
        if not known:
            continue
        by = max(known, key=known.get)
        r.update(
            compute_s=compute_s,
            compute_how=how,
            pcie_s=pcie_s,
            host_adamw_s=host_s,
            bound_s=known[by],
            bound_by=by,
            vs_bound=r["s_per_step"] / known[by],
        )


def _check(row: int, text: str, value, op: str, limit) -> dict:
    met = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and limit is not None:
        met = value <= limit if op == "<=" else value < limit
    return dict(row=row, check=text, value=value, target=f"{op} {limit}" if limit is not None else "-", met=met)


def row_checks(row: int, runs: list[dict], cap) -> list[dict]:
    """The row's checks: each TrainStream run against its bound; the first one against every
    peer that fits under the row's cap; the row's own extra target."""
    checks = []
    ours = [r for r in runs if r["runner"] in OURS]
    for r in ours:
        if "vs_bound" in r:
            checks.append(
                _check(
                    row,
                    f"{r['run']}: step / bound ({r['bound_by']}, {r['bound_s']:.3g} s)",
                    r["vs_bound"],
                    "<=",
                    RATIO_TARGET,
                )
            )
        elif not _ok(r):
            checks.append(_check(row, f"{r['run']}: trains", "no", "-", None))
    first = next((r for r in ours if _ok(r)), None)
    peers = [r for r in runs if r["runner"] not in OURS + ("compute",) and r.get("cap_GiB") == cap]
    if first is not None and peers:
        fits = [p for p in peers if _ok(p)]
        if "window_s_per_step" in first and fits:
            stock = fits[0]
            ratio = statistics.median(first["window_s_per_step"]) / statistics.median(stock["window_s_per_step"])
            checks.append(
                _check(
                    row,
                    f"defaults / stock, ratio of the medians of {len(stock['window_s_per_step'])} interleaved windows",
                    ratio,
                    "<=",
                    1.02,
                )
            )
        elif fits:
            best = min(fits, key=lambda p: p["s_per_step"])
            checks.append(
                _check(
                    row,
                    f"ours / the fastest peer that fits ({best['run']})",
                    first["s_per_step"] / best["s_per_step"],
                    "<",
                    1.0,
                )
            )
        else:
            checks.append(
                _check(row, f"peers that fit: none of {len(peers)} (out of memory, failed or skipped)", "-", "-", None)
            )
    if first is not None and row in MAX_S_PER_STEP:
        checks.append(_check(row, f"{first['run']}: s/step", first["s_per_step"], "<=", MAX_S_PER_STEP[row]))
    if first is not None:
        checks.append(
            _check(row, f"{first['run']}: every loss finite", "yes" if first.get("finite") else "no", "-", None)
        )
    stock = next((r for r in runs if r["runner"] == "trainer_stock" and r.get("cap_GiB") is None and _ok(r)), None)
    if first is not None and stock is not None and len(first.get("losses", [])) == len(stock.get("losses", [])):
        diff = max(abs(a - b) for a, b in zip(first["losses"], stock["losses"]))
        checks.append(
            _check(row, "largest loss difference from the uncapped stock Trainer, step by step", diff, "-", None)
        )
    return checks


# -- the tables and the plot ---------------------------------------------------------------------------


def _planner(r: dict) -> str | None:
    """What the planner chose, in a cell."""
    if "mode" not in r:
        return None
    if r["mode"] == "stock":
        return "switched to stock"
    parts = [f"{len(r['paged_blocks'])} paged", f"{len(r['activation_paged_blocks'])} act. paged"]
    if r.get("quantize") not in (None, "none"):
        parts.append(r["quantize"])
    if "moment_dtype" in r:
        parts.append(f"{r['moment_dtype']} moments")
    if "optimizer_mode" in r:
        parts.append(f"optimizer {r['optimizer_mode']}")
    return ", ".join(parts)


def _outcome(r: dict) -> str | None:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    if r.get("oom"):
        return f"out of memory: {r.get('error', '')}".strip()
    return r.get("error") or r.get("note")


def _gb(n) -> float | None:
    return None if n is None else n / 1e9


def _rates(probe: dict) -> str:
    text = ""
    bw = probe.get("pcie_GBps")
    if bw:
        text += (
            f"; pinned H2D {bw['h2d']:.1f}, D2H {bw['d2h']:.1f}, both at once {bw['bidir_each_way']:.1f} GB/s each way"
        )
    host = probe.get("host_adamw_params_per_s")
    if host:
        text += (
            f"; host AdamW {host['float32'] / 1e9:.2f} (fp32 moments), {host['bfloat16'] / 1e9:.2f} (bf16) G params/s"
        )
    if probe.get("matmul_TFLOPs"):
        text += f"; bf16 matmul {probe['matmul_TFLOPs']:.3g} TFLOP/s"
    if probe.get("error"):
        text += f"; rates not measured: {probe['error']}"
    return text


def markdown(payload: dict) -> str:
    rows = payload["rows"]
    by_row = {}
    for r in rows:
        by_row.setdefault(r["row"], r["workload"])
    firsts = {}
    for r in rows:
        if r["runner"] in OURS and _ok(r):
            firsts.setdefault(r["row"], r["s_per_step"])
    cells = []
    for r in rows:
        mine = firsts.get(r["row"])
        cells.append(
            dict(
                r,
                vs_ours=r["s_per_step"] / mine if mine and _ok(r) else None,
                s=r.get("s_per_step") if _ok(r) else None,
                planner=_planner(r),
                outcome=_outcome(r),
            )
        )
    runs = markdown_table(
        [
            ("row", "row"),
            ("run", "run"),
            ("cap_GiB", "VRAM cap GiB"),
            ("s", "s/step"),
            ("vs_ours", "x ours"),
            ("peak_GiB", "peak VRAM GiB"),
            ("host_rss_GiB", "peak host RSS GiB"),
            ("load_s", "load s"),
            ("wrap_s", "wrap s"),
            ("first_step_s", "first step s"),
            ("first_loss", "first loss"),
            ("last_loss", "last loss"),
            ("planner", "planner"),
            ("outcome", "out of memory, error or note"),
        ],
        cells,
    )
    bounded = [
        dict(r, h2d=_gb(r.get("h2d_bytes")), d2h=_gb(r.get("d2h_bytes")))
        for r in rows
        if r["runner"] in OURS and ("bound_s" in r or "bound_note" in r)
    ]
    bounds = markdown_table(
        [
            ("row", "row"),
            ("run", "run"),
            ("s_per_step", "s/step"),
            ("compute_s", "compute s"),
            ("compute_how", "compute, how"),
            ("h2d", "H2D GB"),
            ("d2h", "D2H GB"),
            ("pcie_s", "PCIe s"),
            ("host_adamw_s", "host AdamW s"),
            ("bound_s", "bound s"),
            ("bound_by", "set by"),
            ("vs_bound", "s/step / bound"),
        ],
        bounded,
    )
    checks = markdown_table(
        [("row", "row"), ("check", "check"), ("value", "measured"), ("target", "target"), ("met", "met")],
        [dict(c, met={True: "yes", False: "no"}.get(c["met"], "-")) for c in payload["checks"]],
    )
    totals, calls = {}, {}
    for r in rows:  # each call: its commit, date and rates, and how many runs of which rows it measured
        totals[r["row"]] = totals.get(r["row"], 0) + 1
        call = calls.setdefault((r.get("commit"), r.get("date")), dict(rates=r.get("rates") or {}, rows={}))
        call["rows"][r["row"]] = call["rows"].get(r["row"], 0) + 1
    measured = []
    for (commit, date), call in calls.items():
        done = [f"{n}" if k == totals[n] else f"{n} ({k} of its {totals[n]} runs)" for n, k in call["rows"].items()]
        measured.append(f"- rows {', '.join(done)}: commit {str(commit)[:12]}, {date}{_rates(call['rates'])}")
    titles = [f"{n}. {title}" for n, title in sorted(by_row.items())]
    quick = (
        "Quick run: toy sizes of every row (not results); on the CPU no VRAM cap applies.\n\n"
        if payload["quick"]
        else ""
    )
    plot_line = f"\n\nPlot: {payload['plot_note']}" if payload.get("plot_note") else ""
    return (
        quick
        + "Rows:\n\n"
        + "\n".join(titles)
        + "\n\nMeasured (each call: the rows it ran, at which commit, and the rates its bounds use):\n\n"
        + "\n".join(measured)
        + "\n\n"
        + runs
        + "\n\nEach TrainStream run against its physical bound (the largest of compute, PCIe and the host AdamW; "
        "bench/workloads.py says how each is measured):\n\n" + bounds + "\n\n" + checks + plot_line
    )


def plot(rows: list[dict], path: Path) -> tuple[str | None, str | None]:
    """s/step and peak VRAM of every run, row by row, ours against the peers, as a PNG at
    `path`: (its file name, None), or (None, why not) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return None, f"not drawn: matplotlib is not installed ({_first_line(e)})"
    shown = [r for r in rows if r["runner"] != "compute"]
    if not shown:
        return None, "not drawn: no runs"
    labels = [f"{r['row']}: {r['run'][:70]}" for r in shown]
    colors = ["tab:orange" if r["runner"] in OURS else "tab:blue" for r in shown]
    fig, axes = plt.subplots(1, 2, figsize=(16, 0.32 * len(shown) + 1.5), sharey=True)
    y = list(range(len(shown)))
    for ax, key, title in ((axes[0], "s_per_step", "s/step (log)"), (axes[1], "peak_GiB", "peak VRAM GiB")):
        values = [r[key] if _ok(r) and r.get(key) is not None else math.nan for r in shown]
        ax.barh(y, values, color=colors)
        for i, r in enumerate(shown):
            if not _ok(r):  # at the axis' left edge: a log axis has no 0
                word = "out of memory" if r.get("oom") else "skipped" if r.get("skipped") else "failed"
                ax.text(0.01, i, word, va="center", fontsize=7, transform=ax.get_yaxis_transform())
        ax.set_title(title)
        if key == "s_per_step" and any(math.isfinite(v) for v in values):
            ax.set_xscale("log")
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle("workloads: TrainStream (orange) against the peers (blue), each under its row's VRAM cap")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name, None


if __name__ == "__main__":
    print(json.dumps(run_case(json.loads(sys.argv[1]))), flush=True)
