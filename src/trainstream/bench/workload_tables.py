"""The workloads suite's arithmetic and output (bench/workloads.py): each TrainStream run's
physical bound and its checks, from the numbers its cases measured; the markdown; the PNG.

A run's bound is the largest of: compute (the row's forward + backward with no optimizer,
measured uncapped where the model fits on the GPU; else derived: 6 (full) or 4 (frozen base)
products per matmul weight and token at the bf16 matmul rate measured in the run's call,
attention's own products left out, so it is below any real step; row 9: stock's step,
interleaved with ours in one process); PCIe (the bytes the run's plan moves, at the pinned rates
measured in its call: bytes moving both ways at once at the rate of copies in both directions,
the rest at its one-way rate); the host AdamW (its trained parameters at the host AdamW's rate
for its moment dtype, measured in its call)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .common import host_of, markdown_table
from .workload_cases import first_line

OURS = ("trainstream", "trainer_ours")
RATIO_TARGET = 1.25
# Extra targets beyond the bound and the peers (issue 24).
MAX_S_PER_STEP = {10: 1.5}


def pcie_seconds(h2d_bytes: float, d2h_bytes: float, bw: dict) -> float:
    """The least time the copies can take: bytes moving both ways at once at the measured rate
    of copies in both directions (each way), what is left of one direction at its own rate."""
    both = min(h2d_bytes, d2h_bytes)
    return (
        both / (bw["bidir_each_way"] * 1e9)
        + (h2d_bytes - both) / (bw["h2d"] * 1e9)
        + (d2h_bytes - both) / (bw["d2h"] * 1e9)
    )


def _ok(r: dict) -> bool:
    return "s_per_step" in r and not r.get("oom") and "error" not in r


def add_bounds(runs: list[dict]) -> None:
    """Each TrainStream run of a row gains its bound (compute, PCIe, host AdamW: at the rates
    measured in its own call, its "rates") and its ratio."""
    compute = next((r for r in runs if r["runner"] == "compute"), None)
    stock = next((r for r in runs if r["runner"] == "stock" and _ok(r)), None)
    for r in runs:
        if r["runner"] not in OURS or not _ok(r):
            continue
        probe = r.get("rates") or {}
        if compute is not None and _ok(compute):
            compute_s, how = compute["s_per_step"], "measured: forward + backward, uncapped"
        elif "window_s_per_step" in r and stock is not None:
            compute_s, how = stock["s_per_step"], "stock's step, interleaved in the same process"
        elif r.get("matmul_params") and r.get("tokens") and probe.get("matmul_TFLOPs"):
            # A frozen base (LoRA) makes no weight gradients: 4 products per weight, not 6.
            factor = 4 if r.get("trained_params", 0) < r["matmul_params"] / 2 else 6
            rate = probe["matmul_TFLOPs"]
            compute_s = factor * r["matmul_params"] * r["tokens"] / (rate * 1e12)
            how = f"derived: {factor} x {r['matmul_params'] / 1e9:.3g}B x {r['tokens']} tokens at {rate:.3g} TFLOP/s"
        else:
            compute_s, how = None, None
        pcie_s = None
        if "pcie_GBps" in probe and "h2d_bytes" in r:
            pcie_s = pcie_seconds(r["h2d_bytes"], r["d2h_bytes"], probe["pcie_GBps"])
        host_s = None
        rates = probe.get("host_adamw_params_per_s")
        if rates and r.get("optimizer_mode") == "cpu" and r.get("mode") != "stock" and r.get("trained_params"):
            host_s = r["trained_params"] / rates[r.get("moment_dtype", "float32")]
        parts = {"compute": compute_s, "PCIe": pcie_s, "host AdamW": host_s}
        known = {k: v for k, v in parts.items() if v is not None}
        if not known:
            continue
        by = max(known, key=known.get)
        r.update(
            compute_s=compute_s,
            compute_how=how,
            pcie_s=pcie_s,
            host_adamw_s=host_s,
            bound_s=known[by],
            bound_by=by,
            vs_bound=r["s_per_step"] / known[by],
        )


def _check(row: int, text: str, value, op: str, limit) -> dict:
    met = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and limit is not None:
        met = value <= limit if op == "<=" else value < limit
    return dict(row=row, check=text, value=value, target=f"{op} {limit}" if limit is not None else "-", met=met)


def row_checks(row: int, runs: list[dict], cap) -> list[dict]:
    """The row's checks: each TrainStream run against its bound; the first one against every
    peer that fits under the row's cap; the row's own extra target."""
    checks = []
    ours = [r for r in runs if r["runner"] in OURS]
    for r in ours:
        if "vs_bound" in r:
            checks.append(
                _check(
                    row,
                    f"{r['run']}: step / bound ({r['bound_by']}, {r['bound_s']:.3g} s)",
                    r["vs_bound"],
                    "<=",
                    RATIO_TARGET,
                )
            )
        elif not _ok(r):
            checks.append(_check(row, f"{r['run']}: trains", "no", "-", None))
    first = next((r for r in ours if _ok(r)), None)
    peers = [r for r in runs if r["runner"] not in OURS + ("compute",) and r.get("cap_GiB") == cap]
    if first is not None and peers:
        fits = [p for p in peers if _ok(p)]
        if "window_s_per_step" in first and fits:
            stock = fits[0]
            ratio = statistics.median(first["window_s_per_step"]) / statistics.median(stock["window_s_per_step"])
            checks.append(
                _check(
                    row,
                    f"defaults / stock, ratio of the medians of {len(stock['window_s_per_step'])} interleaved windows",
                    ratio,
                    "<=",
                    1.02,
                )
            )
        elif fits:
            best = min(fits, key=lambda p: p["s_per_step"])
            checks.append(
                _check(
                    row,
                    f"ours / the fastest peer that fits ({best['run']})",
                    first["s_per_step"] / best["s_per_step"],
                    "<",
                    1.0,
                )
            )
        else:
            checks.append(
                _check(row, f"peers that fit: none of {len(peers)} (out of memory, failed or skipped)", "-", "-", None)
            )
    if first is not None and row in MAX_S_PER_STEP:
        checks.append(_check(row, f"{first['run']}: s/step", first["s_per_step"], "<=", MAX_S_PER_STEP[row]))
    if first is not None:
        checks.append(
            _check(row, f"{first['run']}: every loss finite", "yes" if first.get("finite") else "no", "-", None)
        )
    stock = next((r for r in runs if r["runner"] == "trainer_stock" and r.get("cap_GiB") is None and _ok(r)), None)
    if first is not None and stock is not None and len(first.get("losses", [])) == len(stock.get("losses", [])):
        diff = max(abs(a - b) for a, b in zip(first["losses"], stock["losses"]))
        checks.append(
            _check(row, "largest loss difference from the uncapped stock Trainer, step by step", diff, "-", None)
        )
    return checks


# -- the tables and the plot ---------------------------------------------------------------------------


def _planner(r: dict) -> str | None:
    """What the planner chose, in a cell."""
    if "mode" not in r:
        return None
    if r["mode"] == "stock":
        return "switched to stock"
    parts = [f"{len(r['paged_blocks'])} paged", f"{len(r['activation_paged_blocks'])} act. paged"]
    if r.get("quantize") not in (None, "none"):
        parts.append(r["quantize"])
    if "moment_dtype" in r:
        parts.append(f"{r['moment_dtype']} moments")
    if "optimizer_mode" in r:
        parts.append(f"optimizer {r['optimizer_mode']}")
    return ", ".join(parts)


def _outcome(r: dict) -> str | None:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    if r.get("oom"):
        return f"out of memory: {r.get('error', '')}".strip()
    return r.get("error") or r.get("note")


def _gb(n) -> float | None:
    return None if n is None else n / 1e9


def _rates(probe: dict) -> str:
    text = ""
    bw = probe.get("pcie_GBps")
    if bw:
        text += (
            f"; pinned H2D {bw['h2d']:.1f}, D2H {bw['d2h']:.1f}, both at once {bw['bidir_each_way']:.1f} GB/s each way"
        )
    host = probe.get("host_adamw_params_per_s")
    if host:
        text += (
            f"; host AdamW {host['float32'] / 1e9:.2f} (fp32 moments), {host['bfloat16'] / 1e9:.2f} (bf16) G params/s"
        )
    if probe.get("matmul_TFLOPs"):
        text += f"; bf16 matmul {probe['matmul_TFLOPs']:.3g} TFLOP/s"
    if probe.get("error"):
        text += f"; rates not measured: {probe['error']}"
    return text


def markdown(payload: dict) -> str:
    rows = payload["rows"]
    by_row = {}
    for r in rows:
        by_row.setdefault(r["row"], r["workload"])
    firsts = {}
    for r in rows:
        if r["runner"] in OURS and _ok(r):
            firsts.setdefault(r["row"], r["s_per_step"])
    cells = []
    for r in rows:
        mine = firsts.get(r["row"])
        cells.append(
            dict(
                r,
                vs_ours=r["s_per_step"] / mine if mine and _ok(r) else None,
                s=r.get("s_per_step") if _ok(r) else None,
                planner=_planner(r),
                outcome=_outcome(r),
            )
        )
    runs = markdown_table(
        [
            ("row", "row"),
            ("run", "run"),
            ("cap_GiB", "VRAM cap GiB"),
            ("s", "s/step"),
            ("vs_ours", "x ours"),
            ("peak_GiB", "peak VRAM GiB"),
            ("host_rss_GiB", "peak host RSS GiB"),
            ("load_s", "load s"),
            ("wrap_s", "wrap s"),
            ("first_step_s", "first step s"),
            ("first_loss", "first loss"),
            ("last_loss", "last loss"),
            ("planner", "planner"),
            ("outcome", "out of memory, error or note"),
        ],
        cells,
    )
    bounded = [
        dict(r, h2d=_gb(r.get("h2d_bytes")), d2h=_gb(r.get("d2h_bytes")))
        for r in rows
        if r["runner"] in OURS and ("bound_s" in r or "bound_note" in r)
    ]
    bounds = markdown_table(
        [
            ("row", "row"),
            ("run", "run"),
            ("s_per_step", "s/step"),
            ("compute_s", "compute s"),
            ("compute_how", "compute, how"),
            ("h2d", "H2D GB"),
            ("d2h", "D2H GB"),
            ("pcie_s", "PCIe s"),
            ("host_adamw_s", "host AdamW s"),
            ("bound_s", "bound s"),
            ("bound_by", "set by"),
            ("vs_bound", "s/step / bound"),
        ],
        bounded,
    )
    checks = markdown_table(
        [("row", "row"), ("check", "check"), ("value", "measured"), ("target", "target"), ("met", "met")],
        [dict(c, met={True: "yes", False: "no"}.get(c["met"], "-")) for c in payload["checks"]],
    )
    totals, calls = {}, {}
    for r in rows:  # each call: its commit, date and rates, and how many runs of which rows it measured
        totals[r["row"]] = totals.get(r["row"], 0) + 1
        call = calls.setdefault((r.get("commit"), r.get("date"), host_of(r)), dict(rates=r.get("rates") or {}, rows={}))
        call["rows"][r["row"]] = call["rows"].get(r["row"], 0) + 1
    measured = []
    for (commit, date, host), call in calls.items():
        done = [f"{n}" if k == totals[n] else f"{n} ({k} of its {totals[n]} runs)" for n, k in call["rows"].items()]
        measured.append(f"- rows {', '.join(done)}: commit {str(commit)[:12]}, {date}{host}{_rates(call['rates'])}")
    titles = [f"{n}. {title}" for n, title in sorted(by_row.items())]
    quick = (
        "Quick run: toy sizes of every row (not results); on the CPU no VRAM cap applies.\n\n"
        if payload["quick"]
        else ""
    )
    plot_line = f"\n\nPlot: {payload['plot_note']}" if payload.get("plot_note") else ""
    timelines = [
        f"- row {r['row']}, {r['run']}: "
        + (f"![memory]({r['memory_plot']})" if r.get("memory_plot") else r["memory_plot_note"])
        for r in rows
        if r.get("memory_plot") or r.get("memory_plot_note")
    ]
    if timelines:  # plot_memory of the run: each step's peak and the planner's moves
        plot_line += "\n\nMemory over the run (trainstream.plot_memory):\n\n" + "\n".join(timelines)
    return (
        quick
        + "Rows:\n\n"
        + "\n".join(titles)
        + "\n\nMeasured (each call: the rows it ran, at which commit, and the rates its bounds use):\n\n"
        + "\n".join(measured)
        + "\n\n"
        + runs
        + "\n\nEach TrainStream run against its physical bound (the largest of compute, PCIe and the host AdamW; "
        "bench/workload_tables.py says how each is measured):\n\n" + bounds + "\n\n" + checks + plot_line
    )


def plot(rows: list[dict], path: Path) -> tuple[str | None, str | None]:
    """s/step and peak VRAM of every run, row by row, ours against the peers, as a PNG at
    `path`: (its file name, None), or (None, why not) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return None, f"not drawn: matplotlib is not installed ({first_line(e)})"
    shown = [r for r in rows if r["runner"] != "compute"]
    if not shown:
        return None, "not drawn: no runs"
    labels = [f"{r['row']}: {r['run'][:56]}" for r in shown]
    colors = ["tab:orange" if r["runner"] in OURS else "tab:blue" for r in shown]
    fig, axes = plt.subplots(1, 2, figsize=(18, 0.32 * len(shown) + 1.5), sharey=True)
    y = list(range(len(shown)))
    for ax, key, title in ((axes[0], "s_per_step", "s/step (log)"), (axes[1], "peak_GiB", "peak VRAM GiB")):
        values = [r[key] if _ok(r) and r.get(key) is not None else math.nan for r in shown]
        ax.barh(y, values, color=colors)
        for i, r in enumerate(shown):
            if not _ok(r):  # at the axis' left edge: a log axis has no 0
                word = "out of memory" if r.get("oom") else "skipped" if r.get("skipped") else "failed"
                ax.text(0.01, i, word, va="center", fontsize=7, transform=ax.get_yaxis_transform())
        ax.set_title(title)
        if key == "s_per_step" and any(math.isfinite(v) for v in values):
            ax.set_xscale("log")
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle("workloads: TrainStream (orange) against the peers (blue), each under its row's VRAM cap")
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title above the panels
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path).name, None
