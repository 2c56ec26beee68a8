"""The hardware profile: how much memory the machine has and how fast it moves bytes.

Rates (PCIe both ways, host AdamW, matmul) are measured once and cached on disk, keyed by
what determines them (GPU, driver, torch, CPU, RAM size); free memory is read fresh on
every call, since it changes. A HardwareProfile built by hand is used as given: that is
how tests simulate a 4 GB card or a 16 GB-RAM laptop on the CPU path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..sizes import GiB

# profile=False: rates a slow machine still reaches (PCIe 3 x8, a few cores).
CONSERVATIVE_RATES = dict(h2d_bytes_per_s=6e9, d2h_bytes_per_s=6e9, host_adamw_params_per_s=5e8, matmul_flops=0.0)
_RATE_FIELDS = ("h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s", "matmul_flops")


@dataclass(frozen=True)
class HardwareProfile:
    vram_total_bytes: int
    vram_free_bytes: int
    ram_available_bytes: int
    pinned_limit_bytes: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    host_adamw_params_per_s: float = CONSERVATIVE_RATES["host_adamw_params_per_s"]
    matmul_flops: float = 0.0  # bf16 matmul rate of the device; 0 when not measured
    device: str = "cuda"
    source: str = "given"  # "given", "measured", "cached" or "conservative"

    def describe(self) -> str:
        return (
            f"{self.source} hardware profile: VRAM {self.vram_free_bytes / GiB:.1f} of "
            f"{self.vram_total_bytes / GiB:.1f} GiB free, RAM {self.ram_available_bytes / GiB:.1f} GiB available, "
            f"pinnable {self.pinned_limit_bytes / GiB:.1f} GiB, PCIe {self.h2d_bytes_per_s / 1e9:.1f} GB/s in / "
            f"{self.d2h_bytes_per_s / 1e9:.1f} GB/s out, host AdamW {self.host_adamw_params_per_s / 1e9:.2f} "
            f"G params/s"
        )


def ram_total_and_available() -> tuple[int, int]:
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, value = line.split(":", 1)
                info[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = info.get("MemTotal", os.sysconf("SC_PHYS_PAGES") * page)
    return total, info.get("MemAvailable", os.sysconf("SC_AVPHYS_PAGES") * page)


def pinned_limit(ram_total: int, device: torch.device) -> int:
    """How much host memory can be pinned: the RAM, unless RLIMIT_MEMLOCK is set and a
    trial allocation larger than it fails (cudaHostAlloc ignores the limit on most drivers,
    cudaHostRegister and some clusters do not); 0 when pinning fails outright. The CPU
    backend pins nothing, so its limit is the RAM."""
    if device.type != "cuda":
        return ram_total
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    trial = 64 << 20 if soft == resource.RLIM_INFINITY else min(max(2 * soft, 64 << 20), 256 << 20)
    try:
        torch.empty(trial, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        if soft != resource.RLIM_INFINITY:
            return min(soft, ram_total)
        return 0
    return ram_total


def _device_memory(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Memory the caching allocator holds but has not handed out is ours to use.
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        free += reserved - allocated
        # A per-process cap (set_per_process_memory_fraction) binds before the card does.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
        if fraction < 1.0:
            capped = int(fraction * total)
            total, free = capped, max(0, min(free, capped - allocated))
        return total, free
    total, available = ram_total_and_available()
    return total, available


def _cache_key(device: torch.device) -> str:
    parts = [
        torch.__version__,
        platform.processor() or platform.machine(),
        str(os.cpu_count()),
        str(round(ram_total_and_available()[0] / GiB)),
    ]
    try:
        with open("/proc/cpuinfo") as f:
            parts.append(next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""))
    except OSError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: 0)()
        parts += [props.name, str(props.total_memory), str(driver)]
    else:
        parts.append("cpu")
    return "|".join(parts)


def cache_dir() -> Path:
    return Path(os.environ.get("TRAINSTREAM_CACHE_DIR", Path.home() / ".cache" / "trainstream"))


def _median_s(fn, iters: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _measure_rates(device: torch.device, quick: bool) -> dict:
    from ..ops import adamw_step

    # 64 MiB copies already run at the link's full rate, and keep the device memory the
    # profile borrows (its buffers show in the caller's max_memory_allocated) small.
    n_bytes = (64 if quick else 256) << 20
    iters = 3 if quick else 7
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    h2d = n_bytes / _median_s(lambda: dev.copy_(host, non_blocking=True), iters, sync)
    d2h = n_bytes / _median_s(lambda: host.copy_(dev, non_blocking=True), iters, sync)
    host = dev = None  # the profile borrows no memory past here
    n = 1 << 24  # 64 MiB per tensor, 256 MiB in all: larger than any cache, as a model's state is
    p, g, m, v = (torch.zeros(n) for _ in range(4))
    step = [0]

    def adamw():
        step[0] += 1
        adamw_step([p], [g], [m], [v], [step[0]], lr=1e-3).wait()

    adamw_rate = n / _median_s(adamw, iters, lambda: None)
    flops = 0.0
    if device.type == "cuda":
        a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
        flops = 2 * 4096**3 / _median_s(lambda: a @ a, iters, sync)
    return dict(h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, host_adamw_params_per_s=adamw_rate, matmul_flops=flops)


def _resolve(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _now(device: torch.device, rates: dict, source: str) -> HardwareProfile:
    vram_total, vram_free = _device_memory(device)
    ram_total, ram_available = ram_total_and_available()
    return HardwareProfile(
        vram_total_bytes=vram_total,
        vram_free_bytes=vram_free,
        ram_available_bytes=ram_available,
        pinned_limit_bytes=pinned_limit(ram_total, device),
        device=str(device),
        source=source,
        **rates,
    )


def conservative_profile(device=None) -> HardwareProfile:
    """profile=False: the machine's memory sizes with rates a slow machine still reaches."""
    return _now(_resolve(device), dict(CONSERVATIVE_RATES), "conservative")


def profile_hardware(device=None, quick: bool = True, force: bool = False) -> HardwareProfile:
    """Measure (or load from the cache) the hardware figures the planner uses for `device`
    (default: the current GPU, else the CPU). `quick` measures with smaller transfers;
    `force` re-measures and rewrites the cache."""
    device = _resolve(device)
    key = _cache_key(device)
    path = cache_dir() / f"profile-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
    if not force:
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return _now(device, {k: float(cached[k]) for k in _RATE_FIELDS}, "cached")
        except (OSError, ValueError, KeyError):
            pass
    rates = _measure_rates(device, quick)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, **rates}, indent=1))
        tmp.replace(path)  # atomic: processes on one node may profile at once
    except OSError:
        pass  # a read-only home still gets a profile, just not a cached one
    return _now(device, rates, "measured")


def as_dict(profile: HardwareProfile) -> dict:
    return dataclasses.asdict(profile)
