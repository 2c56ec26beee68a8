"""What every suite shares: the machine's description, timing, and result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import __version__, _native


def git_commit() -> str:
    """The commit measured: $TRAINSTREAM_COMMIT (set when the tree was copied without .git),
    else git's HEAD, else 'unknown'."""
    if os.environ.get("TRAINSTREAM_COMMIT"):
        return os.environ["TRAINSTREAM_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def import_seconds(repeats: int = 3) -> tuple[float, float]:
    """Median wall times, in a fresh interpreter, of `import torch` and then of
    `import trainstream` on top of it (what the package itself adds)."""
    code = (
        "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
        "import trainstream; print(t1 - t0, time.perf_counter() - t1)"
    )
    torch_times, ours = [], []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        a, b = out.stdout.split()
        torch_times.append(float(a))
        ours.append(float(b))
    return statistics.median(torch_times), statistics.median(ours)


def environment() -> dict:
    native = _native.lib()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    import_torch_s, import_trainstream_s = import_seconds()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "trainstream": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": gpu,
        "cpu": cpu_model(),
        "cores": native.available_cores(),
        "simd": native.simd_level(),
        "python": sys.version.split()[0],
        "import_torch_s": round(import_torch_s, 3),
        "import_trainstream_s": round(import_trainstream_s, 3),  # after torch
    }


def machine_slug(env: dict) -> str:
    if env["gpu"]:
        return re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
    return f"cpu-{env['cores']}core"


def result_stem(suite: str, env: dict, quick: bool = False) -> str:
    """The file name, without suffix, of a suite's results on a machine: a quick run's apart
    (SUITE-MACHINE-quick), so that a smoke run never replaces measured results."""
    return f"{suite}-{machine_slug(env)}" + ("-quick" if quick else "")


def call_stamp() -> dict:
    """What each row of a suite merged over several calls keeps of the call that measured it:
    the commit, the date, and the host (rows of one file may come from different hosts)."""
    return dict(
        commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=cpu_model(),
        cores=_native.lib().available_cores(),
    )


def cap_vram(cap_gib) -> None:
    """Simulate a smaller card in this process: a VRAM cap of `cap_gib` GiB (None: none)."""
    if cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * (1 << 30) / total)


def settle(opt) -> None:
    """Wait for the GPU and, with TrainStream, for host updates still in flight: they belong
    to the steps timed."""
    torch.cuda.synchronize()
    if hasattr(opt, "_synchronize"):
        opt._synchronize()


def warm_up(step, opt, steps: int):
    """`steps` untimed training steps, settled, with the peak-memory counter reset after
    them; the first step's loss."""
    first = step()
    for _ in range(steps - 1):
        step()
    settle(opt)
    torch.cuda.reset_peak_memory_stats()
    return first


def timed_window(step, opt, steps: int) -> tuple:
    """Mean seconds per training step over `steps` steps, settled, and the last loss."""
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    settle(opt)
    return (time.perf_counter() - t) / steps, loss


def alternating_windows(steppers: dict, *, rounds: int, steps: int) -> dict:
    """Seconds per step of several runs in one process, their timed windows alternating (a, b,
    ..., a, b, ...): drift of the machine (clocks, the host's memory traffic) falls on every run
    alike, so ratios of a few percent stay readable. `steppers` maps a name to (step, opt),
    each already warmed up; the answer maps each name to its windows' median."""
    times: dict = {name: [] for name in steppers}
    for _ in range(rounds):
        for name, (step, opt) in steppers.items():
            settle(opt)
            times[name].append(timed_window(step, opt, steps)[0])
    return {name: statistics.median(t) for name, t in times.items()}


def median_seconds(fn, *, iters: int, warmup: int = 1, sync_cuda: bool = False) -> float:
    """Median wall time of fn() (device work is synchronized when sync_cuda is set)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if sync_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cuda_median_seconds(fn, *, iters: int, warmup: int = 3, reps: int = 10) -> float:
    """Median time per call of fn() on the current CUDA stream, from CUDA events around
    `reps` back-to-back calls: the Python cost of launching a short kernel then overlaps
    with the previous call's GPU work instead of being counted as GPU time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def parse_row_numbers(text: str, rows: tuple, what: str, example: str) -> list[int]:
    """A --rows value, '1,3,9' -> [1, 3, 9], each one of `rows`; anything else a ValueError
    naming the flag and the accepted numbers (`what`: how they are called, `example`: a value)."""
    accepted = f"accepted: comma-separated {what} from {rows[0]} to {rows[-1]}, e.g. {example!r}"
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"--rows {text!r}: {accepted}")
    numbers = sorted({int(p) for p in parts})
    unknown = [n for n in numbers if n not in rows]
    if unknown:
        raise ValueError(f"--rows {text!r}: no row {unknown[0]}; {accepted}")
    return numbers


def markdown_table(columns: list[tuple[str, str]], rows: list[dict]) -> str:
    """columns: (key, header) pairs; floats print with 3 significant digits."""

    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def env_line(env: dict) -> str:
    hw = env["gpu"] or "no GPU"
    text = (
        f"{hw}; {env['cpu']}, {env['cores']} cores ({env['simd']}); torch {env['torch']}; "
        f"commit {env['commit']}; {env['date']}"
    )
    if "import_trainstream_s" in env:
        text += (
            f"; `import trainstream` {env['import_trainstream_s']:.2f} s after "
            f"`import torch` {env.get('import_torch_s', float('nan')):.2f} s"
        )
    return text


def host_of(row: dict) -> str:
    """The host of the call that measured `row` (call_stamp), as ", CPU, N cores" to follow its
    date in a calls list; "" for a row measured before rows kept it."""
    return f", {row.get('cpu')}, {row['cores']} cores" if row.get("cores") is not None else ""


def write_result(out_dir: Path, suite: str, env: dict, result: dict, markdown: str, *, quick: bool = False) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(suite, env, quick)
    payload = {"suite": suite, "env": env, "quick": quick, **result, "markdown": markdown}
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(f"### {suite} ({env_line(env)})\n\n{markdown}\n")
    return out_dir / f"{stem}.json"


def case_in_subprocess(module: str, case: dict, timeout: float = 900):
    """Run `python -m module CASE_JSON` and return the JSON its last stdout line printed, or
    None with the tail of its output and a last line "[exit status N]" when it failed (N < 0:
    killed by signal -N), or "[timed out after T s]" when it ran past `timeout` seconds. A
    case's memory cap, pinned memory and crashes stay in its process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, json.dumps(case)], capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        tail = e.stderr or e.stdout or b""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return None, tail[-600:] + f"\n[timed out after {timeout:g} s]"
    lines = [line for line in proc.stdout.splitlines() if line[:1] in "{["]
    if proc.returncode != 0 or not lines:
        return None, (proc.stderr or proc.stdout)[-600:] + f"\n[exit status {proc.returncode}]"
    return json.loads(lines[-1]), None
