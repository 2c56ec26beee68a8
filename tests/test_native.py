"""Loading the native module, build information, and the GPU-availability errors."""

import subprocess
import sys

import pytest
import torch
from packaging.version import Version

import trainstream
from trainstream import _native


def test_version_and_build_info():
    # The version itself has one source, src/trainstream/_version.py (tests/test_release.py).
    assert str(Version(trainstream.__version__)) == trainstream.__version__
    info = _native.build_info()
    assert {"compiler", "cuda", "cuda_version", "cuda_archs"} <= set(info)
    if info["cuda"]:
        assert _native.wheel_cuda_major() == int(info["cuda_version"].split(".")[0])
        assert info["cuda_archs"]


def test_import_builds_nothing():
    # Nothing compiles at import (the previous generation JIT-compiled for ~18 s): a fresh
    # interpreter imports trainstream without pulling in torch's extension builder.
    code = "import sys, trainstream; print('torch.utils.cpp_extension' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_python_m_trainstream_prints_build_info():
    out = subprocess.run([sys.executable, "-m", "trainstream"], capture_output=True, text=True, check=True).stdout
    for key in ("trainstream", "CUDA (wheel built for)", "SIMD (host AdamW)", "torch", "GPU features"):
        assert key in out
    assert _native.lib().simd_level() in out


def test_missing_native_module_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_import_error", ImportError("No module named 'trainstream._C'"))
    with pytest.raises(RuntimeError, match=r"native module .* could not be loaded.*reinstall"):
        _native.lib()


def test_require_cuda_on_cpu_only_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(
        RuntimeError, match=r"X needs a CUDA GPU, but torch .* is a CPU-only build.*Install a CUDA build"
    ):
        _native.require_cuda("X")


def test_require_cuda_on_a_build_without_kernels(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_native, "build_info", lambda: {"cuda": False})
    with pytest.raises(RuntimeError, match=r"has no CUDA kernels.*trainstream-cu130"):
        _native.require_cuda("X")


def test_require_cuda_major_mismatch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(_native, "build_info", lambda: {"cuda": True, "cuda_version": "13.0.88"})
    with pytest.raises(
        RuntimeError, match=r"built for CUDA 13, but torch .* uses CUDA 12.8\. Install trainstream-cu128"
    ):
        _native.require_cuda("X")


def test_require_cuda_without_a_gpu(monkeypatch):
    if not _native.build_info().get("cuda"):
        pytest.skip("this build has no CUDA part")
    major = _native.wheel_cuda_major()
    monkeypatch.setattr(torch.version, "cuda", f"{major}.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"X needs a CUDA GPU, but none is visible"):
        _native.require_cuda("X")


@pytest.mark.gpu
def test_require_cuda_passes_on_a_gpu_machine():
    _native.require_cuda("X")
    info = _native.lib().cuda_info()
    assert info["device_count"] == torch.cuda.device_count()
    # CUDA's minor-version compatibility: a driver of the build's CUDA major is enough.
    assert info["driver_version"] // 1000 >= info["runtime_version"] // 1000


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_launch_on_another_device_leaves_the_current_device_as_it_was():
    from trainstream import ops

    torch.cuda.set_device(1)
    try:
        x = torch.randn(4096, device="cuda:0")
        codes, absmax = ops.quantize_nf4(x)
        ops.dequantize_nf4(codes, absmax, x.shape, dtype=torch.float32)
        found = torch.zeros(1, dtype=torch.int32, device="cuda:0")
        ops.mark_nonfinite_([x], found, torch.zeros((), dtype=torch.int32, device="cuda:0"))
        torch.cuda.synchronize(0)
        assert torch.cuda.current_device() == 1
    finally:
        torch.cuda.set_device(0)
