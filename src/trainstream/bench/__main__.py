"""python -m trainstream.bench [suite ...] [--quick] [--rows 1,3,9] [--out DIR] [--readme [FILE ...]]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import engine, hf, lora, loss, nonfinite, optimizer, optimizer_gpu, planner, quant, readme, workloads
from .common import env_line, environment, write_result

# suite name -> (needs a GPU, runner(args) -> result dict)
SUITES = {
    "optimizer": (
        False,
        lambda a: optimizer.run(
            params=a.params or (1 << 24 if a.quick else 1 << 28), threads=a.threads, iters=3 if a.quick else 9
        ),
    ),
    "quant": (False, lambda a: quant.run(threads=a.threads, quick=a.quick)),
    "optimizer_gpu": (
        True,
        lambda a: optimizer_gpu.run(params=a.params or (1 << 24 if a.quick else 1 << 28), iters=5 if a.quick else 10),
    ),
    "engine": (True, lambda a: engine.run(quick=a.quick)),
    "planner": (True, lambda a: planner.run(quick=a.quick)),
    "lora": (True, lambda a: lora.run(quick=a.quick)),
    "loss": (True, lambda a: loss.run(quick=a.quick)),
    "nonfinite": (True, lambda a: nonfinite.run(quick=a.quick)),
    "hf": (True, lambda a: hf.run(quick=a.quick, rows=a.rows, out_dir=a.out, env=a.env)),
    "workloads": (
        True,
        lambda a: workloads.run(quick=a.quick, rows=a.rows, runners=a.runners, out_dir=a.out, env=a.env),
    ),
}
# GPU suites whose --quick runs at toy sizes on the CPU too (what needs CUDA says it was skipped).
QUICK_ON_CPU = {"workloads"}
# Suites that run only when named: a full run of workloads takes several 10-minute calls (--rows).
NAMED_ONLY = {"workloads"}
DEFAULT = [s for s in SUITES if s not in NAMED_ONLY]
# Suites whose cases --rows selects (run alone): their parsers of the flag's value.
ROWS = {"workloads": workloads.parse_rows, "hf": hf.parse_rows}


def _argument(parse):
    """An argparse type from a parser that raises ValueError with its own message."""

    def typed(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return typed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainstream.bench", description=__doc__)
    parser.add_argument(
        "suites",
        nargs="*",
        help=f"suites to run: {', '.join(SUITES)} (default: all but {', '.join(sorted(NAMED_ONLY))})",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument(
        "--rows",
        default=None,
        help=f"workloads or hf suite, run alone: the rows to run, e.g. 1,3,9 (default: all; workloads: rows "
        f"{workloads.ROWS[0]}-{workloads.ROWS[-1]}, hf: rows {hf.ROWS[0]}-{hf.ROWS[-1]}); the others keep their results",
    )
    parser.add_argument(
        "--runners",
        type=_argument(workloads.parse_runners),
        default=None,
        help=f"workloads suite only: only these runners' cases of the rows, e.g. deepspeed,torchao "
        f"(the others keep their results); accepted: {', '.join(workloads.RUNNERS)}",
    )
    parser.add_argument("--params", type=int, default=None, help="parameters for the optimizer suite")
    parser.add_argument("--threads", type=int, default=None, help="host threads (default: all cores)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where results go")
    parser.add_argument(
        "--readme",
        nargs="*",
        type=Path,
        default=None,
        metavar="FILE",
        help="only rewrite the generated tables of README.md and docs/benchmarks.md (or of the FILEs "
        "given) from the results in --out",
    )
    args = parser.parse_args(argv)

    if args.readme is not None:
        for path in args.readme or readme.FILES:
            changed = readme.update(path, args.out)
            print(f"{'updated' if changed else 'unchanged'}: {path} from {args.out}")
        return 0
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; accepted: {list(SUITES)}")
    if args.rows is not None:
        if len(args.suites) != 1 or args.suites[0] not in ROWS:
            parser.error(
                f"--rows selects cases of the workloads suite (rows {workloads.ROWS[0]}-{workloads.ROWS[-1]}) or of "
                f"the hf suite (rows {hf.ROWS[0]}-{hf.ROWS[-1]}): run one of them alone (python -m trainstream.bench "
                "workloads --rows ..., python -m trainstream.bench hf --rows ...)"
            )
        try:
            args.rows = ROWS[args.suites[0]](args.rows)
        except ValueError as e:
            parser.error(str(e))
    if args.runners is not None and args.suites != ["workloads"]:
        parser.error(
            "--runners selects cases of the workloads suite: run it alone (python -m trainstream.bench workloads "
            "--runners ...)"
        )
    from .. import _native

    args.threads = args.threads or _native.lib().available_cores()
    has_gpu = torch.cuda.is_available()
    chosen = args.suites or DEFAULT
    if not has_gpu:
        gpu_suites = [s for s in chosen if SUITES[s][0] and not (args.quick and s in QUICK_ON_CPU)]
        print(
            "No GPU visible: running the CPU suites only"
            + (f" (skipping {', '.join(gpu_suites)})" if gpu_suites else "")
            + ".",
            flush=True,
        )
        chosen = [s for s in chosen if s not in gpu_suites]
    env = args.env = environment()
    print(env_line(env), flush=True)
    for name in chosen:
        print(f"[{name}]", flush=True)
        result = SUITES[name][1](args)
        path = write_result(args.out, name, env, result, result.pop("markdown"), quick=args.quick)
        print(path.with_suffix(".md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
