"""What the example scripts measure and print about memory: host RSS, peak VRAM, a VRAM cap
that stands for a smaller card, and a readable summary of trainstream.memory_report().

Imported by the scripts beside it (``python examples/<script>.py`` puts this folder on
sys.path); it is not part of the trainstream package."""

from __future__ import annotations

import argparse
import resource
import sys

import torch

GiB = 1 << 30


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: "386.0 KiB", "2.50 GiB"."""
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def count(n: int) -> str:
    """A parameter count: "1.54B", "13.6M", "8.2K"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
    return str(n)


def host_peak_rss_gib() -> float:
    """The process's peak resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GiB if sys.platform == "darwin" else peak * 1024 / GiB


def device_peak_gib(device: torch.device) -> float | None:
    """torch.cuda.max_memory_allocated on `device` in GiB; None on the CPU (no VRAM)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / GiB


def settle(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a wall-clock interval includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cap_vram(device: torch.device, cap_gib: float | None) -> None:
    """Simulate a card of `cap_gib` GiB: allocations past it raise torch.cuda.OutOfMemoryError,
    and the planner reads the cap as the usable VRAM (None: no cap)."""
    if cap_gib is None:
        return
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"cap_vram: device must be a CUDA device with an index, got {device}")
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_gib * GiB > total:
        raise SystemExit(f"--vram-gb {cap_gib} is more than this GPU's {total / GiB:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap_gib * GiB / total, device)


def positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def pick_device(parser: argparse.ArgumentParser, requested: str | None, smoke: bool) -> torch.device:
    """What --device says; without it, the CPU under --smoke (what CI runs), otherwise the GPU
    when there is one."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU (use --device cpu or --smoke)")
    return cuda_device() if requested == "cuda" else torch.device(requested)


def cuda_device() -> torch.device:
    """The current CUDA device with its index: torch.cuda.set_per_process_memory_fraction
    refuses a device without one."""
    return torch.device("cuda", torch.cuda.current_device())


def spans(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"; "none" for an empty list."""
    if not indices:
        return "none"
    out, start, prev = [], indices[0], indices[0]
    for i in list(indices[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


def plan_summary(report: dict) -> list[str]:
    """What the engine chose, from trainstream.memory_report(model): where each block's weights
    and activations live, quantization, the moments, and the planned bytes per resource."""
    params, plan = report["params"], report["plan"]
    budget, quant = plan["budget"], plan["quantized"]
    blocks = len(params["paged_blocks"]) + len(params["resident_blocks"])
    lines = [
        f"engine mode: {report['mode']}"
        + (
            " (offload='auto' switched to torch's fused AdamW: stock training fits)"
            if report["mode"] == "stock"
            else ""
        ),
        f"device: {plan['device']}; {plan['blocks']}",
        f"weights streamed from host RAM: {len(params['paged_blocks'])} of {blocks} blocks ({spans(params['paged_blocks'])})",
        f"activations paged to host RAM: {len(params['activation_paged_blocks'])} of {blocks} blocks "
        f"({spans(params['activation_paged_blocks'])})",
        f"frozen weights quantized: {quant['format']}"
        + (
            f" ({quant['tensors']} tensors, {size(quant['bytes_before'])} -> {size(quant['bytes_after'])})"
            if quant["tensors"]
            else ""
        ),
        f"AdamW moments: {plan['moment_dtype']}, updates on the {plan['optimizer_mode']}",
        "planned host RAM: "
        + ", ".join(f"{k} {size(v)}" for k, v in budget["host"].items() if v)
        + f" (of {size(budget['host_available'])} available)",
        "planned device memory: "
        + ", ".join(f"{k} {size(v)}" for k, v in budget["device"].items() if v)
        + f" (of {size(budget['device_usable'])} usable)",
        f"pinned host memory: {size(budget['pinned'])} (limit {size(budget['pinned_limit'])})",
        f"planner moves after wrap(): {len(plan['history'])}",
    ]
    return lines


def print_plan(report: dict) -> None:
    print("plan (trainstream.memory_report):")
    for line in plan_summary(report):
        print(f"  {line}")
