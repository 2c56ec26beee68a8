"""Train a GPT whose training state is larger than the GPU's memory with trainstream.wrap().

The model (trainstream.bench.models.GPT: the benchmarks' pre-norm GPT, fp32 weights) is built
on the CPU and handed to wrap(), which keeps what fits in VRAM and streams the rest: the AdamW
moments and the gradients always live in host RAM, and the planner decides which blocks'
weights and saved activations are paged there too. --vram-gb caps this process's VRAM
(torch.cuda.set_per_process_memory_fraction) to stand for a smaller card. The script prints
what stock PyTorch would need, what the planner chose, and per step the loss, s/step, peak
VRAM and host RSS. The batch is one batch of random tokens repeated, so the loss falls as the
model memorises it.

Run:
    python examples/train_bigger_than_vram.py --layers 36 --d-model 2048 --vram-gb 8 --moments bf16
    python examples/train_bigger_than_vram.py --smoke     # tiny, on the CPU, in seconds
"""

from __future__ import annotations

import argparse
import math
import time

import memory_stats as ms
import torch

import trainstream
from trainstream.bench.models import GPT, GPTConfig

# The wrap() spellings of moment_dtype (SPEC.md): "auto" lets the planner pick bf16 only when
# host RAM cannot hold fp32 moments.
MOMENTS = ("auto", "fp32", "bf16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=ms.positive_int, default=36, help="transformer blocks (default 36)")
    p.add_argument("--d-model", type=ms.positive_int, default=2048, help="model width (default 2048)")
    p.add_argument("--heads", type=ms.positive_int, default=16, help="attention heads; must divide --d-model")
    p.add_argument("--vocab", type=ms.positive_int, default=32000)
    p.add_argument("--batch", type=ms.positive_int, default=8)
    p.add_argument("--seq", type=ms.positive_int, default=512)
    p.add_argument("--steps", type=ms.positive_int, default=10)
    p.add_argument("--lr", type=ms.positive_float, default=1e-4)
    p.add_argument("--vram-gb", type=ms.positive_float, default=None, help="VRAM cap in GiB (default: the whole GPU)")
    p.add_argument("--moments", choices=MOMENTS, default="auto", help="wrap(moment_dtype=...): AdamW moments' dtype")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--verbose", action="store_true", help="wrap(verbose=True): print every decision as it is made")
    p.add_argument(
        "--smoke", action="store_true", help="a tiny model, on the CPU unless --device says otherwise (what CI runs)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.heads, args.vocab = 2, 64, 4, 256
        args.batch, args.seq, args.steps, args.lr = 2, 32, 4, 1e-3
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    args.device = ms.pick_device(p, args.device, args.smoke)
    if args.vram_gb is not None and args.device.type != "cuda":
        p.error("--vram-gb caps a GPU's memory: it needs --device cuda")
    return args


def stock_training_bytes(model: torch.nn.Module) -> dict:
    """What torch.optim.AdamW training keeps on the GPU besides activations: the weights,
    a gradient of each, and AdamW's two moments, in the parameters' own dtype."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weights": weights, "gradients": weights, "AdamW moments": 2 * weights}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    ms.cap_vram(args.device, args.vram_gb)
    model = GPT(GPTConfig(dim=args.d_model, layers=args.layers, heads=args.heads, vocab=args.vocab))
    n = sum(p.numel() for p in model.parameters())
    stock = stock_training_bytes(model)
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {ms.count(n)} parameters (fp32)")
    print(
        "stock PyTorch training state: "
        + ", ".join(f"{k} {ms.size(v)}" for k, v in stock.items())
        + f" = {ms.size(sum(stock.values()))} before activations"
        + (f"; VRAM cap {args.vram_gb:g} GiB" if args.vram_gb else "")
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start = time.perf_counter()
    model, optimizer = trainstream.wrap(
        model, optimizer, device=str(args.device), moment_dtype=args.moments, verbose=args.verbose
    )
    print(f"wrap(): {time.perf_counter() - start:.1f} s")
    ms.print_plan(trainstream.memory_report(model))

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(args.device)
    x, y = ids[:, :-1], ids[:, 1:]
    losses = []
    last = time.perf_counter()
    for step in range(1, args.steps + 1):
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.device.type == "cuda"):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())  # waits for the GPU
        ms.settle(args.device)
        now = time.perf_counter()
        peak = ms.device_peak_gib(args.device)
        print(
            f"step {step}: loss {losses[-1]:.4f}, {now - last:.3f} s/step"
            + (f", peak VRAM {peak:.2f} GiB" if peak is not None else "")
            + f", host peak RSS {ms.host_peak_rss_gib():.2f} GiB"
        )
        last = now
    optimizer.synchronize()  # the last updates run on host threads

    print("after training:")
    ms.print_plan(trainstream.memory_report(model))  # the first steps' measurements may move blocks
    print(f"final loss: {losses[-1]:.6f} (first {losses[0]:.6f})")
    return 0 if all(math.isfinite(v) for v in losses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
