"""Suite `planner`: wrap() with its defaults against stock training and hand-tuned settings.

- An 85M GPT that fits: stock fused AdamW against TrainStream's defaults (offload="auto"
  measures two steps, then switches to the same fused AdamW).
- The 1.9B GPT under VRAM caps of 24, 8 and 4 GiB (set_per_process_memory_fraction):
  the defaults against a few hand-picked settings for the same cap; the best of those is
  the reference the planner's choice is held to.
- The hardware profile: time of the first measurement and of a cached wrap-time lookup.

Every setting of the 1.9B GPT runs in its own process (the cap is per process, and nothing
one setting leaves behind can change another's memory). The two 85M runs share a process
and take their timed windows in turns, so that drift of the machine's speed over the run
cannot decide a 2% comparison.
"""

from __future__ import annotations

import copy
import gc
import json
import sys
import time

import torch

from ..sizes import GiB
from .common import cap_vram, case_in_subprocess, markdown_table, settle, timed_window, warm_up

BATCH, SEQ = 8, 512
FIXED = dict(offload=True)  # hand-tuned settings never switch
SETTINGS = {
    24: [
        dict(FIXED, param_offload=False, activation_offload=0.25),
        dict(FIXED, param_offload=0.25, activation_offload=False),
    ],
    8: [
        dict(FIXED, param_offload=True, activation_offload=0.5),
        dict(FIXED, param_offload=True, activation_offload=True),
    ],
    4: [dict(FIXED, param_offload=True, activation_offload=True)],
}


def _config(name: str):
    from .models import GPT_1_9B, GPTConfig

    return GPT_1_9B if name == "gpt-1.9b" else GPTConfig(dim=768, layers=12, heads=12, vocab=32000)


def _stepper(model, opt, batch):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _train(model, opt, batch, warmup: int, steps: int, windows: int = 1) -> dict:
    """Mean step time over `steps` steps, in `windows` timed windows; the median window is
    reported."""
    step = _stepper(model, opt, batch)
    warm_up(step, opt, warmup)
    means = []
    for _ in range(windows):
        mean, loss = timed_window(step, opt, steps)
        means.append(mean)
    return {
        "s_per_step": sorted(means)[len(means) // 2],
        "window_s_per_step": means,
        "peak_GiB": torch.cuda.max_memory_allocated() / GiB,
        "loss": loss.item(),
    }


def _start(setting, base):
    """The model and optimizer of one setting, and the seconds wrap() (or .cuda()) took."""
    import trainstream

    model = copy.deepcopy(base)
    t = time.perf_counter()
    if setting in ("stock", "stock copy"):
        model = model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = trainstream.wrap(model, opt, device="cuda", **setting)
    return model, opt, time.perf_counter() - t


def _report(model) -> dict:
    import trainstream

    if not hasattr(model, "_trainstream_engine"):
        return {}
    report = trainstream.memory_report(model)
    return dict(
        mode=report["mode"],
        paged_blocks=len(report["params"]["paged_blocks"]),
        activation_paged_blocks=len(report["params"]["activation_paged_blocks"]),
        moves=sum(1 for h in report["plan"]["history"] if h["kind"] == "applied"),
        history=[f"step {h['step']}: {h['message']}" for h in report["plan"]["history"]],
    )


def _interleaved(case: dict, base, batch) -> list:
    """Every setting alive at once, their timed windows taken in turns: a step of the 85M
    model is short, and the GPU's and host's speed drift between processes and over a run
    by more than the 2% compared. Each setting's peak is its own: what the others hold at
    rest is taken off."""
    runs = []
    for setting in case["settings"]:
        # A fresh peak for each wrap(): the adapter reads what the device's peak shows above
        # its own samples, and an earlier run's peak is not this one's.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        model, opt, wrap_s = _start(setting, base)
        step = _stepper(model, opt, batch)
        for _ in range(case["warmup"]):
            step()
        settle(opt)
        runs.append(
            dict(
                setting=setting,
                model=model,
                opt=opt,
                step=step,
                wrap_s=wrap_s,
                means=[],
                peak=0,
                rest=torch.cuda.memory_allocated() - held,
            )
        )
    total_rest = sum(r["rest"] for r in runs)
    for _ in range(case.get("windows", 1)):
        # One fixed cycle (A B C A B C ...): every window follows another setting's, the
        # same one each round. A reversed order every other round (A B C, C B A) would let A
        # and C follow themselves and B always follow a switch of model.
        for r in runs:
            torch.cuda.reset_peak_memory_stats()
            mean, r["loss"] = timed_window(r["step"], r["opt"], case["steps"])
            r["means"].append(mean)
            r["peak"] = max(r["peak"], torch.cuda.max_memory_allocated() - (total_rest - r["rest"]))
    return [
        dict(
            setting=r["setting"],
            wrap_s=r["wrap_s"],
            s_per_step=sorted(r["means"])[len(r["means"]) // 2],
            window_s_per_step=r["means"],
            peak_GiB=r["peak"] / GiB,
            loss=r["loss"].item(),
            **_report(r["model"]),
        )
        for r in runs
    ]


def run_sweep(case: dict) -> list:
    """One process: one model, one cap, every setting in `case["settings"]` (one after the
    other, or with `interleave` all at once, windows taken in turns)."""
    import trainstream

    from .models import GPT

    cap_vram(case.get("cap_gib"))
    cfg = _config(case["model"])
    torch.manual_seed(0)
    base = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (BATCH, SEQ), device="cuda")
    batch = (idx, torch.roll(idx, -1, 1))
    if case.get("interleave"):
        return _interleaved(case, base, batch)
    out = []
    for setting in case["settings"]:
        gc.collect()
        torch.cuda.empty_cache()
        print(
            "memory before wrap: mem_get_info",
            torch.cuda.mem_get_info(),
            "fraction",
            torch.cuda.get_per_process_memory_fraction(),
            "reserved",
            torch.cuda.memory_reserved(),
            "allocated",
            torch.cuda.memory_allocated(),
            "profile",
            trainstream.profile_hardware("cuda"),
            file=sys.stderr,
            flush=True,
        )
        row = {"setting": setting}
        model = opt = None
        try:
            model, opt, row["wrap_s"] = _start(setting, base)
            row.update(_train(model, opt, batch, case["warmup"], case["steps"], case.get("windows", 1)))
            row.update(_report(model))
        except torch.OutOfMemoryError as e:
            row.update(oom=True, error=str(e).split("\n")[0][:160])
            row.update(_report(model))  # the plan's history up to the failure (empty if wrap() failed)
        except MemoryError as e:  # wrap() refused: the setting cannot fit under this cap
            row.update(oom=True, error=str(e)[:300])
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del model
        opt = None
    return out


def _sweep_in_subprocess(case: dict) -> list:
    result, error = case_in_subprocess("trainstream.bench.planner", case)
    return result if error is None else [{"setting": s, "error": error} for s in case["settings"]]


def _profile_times() -> dict:
    """First measurement (forced) and a cached lookup, as wrap() does them."""
    from ..planner import profile_hardware

    t = time.perf_counter()
    profile_hardware("cuda", force=True)
    first = time.perf_counter() - t
    t = time.perf_counter()
    profile_hardware("cuda")
    return {"first_s": first, "cached_s": time.perf_counter() - t}


def _label(setting) -> str:
    if setting == "stock":
        return "stock: torch.optim.AdamW(fused=True)"
    if setting == "stock copy":
        return "stock again, a second copy (the comparison's noise floor)"
    if setting == {}:
        return "TrainStream defaults"
    return "hand-tuned " + ", ".join(f"{k}={v}" for k, v in setting.items() if k != "offload")


def run(*, quick: bool = False) -> dict:
    # The defaults settle in the first 3 steps and apply the last move at the 4th forward.
    steps = dict(warmup=5, steps=3 if quick else 10)
    rows = []
    # The 85M runs in one process, timed in turns (see _interleaved); a second stock copy
    # shows how far two identical runs differ in this comparison.
    for r in _sweep_in_subprocess(
        dict(
            model="gpt-85m",
            cap_gib=None,
            settings=["stock", {}, "stock copy"],
            warmup=4,
            steps=10 if quick else 20,
            windows=4 if quick else 20,
            interleave=True,
        )
    ):
        rows.append(dict(model="GPT 85M", cap_GiB=None, run=_label(r["setting"]), **r))
    for cap in (24, 8, 4):
        for setting in [{}] + SETTINGS[cap]:
            for r in _sweep_in_subprocess(dict(model="gpt-1.9b", cap_gib=cap, settings=[setting], **steps)):
                rows.append(dict(model="GPT 1.9B", cap_GiB=cap, run=_label(r["setting"]), **r))
    profile = _profile_times()

    def ok(r):
        return "s_per_step" in r and not r.get("oom")

    checks = []
    small = {r["setting"] if r["setting"] != {} else "defaults": r for r in rows if r["model"] == "GPT 85M" and ok(r)}

    def paired(a, b):
        # Each round's windows ran back to back: the median of their ratios cancels the
        # machine's drift between rounds, which the ratio of the two medians does not.
        ratios = sorted(x / y for x, y in zip(a["window_s_per_step"], b["window_s_per_step"]))
        return ratios[len(ratios) // 2], len(ratios)

    if "stock" in small and "defaults" in small:
        value, n = paired(small["defaults"], small["stock"])
        checks.append(
            dict(
                check=f"85M GPT: defaults (mode {small['defaults'].get('mode')}) / stock step time, "
                f"median of {n} paired windows",
                value=value,
                target="<= 1.02",
            )
        )
    if "stock" in small and "stock copy" in small:
        value, n = paired(small["stock copy"], small["stock"])
        checks.append(
            dict(
                check=f"85M GPT: a second stock copy / stock, median of {n} paired windows (how far "
                "two identical runs differ)",
                value=value,
                target="-",
            )
        )
    for cap in (24, 8, 4):
        mine = next((r for r in rows if r["cap_GiB"] == cap and r["setting"] == {}), None)
        tuned = [r for r in rows if r["cap_GiB"] == cap and r["setting"] != {} and ok(r)]
        if mine is None or not ok(mine):
            checks.append(dict(check=f"1.9B GPT, {cap} GiB cap: defaults train", value="no", target="yes"))
            continue
        checks.append(
            dict(check=f"1.9B GPT, {cap} GiB cap: defaults' peak GiB", value=mine["peak_GiB"], target=f"< {cap}")
        )
        if tuned:
            best = min(tuned, key=lambda r: r["s_per_step"])
            checks.append(
                dict(
                    check=f"1.9B GPT, {cap} GiB cap: defaults / best hand-tuned ({best['run']})",
                    value=mine["s_per_step"] / best["s_per_step"],
                    target="<= 1.10",
                )
            )
    checks.append(dict(check="profile: first measurement, s", value=profile["first_s"], target="<= 5"))
    checks.append(dict(check="profile: cached lookup, s", value=profile["cached_s"], target="<= 0.5"))
    table = markdown_table(
        [
            ("model", "model"),
            ("cap_GiB", "VRAM cap GiB"),
            ("run", "run"),
            ("s_per_step", "s/step"),
            ("peak_GiB", "peak GiB"),
            ("mode", "mode"),
            ("paged_blocks", "weights paged"),
            ("activation_paged_blocks", "activations paged"),
            ("moves", "plan moves"),
            ("wrap_s", "wrap s"),
            ("oom", "out of memory"),
        ],
        rows,
    )
    check_table = markdown_table([("check", "check"), ("value", "measured"), ("target", "target")], checks)
    return {"rows": rows, "checks": checks, "profile": profile, "markdown": table + "\n\n" + check_table}


if __name__ == "__main__":
    print(json.dumps(run_sweep(json.loads(sys.argv[1]))), flush=True)
