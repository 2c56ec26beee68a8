"""Suite `lora`: LoRA fine-tuning steps over a frozen base, stored as bf16, int8 or NF4.

A Llama-shaped model of about 3B parameters (bf16, random weights from one seed), LoRA
r=16 from peft on every Linear of the blocks, torch AdamW over the adapters, batch 4x512:
- stock: the bf16 base on the GPU, fused AdamW;
- bitsandbytes QLoRA: the block Linears as bitsandbytes' Linear4bit (NF4, block 64, fp32
  absmax, as TrainStream stores them: no double quantization), fused AdamW;
- TrainStream with the base as NF4 and as int8, weights resident, and NF4 under a VRAM cap
  with wrap()'s defaults otherwise (the planner pages what it must).

Every case runs in its own process and builds the same weights on the host (one seed),
then moves them as the runner does. A case times K steps after warm-up, host work included,
and reports the peak of ``torch.cuda.max_memory_allocated`` and the first step's loss: NF4
is bitsandbytes' format, so TrainStream's NF4 loss matches QLoRA's up to codes on a decision
threshold (bitsandbytes quantizes on the GPU with an approximate reciprocal, TrainStream on
the host) and the order of the adapter's arithmetic.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ..sizes import GiB
from .common import alternating_windows, cap_vram, case_in_subprocess, markdown_table, timed_window, warm_up
from .models import PUBLISHED

BATCH, SEQ = 4, 512
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CAP_GIB = 8
INTERLEAVED = ("stock", "bitsandbytes", "NF4", "int8")  # the runs of the same-process case
CASE_TIMEOUT_S = 240  # a case builds its model (7B: about 15 GB of bf16 on the host) and trains about 12 steps


# The models: "quick" (a smoke run), "3b" (the suite's Llama: weights resident and under a
# cap) and "qwen2.5-7b" (the published Qwen2.5-7B sizes, random weights: the row where neither
# stock nor bitsandbytes fits under the cap).
SIZES = ("quick", "3b", "qwen2.5-7b")


def _config(size: str):
    import transformers

    if size == "quick":
        return transformers.LlamaConfig(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=32000,
        )
    if size == "3b":
        return transformers.LlamaConfig(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            vocab_size=32000,
        )
    if size == "qwen2.5-7b":
        _, shape = PUBLISHED[size]
        return transformers.Qwen2Config(**shape)
    raise ValueError(f"lora suite: size must be one of {SIZES}, got {size!r}")


def _fill(model) -> None:
    """Weights from one seeded pool of normal values (std 0.02, as Llama's init), RMSNorm
    weights 1: the same in every process, and seconds instead of minutes for 3B values."""
    pool = (torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
                continue
            flat, start, i = p.view(-1), (k * 7919) % pool.numel(), 0
            while i < flat.numel():
                n = min(flat.numel() - i, pool.numel() - start)
                flat[i : i + n].copy_(pool[start : start + n])
                i, start = i + n, 0


def _base(size: str):
    """The bf16 base model in host memory: built on the meta device, then given storage and
    filled (_fill); the rotary embedding's frequencies are computed again for real."""
    import transformers

    config = _config(size)
    cls = (
        transformers.Qwen2ForCausalLM if isinstance(config, transformers.Qwen2Config) else transformers.LlamaForCausalLM
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device="cpu")
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    finally:
        torch.set_default_dtype(default)
    _fill(model)
    model.config.use_cache = False
    return model


def _to_bnb_nf4(model) -> None:
    """Every Linear of the blocks as bitsandbytes' Linear4bit, quantized when moved to the GPU."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in LINEARS:
                linear = getattr(parent, name, None)
                if linear is None:
                    continue
                q = bnb.nn.Linear4bit(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=False,
                    quant_type="nf4",
                )
                q.weight = bnb.nn.Params4bit(
                    linear.weight.data, requires_grad=False, compress_statistics=False, quant_type="nf4", blocksize=64
                )
                if linear.bias is not None:  # Qwen2's q, k and v projections
                    q.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
                setattr(parent, name, q)


def _lora(model):
    import peft

    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LINEARS), bias="none")
    return peft.get_peft_model(model, config)


def _busy_s_per_step(step, steps: int) -> float:
    """GPU time a step keeps the GPU busy: the union of every CUDA kernel's and copy's
    interval (torch.profiler, CUPTI's timestamps) over `steps` profiled steps, per step. Divided
    by the unprofiled s/step it is the share of the step the GPU was busy: the profiler slows
    the host side, not the GPU's own intervals."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return _union_us(spans) / 1e6 / steps


def _union_us(spans: list) -> float:
    """Total length of the union of sorted (start, end) intervals."""
    total, cur = 0.0, None
    for start, end in spans:
        if cur is None or start > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [start, end]
        else:
            cur[1] = max(cur[1], end)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


def _pcie_bytes_per_step(model, paged_activation_bytes: int) -> int:
    """Bytes a TrainStream step moves over PCIe: each paged unit's stored weights in (forward)
    and in again (backward), and each paged activation out and back in. The adapters'
    gradients and new weights are left out (a few MB a step here)."""
    from ..api import _engine_of

    engine = _engine_of(model)
    weights = sum(u.nbytes for u in (*engine.block_units, *engine.outside_units) if u.paged)
    return 2 * weights + 2 * paged_activation_bytes


def _runner(case: dict):
    """The case's model, optimizer and training step, built as its runner builds them:
    (step, opt, trainable, model, build_s, wrap_s)."""
    t0 = time.perf_counter()
    model = _base(case["size"])
    vocab = model.config.vocab_size
    if case["runner"] == "bnb":
        _to_bnb_nf4(model)
    model = _lora(model)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    trainable = [p for p in model.parameters() if p.requires_grad]
    build_s = time.perf_counter() - t0
    t_wrap = time.perf_counter()
    if case["runner"] == "trainstream":
        import trainstream

        model, opt = trainstream.wrap(model, torch.optim.AdamW(trainable, lr=1e-4), device="cuda", **case["wrap"])
    else:
        model = model.cuda()
        opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    wrap_s = time.perf_counter() - t_wrap
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g).cuda()

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if case.get("compute_only"):  # the compute bound: forward and backward, no update
            for p in trainable:
                p.grad = None
        else:
            opt.step()
            opt.zero_grad()
        return loss

    return step, opt, trainable, model, build_s, wrap_s


def run_interleaved(case: dict) -> dict:
    """The weights-resident runners of case["runs"] in this one process, their timed windows
    alternating (common.alternating_windows): the medians' ratios are read against one
    machine state, where runs in separate processes moved by 20% between two calls."""
    steppers = {}
    for name, run in case["runs"].items():
        step, opt, *_ = _runner(dict(run, size=case["size"]))
        warm_up(step, opt, case["warmup"])
        steppers[name] = (step, opt)
    medians = alternating_windows(steppers, rounds=case["rounds"], steps=case["steps"])
    return {"s_per_step_by_run": medians, "windows": case["rounds"], "steps_per_window": case["steps"]}


# How much of a TrainStream run's events its row keeps.
EVENTS_KEPT, EVENT_CHARS = 30, 2000


def run_case(case: dict) -> dict:
    cap_vram(case.get("cap_gib"))
    if case.get("interleaved"):
        return run_interleaved(case)
    try:
        step, opt, trainable, model, build_s, wrap_s = _runner(case)
        t_first = time.perf_counter()
        first = step()
        torch.cuda.synchronize()
        first_step_s = time.perf_counter() - t_first
        first = first.item()
        warm_up(step, opt, case["warmup"])
        acts_before = _paged_activation_bytes(model, case)
        s_per_step, _ = timed_window(step, opt, case["steps"])
        out = {
            "s_per_step": s_per_step,
            "peak_GiB": torch.cuda.max_memory_allocated() / GiB,
            "first_loss": first,
            "setup_s": build_s + wrap_s,
            "wrap_s": wrap_s,
            "first_step_s": first_step_s,
            "oom": False,
            "trainable": sum(p.numel() for p in trainable),
        }
        if case["runner"] == "trainstream":
            import trainstream

            report = trainstream.memory_report(model)
            out["quantize"] = report["params"]["quantize"]
            out["paged_blocks"] = len(report["params"]["paged_blocks"])
            out["activation_paged_blocks"] = len(report["params"]["activation_paged_blocks"])
            out["recompute_blocks"] = len(report["params"]["recompute_blocks"])
            out["blocks"] = len(report["params"]["paged_blocks"]) + len(report["params"]["resident_blocks"])
            acts = (_paged_activation_bytes(model, case) - acts_before) // case["steps"]
            out["pcie_bytes_per_step"] = _pcie_bytes_per_step(model, acts)
            # The plan's reasons and predictions, for reading a step against its bounds later
            # (JSON only: the last entries, each cut to a readable length).
            out["events"] = [line[:EVENT_CHARS] for line in report["events"].splitlines()[-EVENTS_KEPT:]]
        if case.get("busy"):
            out["gpu_busy_s_per_step"] = _busy_s_per_step(step, 3)
            out["gpu_busy"] = min(out["gpu_busy_s_per_step"] / s_per_step, 1.0)
        return out
    except torch.OutOfMemoryError as e:
        return {"oom": True, "error": str(e).split("\n")[0][:200]}


def _paged_activation_bytes(model, case: dict) -> int:
    if case["runner"] != "trainstream":
        return 0
    import trainstream

    return trainstream.memory_report(model)["paged_activation_bytes"]


def cases(quick: bool) -> list:
    """The suite's cases, in the order they run: the 3B rows, then the 7B rows under the cap."""
    size = "quick" if quick else "3b"
    steps = dict(warmup=2, steps=3 if quick else 8, size=size)
    resident = dict(offload=True, param_offload=False, activation_offload=False)
    out = [
        dict(runner="stock", label="stock: bf16 base, fused AdamW", busy=True, **steps),
        dict(runner="bnb", label="bitsandbytes QLoRA: NF4 base (Linear4bit), fused AdamW", **steps),
        dict(
            runner="trainstream",
            label="TrainStream, NF4 base, weights resident",
            wrap=dict(resident, quantize="nf4"),
            busy=True,
            **steps,
        ),
        dict(
            runner="trainstream",
            label="TrainStream, int8 base, weights resident",
            wrap=dict(resident, quantize="int8"),
            **steps,
        ),
        dict(
            runner="trainstream",
            label=f"TrainStream, NF4 base, defaults under a {CAP_GIB} GiB cap",
            wrap=dict(quantize="nf4", offload=True),
            cap_gib=CAP_GIB,
            **steps,
        ),
        # The resident runs' step times for the checks: one process, windows alternating.
        dict(
            runner="interleaved",
            interleaved=True,
            label="weights resident, one process, windows alternating: " + ", ".join(INTERLEAVED),
            size=size,
            warmup=2,
            rounds=3 if quick else 7,
            steps=2 if quick else 3,
            runs={
                "stock": dict(runner="stock"),
                "bitsandbytes": dict(runner="bnb"),
                "NF4": dict(runner="trainstream", wrap=dict(resident, quantize="nf4")),
                "int8": dict(runner="trainstream", wrap=dict(resident, quantize="int8")),
            },
        ),
    ]
    if quick:
        return out
    big = dict(warmup=2, steps=4, size="qwen2.5-7b", big=True)
    return out + [
        dict(
            runner="stock", label="7B: forward + backward only, uncapped (the compute bound)", compute_only=True, **big
        ),
        # The same with every block's forward run again in backward: the compute of a block the
        # planner recomputes, for the bound of the capped row.
        dict(
            runner="stock",
            label="7B: forward + backward only, every block recomputed (gradient checkpointing), uncapped",
            compute_only=True,
            checkpointing=True,
            **big,
        ),
        dict(runner="stock", label=f"7B: stock under a {CAP_GIB} GiB cap", cap_gib=CAP_GIB, **big),
        dict(
            runner="bnb",
            label=f"7B: bitsandbytes QLoRA, gradient checkpointing, under a {CAP_GIB} GiB cap",
            checkpointing=True,
            cap_gib=CAP_GIB,
            **big,
        ),
        dict(
            runner="trainstream",
            label=f"7B: TrainStream, NF4 base, defaults under a {CAP_GIB} GiB cap",
            wrap=dict(quantize="nf4", offload=True),
            cap_gib=CAP_GIB,
            **big,
        ),
    ]


def run(*, quick: bool = False) -> dict:
    from .optimizer_gpu import pcie_GBps

    bw = pcie_GBps(1 << 30)
    rows = []
    for case in cases(quick):
        # A case that runs long says so in its row, and the suite still writes the others'.
        result, error = case_in_subprocess("trainstream.bench.lora", case, timeout=CASE_TIMEOUT_S)
        row = {"run": case["label"], "cap_GiB": case.get("cap_gib"), "model": case["size"], "runner": case["runner"]}
        row["compute_only"] = bool(case.get("compute_only"))
        row.update(result if error is None else {"error": error[-300:]})
        rows.append(row)
        print(json.dumps(row), flush=True)
    for model in {r["model"] for r in rows}:
        mine = [r for r in rows if r["model"] == model]
        stock = next((r for r in mine if r["runner"] == "stock" and "s_per_step" in r and not r["compute_only"]), None)
        bnb = next((r for r in mine if r["runner"] == "bnb" and "first_loss" in r), None)
        for r in mine:
            if stock is not None and "s_per_step" in r:
                r["vs_stock"] = r["s_per_step"] / stock["s_per_step"]
            if bnb is not None and "first_loss" in r:
                r["loss_vs_qlora"] = abs(r["first_loss"] - bnb["first_loss"])
            if "pcie_bytes_per_step" in r:
                r["pcie_s"] = r["pcie_bytes_per_step"] / (bw["h2d"] * 1e9)
    checks = _checks(rows)
    return {"pcie_GBps": bw, "rows": rows, "checks": checks, "markdown": markdown(rows, checks, quick)}


def _checks(rows: list) -> list:
    """Issue 23's targets, read from the rows (a row that did not run gives no check)."""

    def find(model, runner, label_part=""):
        return next((r for r in rows if r["model"] == model and r["runner"] == runner and label_part in r["run"]), None)

    model = next((r["model"] for r in rows if r["model"] != "qwen2.5-7b"), "3b")
    stock, bnb = find(model, "stock"), find(model, "bnb")
    nf4, int8 = find(model, "trainstream", "NF4 base, weights resident"), find(model, "trainstream", "int8")
    out = []

    def check(name, value, target):
        out.append(dict(model=model, check=name, value=value, target=target))

    inter = find(model, "interleaved")
    times = inter.get("s_per_step_by_run", {}) if inter else {}
    if times:  # the step-time ratios from one process (see run_interleaved)
        where = " (one process, windows alternating)"
        s_stock, s_bnb, s_nf4, s_int8 = (times.get(k) for k in INTERLEAVED)
    else:
        where = ""
        s_stock, s_bnb, s_nf4, s_int8 = (r.get("s_per_step") if r else None for r in (stock, bnb, nf4, int8))
    if s_nf4:
        if s_stock:
            check("NF4 resident: step / stock bf16 LoRA" + where, s_nf4 / s_stock, "<= 1.1")
        if s_bnb:
            check("NF4 resident: bitsandbytes QLoRA step / ours" + where, s_bnb / s_nf4, ">= 1.2")
        if s_int8:
            check("int8 resident: step / NF4 resident" + where, s_int8 / s_nf4, "<= 1.05")
    if nf4 and "s_per_step" in nf4:
        if bnb and "peak_GiB" in bnb:
            check("NF4 resident: peak GiB (bitsandbytes' peak)", nf4["peak_GiB"], f"<= {bnb['peak_GiB']:.3g}")
        if "gpu_busy" in nf4:
            check("NF4 resident: GPU busy share of the step (profiler)", nf4["gpu_busy"], ">= 0.9")
    big = "qwen2.5-7b"
    compute, ours = find(big, "stock", "compute bound"), find(big, "trainstream")
    recomputed = find(big, "stock", "every block recomputed")
    if ours and "s_per_step" in ours:
        if compute and "s_per_step" in compute:
            bound_compute, what = _compute_bound(compute, recomputed, ours)
            bound = max(bound_compute, ours["pcie_s"])
            out.append(
                dict(
                    model=big,
                    check=f"under the cap: step / max(compute {bound_compute:.3f} s{what}, PCIe {ours['pcie_s']:.3f} s)",
                    value=ours["s_per_step"] / bound,
                    target="<= 1.2",
                )
            )
        out.append(
            dict(
                model=big,
                check="time to first step (wrap() + the first step), s",
                value=ours["wrap_s"] + ours["first_step_s"],
                target="<= 5",
            )
        )
    return out


def _compute_bound(compute: dict, recomputed: dict | None, ours: dict) -> tuple[float, str]:
    """The compute of the capped row, its recompute included: the forward and backward, plus
    for each block the planner recomputes, a block's share of what recomputing every block
    added (the blocks are alike). Returns (seconds, what the label says about the recompute)."""
    n, blocks = ours.get("recompute_blocks", 0), ours.get("blocks", 0)
    if not n:
        return compute["s_per_step"], ""
    if recomputed is None or "s_per_step" not in recomputed or not blocks:
        return compute["s_per_step"], f", {n} blocks' recompute not measured"
    extra = max(recomputed["s_per_step"] - compute["s_per_step"], 0.0) * n / blocks  # never below the plain compute
    return compute["s_per_step"] + extra, f" with {n} of {blocks} blocks recomputed"


_TITLES = {
    "quick": "Llama-shaped model, quick sizes",
    "3b": "Llama-shaped model, about 3B parameters",
    "qwen2.5-7b": "Qwen2.5-7B shapes",
}


def markdown(rows: list, checks: list, quick: bool) -> str:
    table = markdown_table(
        [
            ("run", "run"),
            ("cap_GiB", "VRAM cap GiB"),
            ("s_per_step", "s/step"),
            ("vs_stock", "x stock"),
            ("peak_GiB", "peak GiB"),
            ("loss_vs_qlora", "first loss minus QLoRA's (abs)"),
            ("paged_blocks", "blocks paged"),
            ("activation_paged_blocks", "activations paged"),
            ("recompute_blocks", "blocks recomputed"),
            ("pcie_s", "PCIe s/step"),
            ("gpu_busy", "GPU busy"),
            ("wrap_s", "wrap s"),
            ("first_step_s", "first step s"),
            ("oom", "out of memory"),
            ("error", "error"),
        ],
        rows,
    )
    check_table = markdown_table(
        [("model", "model"), ("check", "check"), ("value", "measured"), ("target", "target")], checks
    )
    same_process = [
        {"run": name, "s_per_step": t, "vs_stock": t / r["s_per_step_by_run"]["stock"]}
        for r in rows
        if r.get("s_per_step_by_run", {}).get("stock")
        for name, t in r["s_per_step_by_run"].items()
    ]
    if same_process:
        table += (
            "\n\nThe weights-resident runs again in one process, their timed windows alternating (the median of "
            "each; the checks' step-time ratios read these):\n\n"
            + markdown_table([("run", "run"), ("s_per_step", "s/step"), ("vs_stock", "x stock")], same_process)
        )
    trainable = {r["model"]: r["trainable"] for r in rows if "trainable" in r}
    models = "; ".join(f"{_TITLES[m]}: {n / 1e6:.1f}M trainable" for m, n in trainable.items())
    return (
        f"bf16 base; LoRA r=16 on every Linear of the blocks; batch {BATCH}x{SEQ} ({models}). x stock: against "
        "the stock row of the same model. GPU busy: the union of the GPU's kernel and copy intervals over 3 "
        "profiled steps, per step, over the unprofiled s/step. PCIe s/step: the paged weights in twice and the "
        "paged activations out and in once a step, at the pinned host->device rate measured in this run.\n\n"
        + table
        + "\n\n"
        + check_table
    )


if __name__ == "__main__":
    print(json.dumps(run_case(json.loads(sys.argv[1]))), flush=True)
