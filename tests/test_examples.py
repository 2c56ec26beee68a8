"""The scripts of examples/, each run as a user runs it: `python examples/<script>.py --smoke` in
a subprocess from the repository root (a tiny model on the CPU; no download), checked for exit
status 0 and for the line of output that says it did its job. The gpu-marked runs use the GPU
(the same tiny models there, and a GPT whose training state exceeds a 2 GiB VRAM cap)."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 120
HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "peft", "safetensors"))
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="needs transformers, peft and safetensors")
FINAL = re.compile(r"^final loss: (\S+) \(first (\S+)\)$", re.M)


def run_example(script: str, *args: str) -> str:
    """The script's stdout; fails the test (with the output's tail) on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"{script} {' '.join(args)}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def final_losses(out: str) -> tuple[float, float]:
    """The last and the first loss of the script's `final loss: X (first Y)` line."""
    found = FINAL.findall(out)
    assert len(found) == 1, out[-3000:]
    return float(found[0][0]), float(found[0][1])


def test_train_bigger_than_vram_smoke_trains_and_prints_the_plan():
    out = run_example("train_bigger_than_vram.py", "--smoke", "--moments", "bf16")
    last, first = final_losses(out)
    assert math.isfinite(last) and last < first  # one batch repeated: the loss falls
    assert "weights streamed from host RAM:" in out and "AdamW moments: bfloat16" in out


def test_verify_ram_offload_smoke_passes_its_host_side_checks():
    out = run_example("verify_ram_offload.py", "--smoke")
    assert re.search(r"^verdict: PASS \(CPU smoke: ", out, re.M), out[-3000:]
    assert "[FAIL]" not in out


@needs_hf
def test_lora_large_model_smoke_trains_the_adapters_over_an_nf4_base():
    out = run_example("lora_large_model.py", "--smoke", "--quantize", "nf4")
    last, first = final_losses(out)
    assert math.isfinite(last) and last < first
    assert "frozen weights quantized: nf4" in out


def side_by_side(out: str) -> list[tuple[float, float]]:
    """hf_finetune.py --compare's table: (TrainStreamTrainer, stock Trainer) loss per step."""
    rows = re.findall(r"^\s*\d+\s+(\S+)\s+(\S+)\s+\S+$", out.split("relative difference", 1)[-1], re.M)
    return [(float(a), float(b)) for a, b in rows]


@needs_hf
def test_hf_finetune_smoke_matches_the_stock_trainer():
    out = run_example("hf_finetune.py", "--smoke", "--lora", "--compare")
    last, _ = final_losses(out)
    assert math.isfinite(last)
    rows = side_by_side(out)
    assert len(rows) == 3, out[-3000:]  # the smoke run's steps
    for ours, stock in rows:  # the host AdamW against torch's, in fp32 on the CPU
        assert abs(ours - stock) <= 1e-4 * abs(stock), rows


# -- on the GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_verify_ram_offload_passes_under_a_cap_smaller_than_the_training_state():
    # 166M fp32 parameters: 2.5 GiB of weights, gradients and moments against a 2 GiB cap.
    out = run_example(
        "verify_ram_offload.py", "--vram-gb", "2", "--layers", "8", "--d-model", "1024", "--heads", "8",
        "--batch", "2", "--seq", "256", "--steps", "3",
    )  # fmt: skip
    assert re.search(r"^verdict: PASS$", out, re.M), out[-3000:]


@pytest.mark.gpu
def test_gpu_train_bigger_than_vram_under_a_cap():
    out = run_example(
        "train_bigger_than_vram.py", "--device", "cuda", "--vram-gb", "2", "--layers", "8", "--d-model", "1024",
        "--heads", "8", "--batch", "2", "--seq", "256", "--steps", "4", "--moments", "bf16",
    )  # fmt: skip
    last, first = final_losses(out)
    assert math.isfinite(last) and last < first


@needs_hf
@pytest.mark.gpu
@pytest.mark.parametrize("options", [("--quantize", "nf4"), ("--quantize", "none", "--stock")], ids=["nf4", "stock"])
def test_gpu_lora_large_model_smoke(options):
    out = run_example("lora_large_model.py", "--smoke", "--device", "cuda", *options)
    last, first = final_losses(out)
    assert math.isfinite(last) and last < first
    assert "peak VRAM" in out


@needs_hf
@pytest.mark.gpu
def test_gpu_hf_finetune_smoke_against_the_stock_trainer():
    out = run_example("hf_finetune.py", "--smoke", "--device", "cuda", "--lora", "--compare")
    rows = side_by_side(out)
    assert len(rows) == 3, out[-3000:]
    for ours, stock in rows:  # bf16 autocast on both sides; the chunked loss rounds apart from the full logits'
        assert abs(ours - stock) <= 1e-2 * abs(stock), rows
