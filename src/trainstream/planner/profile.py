"""The hardware profile: how much memory the machine has and how fast it moves bytes.

Rates (PCIe both ways, host AdamW, matmul) are measured once and cached on disk, keyed by
what determines them (GPU, driver, torch, CPU, RAM size); free memory is read fresh on
every call, since it changes. A HardwareProfile built by hand is used as given: that is
how tests simulate a 4 GB card or a 16 GB-RAM laptop on the CPU path.

Host memory is the smallest of what the OS says is available (MemAvailable) and what each
memory cgroup the process is in leaves (a container's or a Slurm job's limit is what the
OOM killer enforces, whatever the machine has); the profile says which one bound it, and
wrap() puts that in the events (memory_report()["events"]).
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
from typing import NamedTuple

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
    # Which limit gave ram_available_bytes and pinned_limit_bytes (host_memory(),
    # pinned_limit()); empty in a profile built by hand.
    ram_bound_by: str = ""
    pinned_bound_by: str = ""

    def describe(self) -> str:
        ram_by = f" ({self.ram_bound_by})" if self.ram_bound_by else ""
        pinned_by = f" ({self.pinned_bound_by})" if self.pinned_bound_by else ""
        return (
            f"{self.source} hardware profile: VRAM {self.vram_free_bytes / GiB:.1f} of "
            f"{self.vram_total_bytes / GiB:.1f} GiB free, RAM {self.ram_available_bytes / GiB:.1f} GiB "
            f"available{ram_by}, pinnable {self.pinned_limit_bytes / GiB:.1f} GiB{pinned_by}, PCIe "
            f"{self.h2d_bytes_per_s / 1e9:.1f} GB/s in / "
            f"{self.d2h_bytes_per_s / 1e9:.1f} GB/s out, host AdamW {self.host_adamw_params_per_s / 1e9:.2f} "
            f"G params/s"
        )


# Where Linux publishes the memory limits: tests point these at a simulated tree.
PROC_MEMINFO = Path("/proc/meminfo")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def ram_total_and_available() -> tuple[int, int]:
    """The machine's RAM and what the OS says is available (MemAvailable): through psutil
    where it is installed (any OS), else /proc/meminfo, else sysconf."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    info = {}
    try:
        with open(PROC_MEMINFO) as f:
            for line in f:
                name, value = line.split(":", 1)
                info[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = info.get("MemTotal", os.sysconf("SC_PHYS_PAGES") * page)
    return total, info.get("MemAvailable", os.sysconf("SC_AVPHYS_PAGES") * page)


class CgroupLimit(NamedTuple):
    limit: int  # bytes the cgroup may hold
    available: int  # of which not yet used (see cgroup_limits)
    where: str  # the limit's file


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None when absent, unreadable or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_dirs(base: Path, path: str) -> list[Path]:
    """The process's cgroup directory under `base` and each ancestor up to `base`: a limit set
    on a parent (a Slurm job above its steps) binds its children. Inside a container the
    path names the host's hierarchy while `base` is the container's own cgroup; then only
    `base` itself is there to read."""
    own = base / path.strip("/")
    if not own.is_dir():
        return [base]
    dirs = [own]
    while dirs[-1] != base and base in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


def cgroup_limits() -> list[CgroupLimit]:
    """Every memory limit of the cgroups this process is in (v2 memory.max, v1
    memory.limit_in_bytes), with what each leaves: the limit less the memory charged to it
    (memory.current, v1 memory.usage_in_bytes) that cannot be reclaimed. Inactive file
    cache is charged but dropped first when the limit is reached, so it counts as available,
    as it does in MemAvailable. Empty where no cgroup limits memory."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            files = ("memory.max", "memory.current", "inactive_file")
            base = CGROUP_ROOT
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            base = CGROUP_ROOT / "memory"
        else:
            continue
        for d in _cgroup_dirs(base, path):
            limit = _read_int(d / files[0])
            if limit is None:
                continue
            used = (_read_int(d / files[1]) or 0) - _stat(d / "memory.stat", files[2])
            limits.append(CgroupLimit(limit, max(0, limit - max(0, used)), str(d / files[0])))
    return limits


class HostMemory(NamedTuple):
    total: int  # the RAM, or the smallest cgroup limit where one is lower
    available: int
    bound_by: str  # what gave `available`, for the events
    total_bound_by: str  # what gave `total`


def host_memory() -> HostMemory:
    """Host memory to plan against: the smallest of MemAvailable and what each memory cgroup
    of this process leaves."""
    total, available = ram_total_and_available()
    bound_by, total_bound_by = "MemAvailable", "RAM"
    for c in cgroup_limits():
        if c.limit < total:
            total, total_bound_by = c.limit, f"the cgroup limit {c.where}"
        if c.available < available:
            available, bound_by = c.available, f"the cgroup limit {c.where}"
    return HostMemory(total, available, bound_by, total_bound_by)


def pinned_limit(ram_total: int, device: torch.device, total_bound_by: str = "RAM") -> tuple[int, str]:
    """How much host memory can be pinned, and what bounds it: the RAM (`ram_total`, already
    the cgroup's limit where that is lower: pinned pages are charged to it), unless
    RLIMIT_MEMLOCK is set and a trial allocation larger than it fails (cudaHostAlloc ignores
    the limit on most drivers, cudaHostRegister and some clusters do not); 0 when pinning
    fails outright. The CPU backend pins nothing, so its limit is the RAM. `total_bound_by`
    says what gave `ram_total`."""
    if device.type != "cuda":
        return ram_total, total_bound_by
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    trial = 64 << 20 if soft == resource.RLIM_INFINITY else min(max(2 * soft, 64 << 20), 256 << 20)
    try:
        torch.empty(trial, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        if soft != resource.RLIM_INFINITY:
            return min(soft, ram_total), "RLIMIT_MEMLOCK (ulimit -l): a pinned allocation above it failed"
        return 0, "pinning failed"
    return ram_total, total_bound_by


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
    memory = host_memory()
    return memory.total, memory.available


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


def _resolve(device, where: str = "profile_hardware()") -> torch.device:
    """`device` as wrap()'s device option takes it (ValueError naming it otherwise), with a
    CUDA index filled in; a CUDA device needs a visible GPU of that index."""
    from .. import options

    device = options.check("device", device, where=where)
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        from .._native import require_cuda

        require_cuda(f"{where} on {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(
                f"{where}: option 'device' got {device}; accepted: a visible GPU, cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    return device


def _now(device: torch.device, rates: dict, source: str) -> HardwareProfile:
    vram_total, vram_free = _device_memory(device)
    memory = host_memory()
    pinnable, pinned_by = pinned_limit(memory.total, device, memory.total_bound_by)
    return HardwareProfile(
        vram_total_bytes=vram_total,
        vram_free_bytes=vram_free,
        ram_available_bytes=memory.available,
        pinned_limit_bytes=pinnable,
        device=str(device),
        source=source,
        ram_bound_by=memory.bound_by,
        pinned_bound_by=pinned_by,
        **rates,
    )


def conservative_profile(device=None) -> HardwareProfile:
    """profile=False: the machine's memory sizes with rates a slow machine still reaches."""
    return _now(_resolve(device, "conservative_profile()"), dict(CONSERVATIVE_RATES), "conservative")


def profile_hardware(device=None, quick: bool = True, force: bool = False) -> HardwareProfile:
    """Measure (or load from the cache) the hardware figures the planner uses for `device`
    (default: the current GPU, else the CPU). `quick` measures with smaller transfers;
    `force` re-measures and rewrites the cache."""
    for name, value in (("quick", quick), ("force", force)):
        if not isinstance(value, bool):
            raise ValueError(f"profile_hardware(): option {name!r} got {value!r}; accepted: True, False")
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
