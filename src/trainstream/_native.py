"""The one importer of the native module ``trainstream._C``.

Everything else asks for it through :func:`lib`, so a missing or mismatched build turns
into one clear error instead of an ImportError deep inside a training step, and
``import trainstream`` itself never fails for want of a GPU.
"""

from __future__ import annotations

import sys

try:
    from . import _C as _module

    _import_error: BaseException | None = None
except ImportError as exc:  # a checkout that was never built, or a wheel for another Python
    _module = None
    _import_error = exc


# The distribution built for each CUDA major (see .github/workflows/wheels.yml).
_DIST_FOR_MAJOR = {12: "trainstream-cu128", 13: "trainstream-cu130"}


def lib():
    """The native module, or a RuntimeError saying why it can't be loaded and the fix."""
    if _module is None:
        raise RuntimeError(
            "trainstream's native module (trainstream._C) could not be loaded: "
            f"{_import_error}. It is built when the package is installed: reinstall with "
            "'pip install trainstream-cu130' (or, from a checkout, 'pip install .'), using the "
            f"same Python that runs this program ({sys.executable})."
        )
    return _module


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
    their CUDA majors, the driver, and finally whether a GPU is visible at all.
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
        raise RuntimeError(
            f"{feature} needs a CUDA GPU, but this trainstream build has no CUDA kernels (it was "
            "built without nvcc). Install the wheel for your CUDA version "
            "('pip install trainstream-cu130' or 'trainstream-cu128'), or rebuild with nvcc on PATH."
        )
    torch_major = int(torch_cuda.split(".")[0])
    if torch_major != wheel_major:
        raise RuntimeError(
            f"{feature}: this trainstream wheel was built for CUDA {wheel_major}, but torch "
            f"{torch.__version__} uses CUDA {torch_cuda}. Install {_DIST_FOR_MAJOR.get(torch_major, 'a trainstream wheel')} "
            f"to match torch, or a torch built for CUDA {wheel_major}."
        )
    info = native.cuda_info()
    if info["driver_version"] and info["driver_version"] < info["runtime_version"]:
        raise RuntimeError(
            f"{feature}: the NVIDIA driver supports CUDA {_cuda_version_text(info['driver_version'])}, "
            f"older than the CUDA {_cuda_version_text(info['runtime_version'])} this wheel was built "
            "with. Update the driver."
        )
    if not torch.cuda.is_available() or info["device_count"] == 0:
        reason = "no NVIDIA driver found" if not info["driver_version"] else (info["error"] or "no device reported")
        raise RuntimeError(
            f"{feature} needs a CUDA GPU, but none is visible ({reason}). Check nvidia-smi and CUDA_VISIBLE_DEVICES."
        )


def _cuda_version_text(version: int) -> str:
    return f"{version // 1000}.{(version % 1000) // 10}"
