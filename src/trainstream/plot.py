"""plot_memory(): one run's memory as a PNG timeline: each step's measured device peak, the
usable memory and the device's size, and every planner move at the step it was taken.

Drawn from a memory_report() dictionary only (a wrapped model is asked for its report), so a
report saved as JSON plots the same later. matplotlib is imported on call: it is an optional
extra (`plot`), never a dependency of the engine. The figure is drawn on its own Agg canvas,
without pyplot: the caller's backend and open figures are left alone.
"""

from __future__ import annotations

import os
import pathlib

import torch

from .engine.adapt import _ranges
from .sizes import GiB, MiB

# What the plot reads from a report: (path of keys, what it is), so a dict that is not a
# memory_report() of this version is refused with the keys it lacks.
REQUIRED = (
    (("mode",), "offload or stock"),
    (("params", "paged_blocks"), "the placement now"),
    (("params", "activation_paged_blocks"), "the placement now"),
    (("plan", "device"), "the device"),
    (("plan", "history"), "the planner's moves"),
    (("plan", "placement_at_wrap"), "the placement before the first move"),
    (("plan", "budget", "device_usable"), "the usable device memory"),
    (("plan", "profile", "vram_total_bytes"), "the device memory"),
    (("peaks", "steps"), "the steps taken"),
    (("peaks", "per_step"), "the measured peak per step"),
    (("peaks", "per_step_span"), "steps per point"),
)

MAX_LISTED = 30  # lines of moves listed under the plot; the rest are counted, pointing at the history
KIND_COLOR = {"switch": "tab:red", "applied": "tab:orange", "replan": "tab:orange", "guard": "tab:purple"}


def plot_memory(model_or_report, path, *, title=None) -> pathlib.Path:
    """Write a PNG of the run's memory timeline to `path` (a ``.png`` file in an existing
    folder) and return it as a ``pathlib.Path``. `model_or_report`: a model returned by
    ``trainstream.wrap()``, or a ``trainstream.memory_report()`` dictionary (also one read back
    from JSON). `title`: the figure's title (default: the mode, device and steps)."""
    report = _report_of(model_or_report)
    target = _png_path(path)
    if title is not None and not isinstance(title, str):
        raise TypeError(f"plot_memory(title=...): a str or None, got {type(title).__name__}")
    figure_cls, canvas_cls = _matplotlib()
    _draw(report, target, title, figure_cls, canvas_cls)
    return target


def planner_moves(report: dict) -> list:
    """The planner's moves as (step, kind, label): `step` is the number of steps taken when
    the move was made (a guard acts inside the next step's pass, the others between steps);
    an applied replan is labelled with the blocks it moved, from the placement at wrap() on."""
    paged = set(report["plan"]["placement_at_wrap"]["paged"])
    acts = set(report["plan"]["placement_at_wrap"]["act_paged"])
    moves = []
    for entry in report["plan"]["history"]:
        kind, message = entry["kind"], entry["message"]
        if kind == "guard":
            acts |= set(entry["blocks"])
            label = f"guard: activations paged during the pass, blocks {_ranges(sorted(entry['blocks']))}"
        elif kind == "replan":
            why = message.split(":", 1)[0]
            seen = "unknown" if entry["observed"] is None else _human(entry["observed"])
            label = f"replan ({why}): measured peak {seen}, predicted {_human(entry['predicted'])}"
        elif kind == "applied":
            label = "moved: " + _placement_change(paged, acts, set(entry["paged"]), set(entry["act_paged"]))
            paged, acts = set(entry["paged"]), set(entry["act_paged"])
        elif kind == "switch":
            label = "switched to torch.optim.AdamW(fused=True): stock training from here"
        elif kind == "offload":
            label = "offload='auto': stays in offload mode"
        else:  # "warning", and any kind added later: its own words
            label = f"{kind}: {message}"
        moves.append((entry["step"], kind, _shorten(label, 110)))
    return moves


def _placement_change(paged, acts, new_paged, new_acts) -> str:
    parts = []
    for what, old, new in (("weights", paged, new_paged), ("activations", acts, new_acts)):
        if new - old:
            parts.append(f"{what} paged for blocks {_ranges(sorted(new - old))}")
        if old - new:
            parts.append(f"{what} back on the device for blocks {_ranges(sorted(old - new))}")
    return "; ".join(parts) or "placement unchanged"


def _report_of(model_or_report) -> dict:
    if isinstance(model_or_report, torch.nn.Module):
        from .api import _ATTR, memory_report

        if getattr(model_or_report, _ATTR, None) is None:
            raise ValueError(
                "plot_memory(model_or_report=...): this model is not wrapped; pass a model returned by "
                "trainstream.wrap() or a trainstream.memory_report() dict"
            )
        return memory_report(model_or_report)
    if not isinstance(model_or_report, dict):
        raise TypeError(
            "plot_memory(model_or_report=...): a model returned by trainstream.wrap() or a "
            f"trainstream.memory_report() dict, got {type(model_or_report).__name__}"
        )
    missing = [".".join(keys) + f" ({what})" for keys, what in REQUIRED if not _has(model_or_report, keys)]
    if missing:
        raise ValueError(
            "plot_memory(model_or_report=...): this dict is not a memory_report() of this trainstream "
            f"version; it lacks {', '.join(missing)}"
        )
    return model_or_report


def _has(d, keys) -> bool:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return False
        d = d[key]
    return True


def _png_path(path) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"plot_memory(path=...): a str or os.PathLike ending in .png, got {type(path).__name__}")
    target = pathlib.Path(path)
    if target.suffix.lower() != ".png":
        raise ValueError(f"plot_memory(path=...): the file is a PNG, so its name ends in .png; got {str(path)!r}")
    if not target.parent.is_dir():
        raise ValueError(f"plot_memory(path=...): the folder {str(target.parent)!r} does not exist")
    return target


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "trainstream.plot_memory needs matplotlib, which trainstream does not install: pip install matplotlib"
        ) from e
    return Figure, FigureCanvasAgg


def _draw(report, target, title, figure_cls, canvas_cls) -> None:
    peaks = report["peaks"]
    points = peaks["per_step"]
    span = peaks["per_step_span"]
    usable = report["plan"]["budget"]["device_usable"]
    total = report["plan"]["profile"]["vram_total_bytes"]
    moves = planner_moves(report)
    # MiB for a small device (the tests' simulated cards), GiB otherwise.
    largest = max([usable, total, peaks.get("max_allocated_bytes") or 0] + [p[1] for p in points])
    unit, unit_name = (GiB, "GiB") if largest >= GiB else (MiB, "MiB")

    # One marker per step with moves, numbered; the list under the plot says what each was.
    groups: dict = {}
    for step, kind, label in moves:
        groups.setdefault(step, []).append((kind, label))
    lines = _listed(groups, report["params"])
    # Heights in inches: the list, the axis labels, the axes, the title.
    text_h, below, axes_h, above = 0.14 * len(lines) + 0.15, 0.7, 3.4, 0.45
    height = text_h + below + axes_h + above
    fig = figure_cls(figsize=(11, height), dpi=100)
    canvas_cls(fig)
    ax = fig.add_axes((0.07, (text_h + below) / height, 0.64, axes_h / height))

    if points:
        what = "measured peak per step" if span == 1 else f"largest measured peak of every {span} steps"
        style = "o-" if len(points) <= 200 else "-"  # a marker per point while they stay apart
        ax.plot([p[0] for p in points], [p[1] / unit for p in points], style, color="tab:blue", ms=3, label=what)
    else:
        ax.text(0.5, 0.5, _why_no_peaks(report), transform=ax.transAxes, ha="center", va="center", wrap=True)
    ax.axhline(usable / unit, color="tab:green", ls="--", label="usable device memory (the plan's budget)")
    ax.axhline(total / unit, color="black", ls=":", label="device memory (the card, or its cap)")
    if peaks.get("max_allocated_bytes") is not None:
        ax.axhline(
            peaks["max_allocated_bytes"] / unit,
            color="tab:cyan",
            ls="-.",
            lw=0.8,
            label="torch.cuda.max_memory_allocated()",
        )
    last = max([peaks["steps"], 1] + [p[0] for p in points] + [step + 1 for step, _, _ in moves])
    numbered_at = None
    for number, (step, entries) in enumerate(groups.items(), 1):
        x = step + 0.5  # after `step` steps: between two steps' peaks
        kind = next((k for k in KIND_COLOR if any(k == e[0] for e in entries)), None)  # the weightiest
        ax.axvline(x, color=KIND_COLOR.get(kind, "tab:gray"), lw=1, alpha=0.7)
        # A number only where it has room; the list names every step.
        if numbered_at is None or x - numbered_at >= last / 50:
            ax.annotate(str(number), (x, 1.0), xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize=8)
            numbered_at = x
    switch = next((step for step, kind, _ in moves if kind == "switch"), None)
    if switch is not None and report["mode"] == "stock":
        ax.axvspan(switch + 0.5, last + 0.5, color="tab:red", alpha=0.08, label="stock training (no per-step peaks)")
    ax.set_xlim(0, last + 0.5)
    ax.set_ylim(0, max(1.08 * largest / unit, 1.0))  # room above the highest line
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"device memory ({unit_name})")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    if title is None:
        title = f"TrainStream memory: {report['mode']} mode on {report['plan']['device']}, {peaks['steps']} steps"
    fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")  # above the moves' numbers
    fig.text(0.02, text_h / height, "\n".join(lines), fontsize=8, va="top", family="monospace")
    fig.savefig(target, format="png")


def _listed(groups: dict, params: dict) -> list:
    """The lines under the plot: each numbered step's moves, then the placement now."""
    lines = []
    for number, (step, entries) in enumerate(groups.items(), 1):
        lead = f"{number}. after step {step}: "
        lines += [(lead if j == 0 else " " * len(lead)) + label for j, (_, label) in enumerate(entries)]
    if len(lines) > MAX_LISTED:
        lines = lines[:MAX_LISTED] + [f"... {len(lines) - MAX_LISTED} more lines: memory_report()['plan']['history']"]
    lines.append(
        f"now: weights paged for blocks {_ranges(params['paged_blocks']) or 'none'}, activations paged for "
        f"blocks {_ranges(params['activation_paged_blocks']) or 'none'}"
    )
    return lines


def _why_no_peaks(report) -> str:
    if report["peaks"]["steps"] == 0:
        return "no step taken yet: no peak measured"
    if report["plan"]["device"].startswith("cpu"):
        return "no device peak measured: the CPU backend has no device memory counter"
    return "no device peak measured by the engine's steps"


def _human(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
