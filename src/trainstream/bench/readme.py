"""Regenerate the README's result tables from benchmarks/results/*.md.

The README marks each table with `<!-- results:SUITE -->` ... `<!-- /results:SUITE -->`;
everything between the markers is replaced by the markdown files of that suite, one per
machine, newest GPU results first.
"""

from __future__ import annotations

import re
from pathlib import Path


def update(readme_path: Path, results_dir: Path) -> None:
    text = readme_path.read_text()

    def fill(match: re.Match) -> str:
        suite = match.group(1)
        files = sorted(results_dir.glob(f"{suite}-*.md"), key=lambda p: ("cpu-" in p.name, p.name))
        body = "\n\n".join(f.read_text().strip() for f in files) or "_No results committed yet._"
        return f"<!-- results:{suite} -->\n{body}\n<!-- /results:{suite} -->"

    new = re.sub(r"<!-- results:(\w+) -->.*?<!-- /results:\1 -->", fill, text, flags=re.S)
    readme_path.write_text(new)
