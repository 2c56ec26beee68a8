"""Fine-tune a Hugging Face causal LM with TrainStreamTrainer, the transformers.Trainer whose
optimizer state, gradients and (when needed) weights and activations live in host RAM.

--model is a hub id or a local folder (AutoModelForCausalLM.from_pretrained; fp32 weights by
default, --dtype bfloat16 halves them; on a GPU the Trainer computes under bf16 autocast). --lora trains peft LoRA adapters on every Linear of the
blocks instead of every parameter. --activation-offload pages every block's saved activations
to host RAM (wrap(activation_offload=True)); without it the planner decides. --compare runs the
same model, data and arguments through the stock transformers.Trainer afterwards and prints
the two runs' losses side by side, with the peak VRAM of each. The data are rows of random
token ids from one seed (replace TokenRows with your dataset); with --smoke the model is a tiny
Llama built here (on the CPU unless --device says otherwise), so nothing is downloaded.

Run:
    python examples/hf_finetune.py --model Qwen/Qwen2.5-1.5B --compare
    python examples/hf_finetune.py --model Qwen/Qwen2.5-7B --lora --activation-offload
    python examples/hf_finetune.py --smoke --lora --compare     # tiny, on the CPU, in seconds
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import time

import memory_stats as ms
import torch

# The weights' dtype: what TrainStream trains (trainable parameters are float32 or bfloat16).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SMOKE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)


class TokenRows(torch.utils.data.Dataset):
    """`rows` rows of `seq` random token ids from one seed; the labels are the ids (the model
    shifts them by one)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int = 1):
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a hub id or a local folder (required unless --smoke)")
    p.add_argument("--lora", action="store_true", help="train peft LoRA adapters (r=--rank) instead of every weight")
    p.add_argument("--rank", type=ms.positive_int, default=16)
    p.add_argument(
        "--compare", action="store_true", help="also run the stock transformers.Trainer, losses side by side"
    )
    p.add_argument(
        "--activation-offload", action="store_true", help="page every block's activations (default: the planner)"
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="the weights' dtype (default float32)")
    p.add_argument("--steps", type=ms.positive_int, default=10)
    p.add_argument("--batch", type=ms.positive_int, default=4, help="per_device_train_batch_size")
    p.add_argument("--accumulation", type=ms.positive_int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--seq", type=ms.positive_int, default=512)
    p.add_argument("--lr", type=ms.positive_float, default=2e-5)
    p.add_argument("--vram-gb", type=ms.positive_float, default=None, help="VRAM cap in GiB (default: the whole GPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--verbose", action="store_true", help="trainstream={'verbose': True}: print every decision")
    p.add_argument(
        "--smoke", action="store_true", help="a tiny Llama, on the CPU unless --device says otherwise (what CI runs)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        if args.model is not None:
            p.error("--smoke builds its own tiny model: leave out --model")
        args.steps, args.batch, args.accumulation, args.seq, args.lr, args.rank = 3, 2, 1, 32, 1e-2, 4
    elif args.model is None:
        p.error("--model is required (a hub id or a folder), or --smoke for the tiny built-in model")
    args.device = ms.pick_device(p, args.device, args.smoke)
    if args.vram_gb is not None and args.device.type != "cuda":
        p.error("--vram-gb caps a GPU's memory: it needs --device cuda")
    return args


def build_model(args):
    """The model to train, the same for both runs: weights (and LoRA's initial adapters) from
    one seed."""
    import transformers

    torch.manual_seed(0)
    if args.smoke:
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMOKE_CONFIG))
    else:
        # Loaded in the checkpoint's dtype (or transformers' default), then cast: the dtype
        # argument's name differs between transformers releases.
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
    model = model.to(DTYPES[args.dtype])
    if args.lora:
        import peft

        config = peft.LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules="all-linear", bias="none"
        )
        model = peft.get_peft_model(model, config)
    return model


def training_args(args, output_dir: str):
    import transformers

    return transformers.TrainingArguments(
        output_dir=output_dir,
        use_cpu=args.device.type == "cpu",
        bf16=args.device.type == "cuda",
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def train(args, trainer_class, data, **kwargs) -> dict:
    """One run: the logged losses, s/step over the run, peak VRAM; "oom" when it ran out."""
    import transformers

    if args.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(args.device)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        try:
            trainer = trainer_class(
                model=build_model(args), args=training_args(args, out), train_dataset=data, **kwargs
            )
            # The losses are printed side by side at the end instead of as each step's log dict.
            trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
            trainer.train()
        except torch.cuda.OutOfMemoryError:
            return {"oom": True, "peak_vram_gib": ms.device_peak_gib(args.device)}
        seconds = time.perf_counter() - start
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = {
            "oom": False,
            "losses": losses,
            "s_per_step": seconds / args.steps,
            "peak_vram_gib": ms.device_peak_gib(args.device),
            "trainer": trainer,
        }
    return result


def describe(name: str, run: dict) -> str:
    if run["oom"]:
        return f"{name}: out of memory"
    peak = run["peak_vram_gib"]
    return f"{name}: {run['s_per_step']:.3f} s/step over the whole run (wrap and warm-up included)" + (
        f", peak VRAM {peak:.2f} GiB" if peak is not None else ""
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    import trainstream
    from trainstream.integrations.huggingface import TrainStreamTrainer

    transformers.logging.set_verbosity_error()
    ms.cap_vram(args.device, args.vram_gb)
    if args.smoke:
        vocab = SMOKE_CONFIG["vocab_size"]
    else:
        vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size
    data = TokenRows(rows=args.steps * args.batch * args.accumulation, seq=args.seq, vocab=vocab)

    options = {"verbose": args.verbose}
    if args.activation_offload:
        options["activation_offload"] = True
    ours = train(args, TrainStreamTrainer, data, trainstream=options)
    print(describe("TrainStreamTrainer", ours))
    if ours["oom"]:
        return 1
    ms.print_plan(trainstream.memory_report(ours.pop("trainer").model))
    gc.collect()  # the first run's model and buffers go before the second run starts

    if args.compare:
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
            # Counted in the stock run's peak too: what the first run has not given back.
            print(f"VRAM still allocated before the stock run: {ms.size(torch.cuda.memory_allocated(args.device))}")
        stock = train(args, transformers.Trainer, data)
        print(describe("stock transformers.Trainer", stock))
        if not stock["oom"]:
            print(f"{'step':>4}  {'TrainStreamTrainer':>18}  {'stock Trainer':>13}  {'relative difference':>19}")
            for i, (a, b) in enumerate(zip(ours["losses"], stock["losses"]), start=1):
                print(f"{i:>4}  {a:>18.6f}  {b:>13.6f}  {abs(a - b) / abs(b):>19.2e}")
    else:
        for i, loss in enumerate(ours["losses"], start=1):
            print(f"step {i}: loss {loss:.6f}")
    print(f"host peak RSS {ms.host_peak_rss_gib():.2f} GiB")
    print(f"final loss: {ours['losses'][-1]:.6f} (first {ours['losses'][0]:.6f})")
    finite = all(math.isfinite(v) for v in ours["losses"])
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
