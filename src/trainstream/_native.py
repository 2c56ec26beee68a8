"""The one importer of the native module ``trainstream._C``.

Everything else asks for it through :func:`lib`, so a missing or mismatched build turns
into one clear error instead of an ImportError deep inside a training step, and
``import trainstream`` itself never fails for want of a GPU.

The messages are built by pure functions of what was found (versions, distributions, GPU
architectures), so each case is testable without the hardware that produces it.
"""

from __future__ import annotations

import re
import sys

from . import _distribution
from ._distribution import Installed, conflict, cuda_major_of, dist_for_torch

try:
    from . import _C as _module

    _import_error: BaseException | None = None
except ImportError as exc:  # a checkout that was never built, a wheel for another Python, overwritten files
    _module = None
    _import_error = exc

_DIST_FOR_MAJOR = _distribution.DIST_FOR_CUDA_MAJOR

# The oldest Linux driver of each CUDA major (CUDA's minor-version compatibility: any driver of
# the major runs a runtime of any minor of it).
MIN_LINUX_DRIVER = {12: "525.60.13", 13: "580"}

# Where the release workflow builds wheels ([tool.cibuildwheel] in pyproject.toml; a test checks
# that they agree). Anywhere else pip builds the source distribution.
WHEEL_PLATFORMS = "CPython 3.10 to 3.14 on Linux x86_64 with glibc 2.28 or newer"


def lib():
    """The native module, or a RuntimeError saying why it can't be loaded and the fix."""
    if _module is None:
        torch = sys.modules.get("torch")
        torch_version = torch.__version__ if torch is not None else None
        torch_cuda = torch.version.cuda if torch is not None else None
        raise RuntimeError(
            load_failure_message(_import_error, _distribution.installed(), torch_version, torch_cuda, sys.executable)
        )
    return _module


def load_failure_message(
    error: BaseException | None,
    dists: list[Installed],
    torch_version: str | None,
    torch_cuda: str | None,
    python: str,
) -> str:
    """Why trainstream._C failed to import, naming the distribution installed and the one torch needs."""
    head = f"trainstream's native module (trainstream._C) could not be loaded: {error}."
    need = dist_for_torch(torch_cuda)
    clash = conflict(dists, need)
    if clash is not None:
        return f"{head} {clash}"
    ours = [d for d in dists if d.ours]
    if not ours:
        choice = need or " or ".join(_DIST_FOR_MAJOR.values())
        return (
            f"{head} No TrainStream distribution is installed for this Python ({python}): this looks like a "
            f"source checkout that was never built. Install one with '{python} -m pip install {choice}', or "
            f"build the checkout with '{python} -m pip install .'."
        )
    have = ours[0]
    have_text = f"{have.name} {have.version} (built for CUDA {cuda_major_of(have.name)})"
    if need is not None and need != have.name:
        return (
            f"{head} You have {have_text}, but torch {torch_version} uses CUDA {torch_cuda}, so the distribution "
            f"you need is {need}: '{python} -m pip uninstall -y {have.name} && {python} -m pip install {need}'."
        )
    matches = f", the one for torch {torch_version} (CUDA {torch_cuda})" if need is not None else ""
    rebuild = " (or, from a checkout, 'pip install .')" if have.direct else ""
    return (
        f"{head} You have {have_text}{matches}, but its native module is missing or was built for another "
        f"Python: reinstall it with the Python that runs this program: "
        f"'{python} -m pip install --force-reinstall --no-deps {have.name}'{rebuild}."
    )


def no_kernels_message(feature: str, dists: list[Installed], torch_cuda: str) -> str:
    """The error for a build without CUDA kernels. A distribution that came from the index
    without kernels was built here from the sdist (every published wheel has them): say so,
    and the two ways out."""
    head = f"{feature} needs a CUDA GPU, but this trainstream build has no CUDA kernels"
    need = dist_for_torch(torch_cuda) or _DIST_FOR_MAJOR[max(_DIST_FOR_MAJOR)]
    ours = [d for d in dists if d.ours]
    if len(ours) == 1 and not ours[0].direct:
        have = ours[0]
        major = cuda_major_of(have.name)
        other = (
            f" (Your torch uses CUDA {torch_cuda}, so the distribution to install is {need}, not {have.name}.)"
            if need != have.name
            else ""
        )
        return (
            f"{head}: pip found no {have.name} {have.version} wheel for this platform and Python, so it built "
            f"the source distribution on this machine, which has no CUDA compiler (nvcc): the build is CPU-only "
            f"(the host AdamW works, the GPU paths do not). Wheels exist for {WHEEL_PLATFORMS}. Two ways out: "
            f"build it on a machine with the CUDA {major}.x toolkit (nvcc on PATH, or CUDACXX set): "
            f"'pip install --force-reinstall --no-cache-dir --no-binary {have.name} {have.name}' "
            f"(--no-cache-dir: pip would otherwise reuse the CPU-only wheel it cached); or install on a "
            f"platform that has wheels.{other}"
        )
    return (
        f"{head} (it was built without nvcc). Install the wheel for your torch's CUDA ('pip install {need}'), "
        "or rebuild with nvcc on PATH (from a checkout, SKBUILD_CMAKE_DEFINE=TRAINSTREAM_CUDA=ON makes "
        "'pip install .' fail rather than build without kernels)."
    )


def build_info() -> dict:
    """What the native module was built with (empty when it could not be loaded)."""
    return dict(_module.build_info) if _module is not None else {}


def wheel_cuda_major() -> int | None:
    info = build_info()
    if not info.get("cuda"):
        return None
    return int(str(info["cuda_version"]).split(".")[0])


def require_cuda(feature: str) -> None:
    """Raise RuntimeError naming exactly what stops `feature` from using the GPU, and the fix.

    Checked in the order a user would fix them: the torch build, the trainstream build,
    their CUDA majors, the driver, whether a GPU is visible at all, and whether the driver
    can load the kernels for each visible GPU.
    """
    import torch

    native = lib()
    torch_cuda = torch.version.cuda
    if torch_cuda is None:
        raise RuntimeError(
            f"{feature} needs a CUDA GPU, but torch {torch.__version__} is a CPU-only build. "
            "Install a CUDA build of torch, e.g. "
            "'pip install torch --index-url https://download.pytorch.org/whl/cu130'."
        )
    wheel_major = wheel_cuda_major()
    if wheel_major is None:
        raise RuntimeError(no_kernels_message(feature, _distribution.installed(), torch_cuda))
    torch_major = int(torch_cuda.split(".")[0])
    if torch_major != wheel_major:
        have = _DIST_FOR_MAJOR.get(wheel_major, "trainstream")
        need = _DIST_FOR_MAJOR.get(torch_major, "a trainstream wheel")
        raise RuntimeError(
            f"{feature}: this trainstream wheel ({have}) was built for CUDA {wheel_major}, but torch "
            f"{torch.__version__} uses CUDA {torch_cuda}. Install {need} to match torch "
            f"('pip uninstall -y {have} && pip install {need}'), or a torch built for CUDA {wheel_major}."
        )
    info = native.cuda_info()
    refusal = driver_refusal(info["driver_version"], info["runtime_version"])
    if refusal is not None:
        raise RuntimeError(f"{feature}: {refusal}")
    if not torch.cuda.is_available() or info["device_count"] == 0:
        reason = "no NVIDIA driver found" if not info["driver_version"] else (info["error"] or "no device reported")
        raise RuntimeError(
            f"{feature} needs a CUDA GPU, but none is visible ({reason}). Check nvidia-smi and CUDA_VISIBLE_DEVICES."
        )
    if info["driver_version"] < info["runtime_version"]:  # an older minor (checked on every GPU op: keep it cheap)
        capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        refusal = ptx_refusal(info["driver_version"], info["runtime_version"], capabilities, build_info()["cuda_archs"])
        if refusal is not None:
            raise RuntimeError(f"{feature}: {refusal}")


def driver_refusal(driver: int, runtime: int) -> str | None:
    """Why the driver cannot run this build at all, or None.

    Versions as CUDA reports them (13000 for 13.0); a driver of 0 (none found) is left to the
    visibility check. The CUDA runtime is linked statically, so CUDA's minor-version
    compatibility applies: any driver of the build's CUDA major runs it. What an older minor
    cannot do is load PTX newer than itself (see :func:`ptx_refusal`).
    """
    if not driver or driver // 1000 >= runtime // 1000:
        return None
    major, driver_major = runtime // 1000, driver // 1000
    other = _DIST_FOR_MAJOR.get(driver_major)
    alternative = f", or use torch and trainstream built for CUDA {driver_major} ({other})" if other else ""
    return (
        f"the NVIDIA driver supports CUDA {cuda_version_text(driver)}, but this build was compiled with CUDA "
        f"{cuda_version_text(runtime)} and needs a driver of CUDA {major}.x (on Linux {MIN_LINUX_DRIVER.get(major, 'a')} "
        f"or newer). Any CUDA {major} minor is enough: an older one runs the kernels compiled for your GPU and only "
        f"cannot JIT-compile PTX newer than itself. Update the driver{alternative}."
    )


def ptx_refusal(driver: int, runtime: int, capabilities: list[tuple[int, int]], archs: str) -> str | None:
    """Why an older-minor driver cannot run this build on these GPUs, or None.

    A GPU with no compiled kernels (SASS) in the build runs them JIT-compiled from the embedded
    PTX, and a driver loads only PTX of its own CUDA version or older.
    """
    if not driver or driver >= runtime:
        return None
    without = [cc for cc in capabilities if has_sass(cc, archs) is False]
    if not without:
        return None
    gpus = ", ".join(f"sm_{major}{minor}" for major, minor in without)
    return (
        f"this build ({archs}) has no kernels compiled for {gpus}, so they would be JIT-compiled from its PTX, "
        f"which is CUDA {cuda_version_text(runtime)} PTX; the NVIDIA driver supports CUDA "
        f"{cuda_version_text(driver)} and cannot load PTX newer than that. Update the driver to CUDA "
        f"{cuda_version_text(runtime)} or newer."
    )


def driver_summary(driver: int, runtime: int) -> str:
    """The driver's CUDA version for ``python -m trainstream``, with what an older minor cannot do."""
    if not driver:
        return "no driver"
    text = cuda_version_text(driver)
    refusal = driver_refusal(driver, runtime)
    if refusal is not None:
        return f"{text}: {refusal}"
    if driver < runtime:
        return (
            f"{text} (older than the CUDA {cuda_version_text(runtime)} of this build: it runs the kernels compiled for "
            "the build's architectures, but cannot JIT-compile its PTX for newer GPUs)"
        )
    return text


# One entry of a CMake CUDA_ARCHITECTURES list: 121, 90a-real, 100f-virtual, ...
_ARCH = re.compile(r"(\d+)([af]?)(?:-(real|virtual))?")


def has_sass(capability: tuple[int, int], archs: str) -> bool | None:
    """Whether the build has compiled kernels a GPU of this compute capability runs; None when
    the architecture list cannot be read (a CMake keyword such as 'all' or 'native').

    A cubin for X.y runs on X.z for z >= y; an arch-specific one ('90a') on X.y alone, a
    family one ('100f') on its major.
    """
    major, minor = capability
    found = False
    for entry in archs.split():
        match = _ARCH.fullmatch(entry)
        if match is None:
            return None
        if match.group(3) == "virtual":
            continue
        number, suffix = int(match.group(1)), match.group(2)
        arch_major, arch_minor = number // 10, number % 10
        if suffix == "a":
            found |= (arch_major, arch_minor) == (major, minor)
        else:
            found |= arch_major == major and arch_minor <= minor
    return found


def cuda_version_text(version: int) -> str:
    return f"{version // 1000}.{(version % 1000) // 10}"
