"""The events log (every decision, in plain text) and memory_report()'s dictionary."""
from __future__ import annotations

import dataclasses
import time

import torch


class EventLog:
    def __init__(self, verbose: bool):
        self.verbose = verbose
        self._start = time.monotonic()
        self.lines: list[str] = []

    def add(self, message: str) -> None:
        line = f"[{time.monotonic() - self._start:8.3f}s] {message}"
        self.lines.append(line)
        if self.verbose:
            print(f"trainstream: {message}", flush=True)

    def text(self) -> str:
        return "\n".join(self.lines)


def build_report(engine) -> dict:
    blocks = engine.block_units
    peaks = {"steps": engine.steps, "max_allocated_bytes": None}
    if engine.backend.is_cuda:
        peaks["max_allocated_bytes"] = torch.cuda.max_memory_allocated(engine.backend.device)
    return {
        "mode": engine.mode,
        "events": engine.events.text(),
        "params": {
            "paged_blocks": [u.block for u in blocks if u.paged],
            "resident_blocks": [u.block for u in blocks if not u.paged],
            "activation_paged_blocks": [u.block for u in blocks if u.act_paged],
            "quantize": "none",
        },
        "plan": {
            "device": str(engine.backend.device),
            "blocks": engine.stack.describe(),
            "moment_dtype": str(engine.optimizer.moment_dtype).replace("torch.", ""),
            # Where the updates run: "cpu" (host AdamW) or "gpu" (zero-copy kernel), as decided.
            "optimizer_mode": "gpu" if engine.update_on_device else "cpu",
            "max_inflight_bytes": engine.max_inflight_bytes,
            "budget": engine.budget,
            "profile": dataclasses.asdict(engine.profile),
            "history": list(engine.history),
            # Saved activations per block (bytes, largest of the first passes), measured.
            "activation_bytes_per_block": dict(engine.activation_bytes),
        },
        "peaks": peaks,
        "paged_activation_bytes": engine.acts.paged_bytes,
        "last_grad_norm": engine.last_grad_norm,
    }
