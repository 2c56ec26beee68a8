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
from .common import cap_vram, case_in_subprocess, markdown_table, timed_window, warm_up

BATCH, SEQ = 4, 512
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CAP_GIB = 8


def _config(quick: bool):
    import transformers

    if quick:
        return transformers.LlamaConfig(
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=32000,
        )
    return transformers.LlamaConfig(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=32000,
    )


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


def _base(quick: bool):
    """The bf16 base model in host memory: built on the meta device, then given storage and
    filled (_fill); the rotary embedding's frequencies are computed again for real."""
    import transformers

    config = _config(quick)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
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
                setattr(parent, name, q)


def _lora(model):
    import peft

    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LINEARS), bias="none")
    return peft.get_peft_model(model, config)


def run_case(case: dict) -> dict:
    cap_vram(case.get("cap_gib"))
    t0 = time.perf_counter()
    try:
        model = _base(case["quick"])
        if case["runner"] == "bnb":
            _to_bnb_nf4(model)
        model = _lora(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if case["runner"] == "trainstream":
            import trainstream

            model, opt = trainstream.wrap(model, torch.optim.AdamW(trainable, lr=1e-4), device="cuda", **case["wrap"])
        else:
            model = model.cuda()
            opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
        setup_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 32000, (BATCH, SEQ), generator=g).cuda()

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        first = warm_up(step, opt, case["warmup"]).item()
        s_per_step, _ = timed_window(step, opt, case["steps"])
        out = {
            "s_per_step": s_per_step,
            "peak_GiB": torch.cuda.max_memory_allocated() / GiB,
            "first_loss": first,
            "setup_s": setup_s,
            "oom": False,
            "trainable": sum(p.numel() for p in trainable),
        }
        if case["runner"] == "trainstream":
            import trainstream

            report = trainstream.memory_report(model)
            out["quantize"] = report["params"]["quantize"]
            out["paged_blocks"] = len(report["params"]["paged_blocks"])
            out["activation_paged_blocks"] = len(report["params"]["activation_paged_blocks"])
        return out
    except torch.OutOfMemoryError as e:
        return {"oom": True, "error": str(e).split("\n")[0][:200]}


def run(*, quick: bool = False) -> dict:
    steps = dict(warmup=2, steps=3 if quick else 8, quick=quick)
    resident = dict(offload=True, param_offload=False, activation_offload=False)
    cases = [
        dict(runner="stock", label="stock: bf16 base, fused AdamW", **steps),
        dict(runner="bnb", label="bitsandbytes QLoRA: NF4 base (Linear4bit), fused AdamW", **steps),
        dict(
            runner="trainstream",
            label="TrainStream, NF4 base, weights resident",
            wrap=dict(resident, quantize="nf4"),
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
    ]
    rows = []
    for case in cases:
        result, error = case_in_subprocess("trainstream.bench.lora", case)
        row = {"run": case["label"], "cap_GiB": case.get("cap_gib")}
        row.update(result if error is None else {"error": error[-300:]})
        rows.append(row)
        print(json.dumps(row), flush=True)
    stock, bnb = rows[0], rows[1]
    for r in rows:
        if "s_per_step" in r and "s_per_step" in stock:
            r["vs_stock"] = r["s_per_step"] / stock["s_per_step"]
        if "first_loss" in r and "first_loss" in bnb:
            r["loss_vs_qlora"] = abs(r["first_loss"] - bnb["first_loss"])
    return {"rows": rows, "markdown": markdown(rows, quick)}


def markdown(rows: list, quick: bool) -> str:
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
            ("setup_s", "setup s"),
            ("oom", "out of memory"),
            ("error", "error"),
        ],
        rows,
    )
    trainable = next((r["trainable"] for r in rows if "trainable" in r), 0)
    return (
        f"Llama-shaped model, {'quick sizes' if quick else 'about 3B parameters'}, bf16; LoRA r=16 on every "
        f"Linear of the blocks ({trainable / 1e6:.1f}M trainable); batch {BATCH}x{SEQ}.\n\n" + table
    )


if __name__ == "__main__":
    print(json.dumps(run_case(json.loads(sys.argv[1]))), flush=True)
