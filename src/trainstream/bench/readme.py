"""Write the generated parts of README.md and docs/benchmarks.md from benchmarks/results/*.json.

A generated part sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``, and
everything between the two markers is replaced; the text around them is left as written.

- NAME a suite (``engine``, ``lora``, ...): that suite's results, one section per machine
  (GPU machines first), each headed by the GPU, CPU, torch and commit it was measured with.
- NAME ``summary``: the README's short table, a few headline rows of the engine and lora
  suites, each with its GPU and commit.
- NAME ``workloads_summary``: one line per row of the workloads suite: TrainStream's first run,
  the fastest peer that fits under the row's cap, the ratio to the row's bound.

A suite's result that names a plot (``"plot"``: a PNG beside its JSON) shows it at the top of
its section, linked from docs/ (the only file with suite sections).

``python -m trainstream.bench --readme`` rewrites both files; tests/test_docs.py fails when the
committed files differ from what this module writes from the committed results.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .common import env_line, markdown_table

COMMAND = "python -m trainstream.bench --readme"
FILES = (Path("README.md"), Path("docs/benchmarks.md"))
SUMMARY = "summary"
WORKLOADS_SUMMARY = "workloads_summary"
PLOTS = "../benchmarks/results"  # benchmarks/results/ as docs/benchmarks.md links it

_MARKED = re.compile(r"<!-- results:(\w+) -->.*?<!-- /results:\1 -->", flags=re.S)

# The summary's rows: the engine suite's peers and TrainStream's runs (not the compute bound,
# which is no way to train; of torchao's two settings the one that, as TrainStream does, keeps
# the gradients out of VRAM), and every run of the lora suite's 3B model (its 7B rows are in
# docs/benchmarks.md).
_SUMMARY_RUNNERS = {"engine": ("stock", "torchao_grads", "trainstream")}
_SUMMARY_MODELS = {"lora": (None, "3b")}
# What the suites' models are (their definitions: bench/models.py and bench/lora.py).
_MODELS = {
    ("engine", "mlp"): "402M MLP",
    ("engine", "gpt"): "1.9B GPT",
    ("lora", None): "3B Llama, LoRA r=16",
    ("lora", "3b"): "3B Llama, LoRA r=16",
}


def load(results_dir: Path) -> dict[str, list[dict]]:
    """suite -> its committed results, one per machine: GPU machines first, then by file name.
    A quick run's results (smoke sizes) are never a table's."""
    payloads = [(json.loads(f.read_text()), f.name) for f in Path(results_dir).glob("*.json")]
    payloads = [(payload, name) for payload, name in payloads if not payload.get("quick")]
    results: dict[str, list[dict]] = {}
    for payload, _ in sorted(payloads, key=lambda pair: (not pair[0]["env"].get("gpu"), pair[1])):
        results.setdefault(payload["suite"], []).append(payload)
    return results


def suite_section(result: dict) -> str:
    """One machine's results of one suite, as benchmarks/results/SUITE-MACHINE.md holds them."""
    head = f"### {result['suite']} ({env_line(result['env'])})\n\n"
    if result.get("plot"):
        head += f"![{result['suite']}: s/step and peak VRAM of every run]({PLOTS}/{result['plot']})\n\n"
    return head + result["markdown"].strip()


def summary(results: dict[str, list[dict]]) -> str:
    """The README's table: of each suite, the newest GPU machine's results (docs/benchmarks.md
    holds every machine's; an older run's rows beside a newer one's would read as one run)."""
    rows = []
    for suite in ("engine", "lora"):
        on_gpus = [result for result in results.get(suite, []) if result["env"].get("gpu")]
        for result in sorted(on_gpus, key=lambda result: str(result["env"].get("date", "")))[-1:]:
            env = result["env"]
            for row in result["rows"]:
                if suite in _SUMMARY_RUNNERS and row.get("runner") not in _SUMMARY_RUNNERS[suite]:
                    continue
                if suite in _SUMMARY_MODELS and row.get("model") not in _SUMMARY_MODELS[suite]:
                    continue
                if not row.get("oom") and "s_per_step" not in row:
                    continue  # a row of per-run medians (the interleaved windows) has no single step time
                model = row.get("model")
                rows.append(
                    {
                        "model": _MODELS.get((suite, model), model),
                        "run": row["run"],
                        "cap": row.get("cap_GiB"),
                        "s": "out of memory" if row.get("oom") else row.get("s_per_step"),
                        "x": row.get("vs_stock"),
                        "peak": row.get("peak_GiB"),
                        "gpu": env["gpu"],
                        "commit": str(env["commit"])[:7],
                    }
                )
    if not rows:
        return "_No results committed yet._"
    columns = [
        ("model", "model"),
        ("run", "run"),
        ("cap", "VRAM cap GiB"),
        ("s", "s/step"),
        ("x", "x stock"),
        ("peak", "peak GiB"),
        ("gpu", "GPU"),
        ("commit", "commit"),
    ]
    return markdown_table(columns, rows)


def workloads_summary(results: dict[str, list[dict]]) -> str:
    """A line per row of the workloads suite (GPU machines): TrainStream's first run that
    trained, the fastest peer that fits under the row's cap, the ratio to the row's bound."""

    def trained(r):
        return "s_per_step" in r and not r.get("oom") and "error" not in r and not r.get("skipped")

    lines = []
    for result in results.get("workloads", []):
        if not result["env"].get("gpu") or result.get("quick"):
            continue
        for n in sorted({r["row"] for r in result["rows"]}):
            runs = [r for r in result["rows"] if r["row"] == n]
            ours = next((r for r in runs if r["runner"] in ("trainstream", "trainer_ours") and trained(r)), None)
            # the row's cap: that of our runs, else (none of ours in the row) any run's
            caps = {r.get("cap_GiB") for r in runs if r["runner"] in ("trainstream", "trainer_ours")}
            caps = caps or {r["cap_GiB"] for r in runs if r.get("cap_GiB") is not None}
            peers = [
                r
                for r in runs
                if r["runner"] not in ("trainstream", "trainer_ours", "compute") and r.get("cap_GiB") in caps
            ]
            fits = [r for r in peers if trained(r)]
            best = min(fits, key=lambda r: r["s_per_step"]) if fits else None
            lines.append(
                {
                    "row": n,
                    "workload": runs[0]["workload"],
                    "cap": max(caps, key=lambda c: c or 0) if caps else None,
                    "s": ours["s_per_step"] if ours else "did not train",
                    "peak": ours.get("peak_GiB") if ours else None,
                    "bound": ours.get("vs_bound") if ours else None,
                    "peer": f"{best['run']}: {best['s_per_step']:.3g}" if best else ("none fits" if peers else None),
                    "commit": str((ours or runs[0]).get("commit"))[:7],
                }
            )
    if not lines:
        return "_No results committed yet._"
    columns = [
        ("row", "row"),
        ("workload", "workload"),
        ("cap", "VRAM cap GiB"),
        ("s", "TrainStream s/step"),
        ("peak", "peak GiB"),
        ("bound", "x bound"),
        ("peer", "fastest peer that fits, s/step"),
        ("commit", "commit"),
    ]
    return markdown_table(columns, lines)


def render(text: str, results: dict[str, list[dict]]) -> str:
    """`text` with every generated part written again from `results`."""

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name == SUMMARY:
            body = summary(results)
        elif name == WORKLOADS_SUMMARY:
            body = workloads_summary(results)
        else:
            body = "\n\n".join(suite_section(r) for r in results.get(name, [])) or "_No results committed yet._"
        return f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->"

    return _MARKED.sub(fill, text)


def markers(text: str) -> list[str]:
    """The names of the generated parts in `text`, in order."""
    return [m.group(1) for m in _MARKED.finditer(text)]


def update(path: Path, results_dir: Path) -> bool:
    """Rewrite the generated parts of the file at `path`; whether anything changed."""
    path = Path(path)
    text = path.read_text()
    new = render(text, load(results_dir))
    if new != text:
        path.write_text(new)
    return new != text
