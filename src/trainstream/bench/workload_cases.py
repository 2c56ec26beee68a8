"""The workloads suite's cases (bench/workloads.py), one in this process:
``python -m trainstream.bench.workload_cases CASE`` prints its result as the last line.

A case builds its model (GPTs from bench/models.py; Hugging Face architectures at their published
shapes with random weights: built on the GPU by transformers for stock and the compute bound,
through ``load_model(random_weights=True)`` for TrainStream and QLoRA), trains it with its runner
under its VRAM cap, and reports s/step (the median interval between step ends after the warm-up
steps, the device synchronized at each end; the last also waits for the host work it left, so
host work is inside the intervals), peak VRAM (``torch.cuda.max_memory_allocated`` over the whole
case), peak host RSS (``getrusage`` of this process), load and wrap time, time to the first
step's end (from the case's start), every loss, and, for TrainStream, what the planner chose and
the bytes its plan moves over PCIe each step (block_facts, plan_facts, step_traffic). The probe
case measures what the bounds divide by.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..sizes import GiB
from .common import cap_vram
from .models import GPTConfig

LORA_RANK = 16
# Runners that need CUDA: on the CPU (--quick in CI) they are skipped, with why.
NEEDS_CUDA = {
    "torchao": "torchao's CPUOffloadOptimizer offloads the state of CUDA parameters",
    "deepspeed": "DeepSpeed's ZeRO offload runs on an accelerator",
    "interleaved": "the planner suite's interleaved runner trains on CUDA",
}


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # ru_maxrss: KiB on Linux


def first_line(e: BaseException) -> str:
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
        return engine, f"DeepSpeedCPUAdam did not build ({first_line(e)}): torch AdamW on the CPU in its place"


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
    if case.get("memory_plot"):
        import trainstream

        out["memory_report"] = trainstream.memory_report(model)  # plotted by the parent (workloads.py)
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
        kind = TrainStreamTrainer if ours else transformers.Trainer
        extra = {"trainstream": {}} if ours else {}
        trainer = kind(model=model, args=args, train_dataset=data, callbacks=[timer], **extra)
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
        wrap_s=None,  # TrainStreamTrainer wraps inside train(): the first step's time holds it
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
        out = {"oom": True, "error": first_line(e)}
    except MemoryError as e:  # DoesNotFit: wrap() or load_model() refused before anything moved
        out = {"oom": True, "error": first_line(e)}
    except Exception as e:  # noqa: BLE001 - a peer that will not run says why in its row
        out = {"error": first_line(e)}
    if isinstance(out, dict) and "runs" not in out:
        out["host_rss_GiB"] = _peak_rss_gib()
        if cuda and "peak_GiB" not in out:
            out["peak_GiB"] = torch.cuda.max_memory_allocated() / GiB
    return out


if __name__ == "__main__":
    print(json.dumps(run_case(json.loads(sys.argv[1]))), flush=True)
