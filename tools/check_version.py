"""Refuse a release whose tag, package version and built files disagree.

    python tools/check_version.py --tag v0.2.0
    python tools/check_version.py --tag v0.2.0 --expect trainstream-cu130 --expect trainstream-cu128 dist/*

The version has one source, ``__version__`` in src/trainstream/_version.py, which
scikit-build-core reads into the metadata (pyproject.toml, [tool.scikit-build.metadata.version]).
The tag must be exactly ``v`` + that string, and every wheel and sdist given must carry it, so a
tag pushed on the wrong commit publishes nothing. With --expect, each named distribution must be
among the files with at least one wheel and exactly one sdist.

Exit status 0 when everything agrees, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

VERSION_FILE = Path(__file__).resolve().parent.parent / "src" / "trainstream" / "_version.py"

# The default pattern of scikit-build-core's regex version provider, so this reads what the build reads.
_VERSION = re.compile(r'(?i)^(__version__|VERSION)(?: ?\: ?str)? *= *([\'"])v?(?P<value>.+?)\2', re.MULTILINE)


def read_version(path: Path = VERSION_FILE) -> str:
    match = _VERSION.search(path.read_text(encoding="utf-8"))
    if match is None:
        raise ValueError(f"{path}: no __version__ = '...' line")
    return match.group("value")


def tag_problems(tag: str, version: str) -> list[str]:
    name = tag.removeprefix("refs/tags/")
    if name != f"v{version}":
        return [
            f"tag {name!r} does not match the package version {version!r} (src/trainstream/_version.py): expected tag 'v{version}'"
        ]
    return []


def file_problems(files: list[Path], version: str, expect: list[str]) -> list[str]:
    problems = []
    try:
        wanted = Version(version)
    except InvalidVersion:
        return [f"the package version {version!r} is not a valid PEP 440 version"]
    wheels: dict[str, int] = {}
    sdists: dict[str, int] = {}
    for path in files:
        filename = path.name
        try:
            if filename.endswith(".whl"):
                name, found, _, _ = parse_wheel_filename(filename)
                wheels[name] = wheels.get(name, 0) + 1
            elif filename.endswith(".tar.gz"):
                name, found = parse_sdist_filename(filename)
                sdists[name] = sdists.get(name, 0) + 1
            else:
                problems.append(f"{filename}: neither a wheel nor an sdist")
                continue
        except ValueError as exc:
            problems.append(f"{filename}: {exc}")
            continue
        if found != wanted:
            problems.append(f"{filename}: version {found}, but the package version is {version}")
    for dist in expect:
        name = canonicalize_name(dist)
        if not wheels.get(name):
            problems.append(f"{dist}: no wheel among the files")
        if sdists.get(name, 0) != 1:
            problems.append(f"{dist}: {sdists.get(name, 0)} sdists among the files, expected 1")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", required=True, help="the pushed tag, e.g. v0.2.0 (or refs/tags/v0.2.0)")
    parser.add_argument(
        "--expect", action="append", default=[], metavar="DIST", help="a distribution that must be among the files"
    )
    parser.add_argument("files", nargs="*", type=Path, help="wheels and sdists to check")
    args = parser.parse_args(argv)
    version = read_version()
    problems = tag_problems(args.tag, version) + file_problems(args.files, version, args.expect)
    for problem in problems:
        print(f"check_version: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_version: tag {args.tag}, version {version} and {len(args.files)} files agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
