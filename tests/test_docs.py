"""README.md and docs/benchmarks.md: their generated tables match the committed results, the
README stays short, and its relative links lead to files of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainstream.bench import readme

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("path", readme.FILES, ids=str)
def test_generated_tables_match_the_committed_results(path):
    text = (ROOT / path).read_text()
    expected = readme.render(text, readme.load(RESULTS))
    assert text == expected, (
        f"{path}: the generated tables differ from benchmarks/results/*.json; "
        f"run `{readme.COMMAND}` from the repository root and commit the result"
    )


def test_every_suite_with_results_has_its_tables_in_docs_benchmarks():
    suites = set(readme.load(RESULTS))
    assert suites, "no results committed under benchmarks/results"
    missing = suites - set(readme.markers(BENCHMARKS.read_text()))
    assert not missing, f"docs/benchmarks.md has no <!-- results:SUITE --> markers for {sorted(missing)}"


def test_readme_holds_the_summary_table():
    assert readme.markers(README.read_text()) == [readme.SUMMARY]
    assert "| GPU | commit |" in readme.render(README.read_text(), readme.load(RESULTS))


def test_summary_leaves_out_rows_without_one_step_time():
    env = {"gpu": "NVIDIA H200", "commit": "abcdef0"}
    rows = [
        {"run": "timed", "runner": "stock", "model": "3b", "s_per_step": 0.25},
        {"run": "medians by run", "runner": "interleaved", "model": "3b", "s_per_step_by_run": {"stock": 0.2}},
        {"run": "did not fit", "runner": "stock", "model": "3b", "oom": True},
    ]
    table = readme.summary({"lora": [{"env": env, "rows": rows}]})
    assert "timed" in table and "did not fit" in table
    assert "medians by run" not in table


def test_summary_holds_the_newest_gpu_machines_results_of_each_suite():
    rows = [{"run": "timed", "runner": "stock", "model": "3b", "s_per_step": 0.25}]
    older = {"env": {"gpu": "NVIDIA H200", "commit": "aaaaaaa", "date": "2026-12-02 00:43 UTC"}, "rows": rows}
    newer = {"env": {"gpu": "NVIDIA H100", "commit": "bbbbbbb", "date": "2026-12-07 22:43 UTC"}, "rows": rows}
    on_cpu = {"env": {"gpu": None, "commit": "ccccccc", "date": "2026-12-08 00:00 UTC"}, "rows": rows}
    for order in ([older, newer, on_cpu], [on_cpu, newer, older]):
        table = readme.summary({"lora": order})
        assert "bbbbbbb" in table and "aaaaaaa" not in table and "ccccccc" not in table


def test_readme_is_at_most_200_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines; at most 200 (details belong in docs/)"


def test_readme_relative_links_exist():
    broken = []
    for target in _LINK.findall(README.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in this file
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_readme_keeps_the_ci_test_command():
    command = 'python -m pip install ".[test]" && ruff check . && ruff format --check . && python -m pytest'
    assert command in README.read_text()
    assert command in (ROOT / ".ci" / "run").read_text()
