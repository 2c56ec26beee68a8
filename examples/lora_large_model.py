"""LoRA (peft) on a large causal LM's frozen base, with TrainStream streaming what does not fit.

The base is a Qwen2.5- (or Llama-3-70B-) shaped model from
``trainstream.integrations.huggingface.load_model(..., random_weights=True)``: the published
config sizes (written below), weights initialized by transformers, no download. --model takes a
hub id or a local folder instead, read from its .safetensors one tensor at a time. --quantize
goes to load_model (which quantizes each block weight as it reads it, so an NF4 base never
exists in bf16) and to wrap(); "auto" quantizes only what would not fit otherwise, and
--prefer speed lets it pick NF4 when that keeps every block in VRAM. LoRA adapters go on every
projection of the blocks; the optimizer is torch.optim.AdamW over the adapters, converted by
wrap_hf(). --stock trains the same LoRA with plain torch (the bf16 base moved to the GPU, torch's
AdamW, no TrainStream) for comparison. Per step: the loss, s/step, peak VRAM (on a GPU) and host
RSS; at the end, what the planner chose. The batch is one batch of random tokens repeated.

Run:
    python examples/lora_large_model.py --size 14b --quantize nf4 --vram-gb 24
    python examples/lora_large_model.py --size 7b --quantize none --stock     # the stock peer
    python examples/lora_large_model.py --model Qwen/Qwen2.5-1.5B --quantize none
    python examples/lora_large_model.py --smoke     # tiny, on the CPU, in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import memory_stats as ms
import torch

from trainstream.bench.models import PUBLISHED, hub_config

_QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rope_theta=1000000.0)
# The published config.json sizes on the hub (Qwen/Qwen2.5-*, meta-llama/Meta-Llama-3-70B), shared
# with the hf bench: "1.5b", "7b", "14b", "32b", "70b".
CONFIGS = {name.split("-")[-1]: hub_config(name) for name in PUBLISHED}
# --smoke: a Qwen2 of the same layout at toy size.
SMOKE_CONFIG = dict(
    _QWEN2,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# Every projection of a Qwen2 / Llama decoder layer.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The accepted values of load_model(quantize=) and wrap(quantize=) (SPEC.md) that this offers.
QUANTIZE = ("auto", "none", "int8", "nf4")
PREFER = ("exact", "speed")  # wrap(prefer=)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(CONFIGS, key=lambda s: float(s[:-1])), default="7b")
    p.add_argument("--model", default=None, help="a hub id or a local folder (instead of --size)")
    p.add_argument(
        "--random-weights", action="store_true", help="with --model: read only its config.json, initialize randomly"
    )
    p.add_argument("--quantize", choices=QUANTIZE, default="auto", help="the base's frozen block weights")
    p.add_argument("--prefer", choices=PREFER, default="exact", help="wrap(prefer=...): 'speed' lets 'auto' pick NF4")
    p.add_argument("--stock", action="store_true", help="plain torch AdamW, no TrainStream (needs --quantize none)")
    p.add_argument("--steps", type=ms.positive_int, default=10)
    p.add_argument("--batch", type=ms.positive_int, default=1)
    p.add_argument("--seq", type=ms.positive_int, default=512)
    p.add_argument("--rank", type=ms.positive_int, default=16, help="LoRA rank (lora_alpha is twice it)")
    p.add_argument("--lr", type=ms.positive_float, default=1e-4)
    p.add_argument("--vram-gb", type=ms.positive_float, default=None, help="VRAM cap in GiB (default: the whole GPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--verbose", action="store_true", help="wrap(verbose=True): print every decision as it is made")
    p.add_argument(
        "--smoke", action="store_true", help="a tiny Qwen2, on the CPU unless --device says otherwise (what CI runs)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        if args.model is not None:
            p.error("--smoke builds its own tiny model: leave out --model")
        args.batch, args.seq, args.steps, args.rank, args.lr = 2, 32, 4, 4, 1e-2
    if args.random_weights and args.model is None:
        p.error("--random-weights goes with --model (--size always uses random weights)")
    if args.stock and args.quantize != "none":
        # A quantized base outside TrainStream is bitsandbytes QLoRA, a different peer.
        p.error("--stock trains the bf16 base with plain torch: it needs --quantize none")
    args.device = ms.pick_device(p, args.device, args.smoke)
    if args.vram_gb is not None and args.device.type != "cuda":
        p.error("--vram-gb caps a GPU's memory: it needs --device cuda")
    return args


def load_base(args):
    """The frozen base, from --model or from the config of --size (random weights)."""
    from trainstream.integrations.huggingface import load_model

    if args.model is not None:
        return load_model(args.model, quantize=args.quantize, random_weights=args.random_weights)
    config = SMOKE_CONFIG if args.smoke else CONFIGS[args.size]
    with tempfile.TemporaryDirectory() as folder:  # load_model reads config.json from a folder
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        return load_model(folder, quantize=args.quantize, random_weights=True)


def add_lora(base, rank: int):
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS, bias="none")
    return peft.get_peft_model(base, config)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    ms.cap_vram(args.device, args.vram_gb)
    start = time.perf_counter()
    base = load_base(args)
    vocab = base.config.vocab_size
    base_params = sum(p.numel() for p in base.parameters())
    model = add_lora(base, args.rank)
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(
        f"{type(base).__name__}: {ms.count(base_params)} base parameters, LoRA r={args.rank}: "
        f"{ms.count(sum(p.numel() for p in trainable))} trainable; loaded in {time.perf_counter() - start:.1f} s, "
        f"host peak RSS {ms.host_peak_rss_gib():.2f} GiB"
    )

    start = time.perf_counter()
    if args.stock:
        model = model.to(args.device)
        optimizer = torch.optim.AdamW(trainable, lr=args.lr, fused=args.device.type == "cuda")
        print(f"stock: base and adapters on {args.device}, torch.optim.AdamW")
    else:
        import trainstream
        from trainstream.integrations.huggingface import wrap_hf

        optimizer = torch.optim.AdamW(trainable, lr=args.lr)
        model, optimizer = wrap_hf(
            model.train(),
            optimizer,
            device=str(args.device),
            quantize=args.quantize,
            prefer=args.prefer,
            verbose=args.verbose,
        )
    model.train()
    print(f"ready to train in {time.perf_counter() - start:.1f} s")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(args.device)
    losses = []
    last = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.device.type == "cuda"):
                loss = model(input_ids=ids, labels=ids).loss  # the model shifts the labels
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            ms.settle(args.device)
            now = time.perf_counter()
            peak = ms.device_peak_gib(args.device)
            print(
                f"step {step}: loss {losses[-1]:.4f}, {now - last:.3f} s/step"
                + (f", peak VRAM {peak:.2f} GiB" if peak is not None else "")
                + f", host peak RSS {ms.host_peak_rss_gib():.2f} GiB"
            )
            last = now
    except torch.cuda.OutOfMemoryError:
        print(f"out of memory at step {len(losses) + 1} ({'stock PyTorch' if args.stock else 'TrainStream'})")
        return 1

    if not args.stock:
        optimizer.synchronize()  # the last updates run on host threads
        ms.print_plan(trainstream.memory_report(model))
    print(f"final loss: {losses[-1]:.6f} (first {losses[0]:.6f})")
    return 0 if all(math.isfinite(v) for v in losses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
