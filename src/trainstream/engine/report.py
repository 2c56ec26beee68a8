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


def quantization(engine) -> dict:
    """The frozen weights stored quantized: format ("none", "int8" or "nf4"), how many, and
    their bytes in the model's dtype and as stored."""
    slots = [s for u in engine.units for s in u.slots if s.quant is not None]
    return {
        "format": slots[0].quant.format if slots else "none",
        "tensors": len(slots),
        "block_size": slots[0].quant.block_size if slots else None,
        "bytes_before": sum(s.full_nbytes for s in slots),
        "bytes_after": sum(s.quant.nbytes for s in slots),
    }


def moment_copies(engine) -> dict | None:
    """optimizer_mode="gpu": how the moments have reached the kernel so far (moments.py)."""
    stager = engine.moments
    if stager is None:
        return None
    regions = set(stager.region_of.values())
    return {
        "regions": len(regions),
        "regions_too_large_to_copy": sum(not r.staged for r in regions),
        "copied": stager.copies,
        "mapped_for_want_of_room": stager.mapped,
    }


def build_report(engine) -> dict:
    engine.report_skipped()  # a skip the device decided is in the events once its update has run: wait for it
    blocks = engine.block_units
    quant = quantization(engine)
    timeline = engine.adapter.peak_timeline
    # per_step: [step, bytes], each the largest measured peak of per_step_span steps (adapt.py's
    # PeakTimeline; the engine's steps only: none on the CPU backend, none after a switch to stock).
    peaks = {"steps": engine.steps_taken, "max_allocated_bytes": None}
    peaks.update(per_step=[list(p) for p in timeline.points], per_step_span=timeline.span)
    if engine.backend.is_cuda:
        peaks["max_allocated_bytes"] = torch.cuda.max_memory_allocated(engine.backend.device)
    return {
        "mode": engine.mode,
        "events": engine.events.text(),
        "params": {
            "paged_blocks": [u.block for u in blocks if u.paged],
            "resident_blocks": [u.block for u in blocks if not u.paged],
            "activation_paged_blocks": [u.block for u in blocks if u.act_paged],
            # Blocks whose forward runs again in backward (only their inputs kept), never also paged.
            "recompute_blocks": [u.block for u in blocks if u.recompute],
            "quantize": quant["format"],
        },
        "plan": {
            "device": str(engine.backend.device),
            "blocks": engine.stack.describe(),
            "quantized": quant,
            "moment_dtype": str(engine.optimizer.moment_dtype).replace("torch.", ""),
            # The trainable tensors kept whole on the device (device_state.py; None: none are).
            "device_state": device_state(engine),
            # Where the updates run: "cpu" (host AdamW) or "gpu" (the CUDA kernel), as decided.
            "optimizer_mode": "gpu" if engine.update_on_device else "cpu",
            # optimizer_mode="gpu": region updates whose moments were copied through VRAM, and
            # those mapped for want of room under the VRAM peak so far (None: host AdamW).
            "moment_copies": moment_copies(engine),
            "max_inflight_bytes": engine.max_inflight_bytes,
            "budget": engine.budget,
            "profile": dataclasses.asdict(engine.profile),
            "history": list(engine.history),
            # The placement wrap() applied, before any move in history.
            "placement_at_wrap": {
                "paged": list(engine.plan.paged),
                "act_paged": list(engine.plan.act_paged),
                "recompute": list(engine.plan.recompute),
            },
            # Saved activations per block (bytes, largest of the first passes), measured.
            "activation_bytes_per_block": dict(engine.activation_bytes),
        },
        "peaks": peaks,
        "paged_activation_bytes": engine.acts.paged_bytes,
        "activation_slab_bytes": engine.acts.slab_bytes,  # pinned host memory the paged activations hold
        "last_grad_norm": engine.last_grad_norm,
        "host_moment_bytes": host_moment_bytes(engine.optimizer),
        "host_master_bytes": host_master_bytes(engine),
        "distributed": data_parallel(engine),
    }


def device_state(engine) -> dict | None:
    """The device-state set: how many tensors and parameters, the device bytes its weights,
    gradients, moments and masters hold now (on this rank), and on how many ranks it is
    held whole (data parallel replicates it on every rank; 1 training alone)."""
    ds = engine.device_state
    if not len(ds):
        return None
    return {
        "tensors": len(ds),
        "parameters": sum(s.param.numel() for s in ds.slots),
        "device_bytes": ds.nbytes(),
        "replicas": engine.dp.world if engine.dp is not None else 1,
    }


def host_moment_bytes(optimizer) -> int:
    """Bytes of AdamW moments this process holds in host memory (with data parallel, its
    shards only); moments on a GPU (device state's, stock training's) are not host memory."""
    return sum(
        t.numel() * t.element_size()
        for st in optimizer.state.values()
        for k, t in st.items()
        if k in ("exp_avg", "exp_avg_sq") and not t.is_cuda  # device state's are on the device
    )


def host_master_bytes(engine) -> int:
    """Bytes of fp32 master weights the host AdamW updates that this process holds (with data
    parallel, its shard of each). An fp32 param's master is its host weights themselves;
    device state's masters are on the device, not counted here."""
    total = 0
    for u in engine.units:
        for s in u.trainable:
            master = s.master_shard if s.master_shard is not None else s.host.get(torch.float32)
            if master is not None:
                total += master.numel() * master.element_size()
    return total


def data_parallel(engine) -> dict | None:
    """Data parallel: the ranks, the share of the optimizer this rank holds and what it
    communicates per optimizer step (None when training alone)."""
    dp = engine.dp
    if dp is None:
        return None
    windows = max(dp.windows, 1)
    averaged = engine.ds_average.bytes_sent if engine.ds_average is not None else 0
    return {
        "world_size": dp.world,
        "rank": dp.rank,
        "shard_elements": sum(sh.hi - sh.lo for us in dp.shards.values() for sh in us.slots),
        "trainable_elements": sum(sh.numel for us in dp.shards.values() for sh in us.slots),
        "shard_moment_bytes": host_moment_bytes(engine.optimizer),
        "shard_master_bytes": host_master_bytes(engine),  # this rank's shard of the fp32 master
        # Device state's elements: not sharded but replicated, whole on every rank.
        "device_state_elements": sum(s.param.numel() for s in engine.device_state.slots),
        # What this rank sent into the gradient reduce-scatters, the weight all-gathers and
        # the device-state gradients' all-reduces.
        "bytes_communicated_per_step": (dp.bytes_reduced + dp.bytes_gathered + averaged) // windows,
    }
