"""Which installed distributions provide the import package ``trainstream``, and which one torch needs.

TrainStream is published as one distribution per CUDA major (``trainstream-cu130``,
``trainstream-cu128``; see .github/workflows/wheels.yml), all installing the same package
directory. An unrelated project on the index is named ``trainstream`` and installs a package of
that name too. Any two of these in one environment overwrite each other's files, so the error
messages and ``python -m trainstream`` name what is installed.

Everything here reads package metadata only; nothing imports the native module.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

PACKAGE = "trainstream"

# The distribution built for each CUDA major. Keep in step with the matrix of wheels.yml
# (tests/test_release.py checks that they agree).
DIST_FOR_CUDA_MAJOR = {12: "trainstream-cu128", 13: "trainstream-cu130"}

_OURS = re.compile(r"trainstream-cu(\d+)\d")  # cuXYZ: CUDA X(.YZ); the last digit is the minor


@dataclass(frozen=True)
class Installed:
    name: str  # canonical: lower case, '-' separated
    version: str
    # Installed from a local path, a file or a VCS URL (pip writes direct_url.json for those);
    # False when it came from an index.
    direct: bool

    @property
    def ours(self) -> bool:
        return cuda_major_of(self.name) is not None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cuda_major_of(dist_name: str) -> int | None:
    """The CUDA major a TrainStream distribution is built for (trainstream-cu128 -> 12); None for others."""
    match = _OURS.fullmatch(canonical(dist_name))
    return int(match.group(1)) if match else None


def dist_for_torch(torch_cuda: str | None) -> str | None:
    """The distribution whose kernels match a torch built for CUDA ``torch_cuda`` ('13.0');
    None for a CPU-only torch (any of them serves the host path) or a CUDA major with no wheels."""
    if not torch_cuda:
        return None
    return DIST_FOR_CUDA_MAJOR.get(int(torch_cuda.split(".")[0]))


def installed() -> list[Installed]:
    """Every distribution in this environment that installs the package ``trainstream``: ours by
    name, any other by its file list (an editable install lists no .py files, so
    importlib.metadata.packages_distributions() misses it)."""
    found: dict[str, Installed] = {}
    for dist in importlib.metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if not name or name in found:
            continue  # the first on sys.path is the one imported
        if name != PACKAGE and cuda_major_of(name) is None and not _installs_package(dist):
            continue
        found[name] = Installed(name, dist.version, dist.read_text("direct_url.json") is not None)
    return sorted(found.values(), key=lambda d: d.name)


def _installs_package(dist: importlib.metadata.Distribution) -> bool:
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return PACKAGE in top_level.split()
    return any(len(f.parts) > 1 and f.parts[0] == PACKAGE for f in dist.files or ())


def conflict(dists: list[Installed], need: str | None) -> str | None:
    """What is wrong when more than one distribution installs ``trainstream``, and the fix; None
    when one or none does. ``need``: the distribution that matches torch (:func:`dist_for_torch`)."""
    if len(dists) < 2:
        return None
    ours = [d for d in dists if d.ours]
    others = [d for d in dists if not d.ours]
    names = ", ".join(f"{d.name} {d.version}" for d in dists)
    why = []
    if others:
        subject = " and ".join(d.name for d in others)
        what = (
            "is an unrelated project that also installs"
            if len(others) == 1
            else "are unrelated projects that also install"
        )
        why.append(f"{subject} {what} a package named 'trainstream'")
    if len(ours) > 1:
        why.append("only one TrainStream distribution (one CUDA major) can be installed at a time")
    if need is None:
        need = (
            ours[0].name
            if len(ours) == 1
            else " or ".join(DIST_FOR_CUDA_MAJOR.values()) + " (the one for your torch's CUDA)"
        )
    return (
        f"{names} are installed together and overwrite each other's files ({'; '.join(why)}). "
        f"Fix: pip uninstall -y {' '.join(d.name for d in dists)}, then pip install {need}."
    )
