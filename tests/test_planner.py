"""The hardware profile: measured once, cached by machine, built by hand for simulations."""

from pathlib import Path

import pytest
import torch

from trainstream.planner import HardwareProfile, conservative_profile, profile_hardware
from trainstream.planner import profile as profile_mod


def test_measured_then_cached_then_forced(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    first = profile_hardware("cpu")
    assert first.source == "measured" and first.h2d_bytes_per_s > 0 and first.host_adamw_params_per_s > 0
    files = list(Path(tmp_path).glob("profile-*.json"))
    assert len(files) == 1
    second = profile_hardware("cpu")
    assert second.source == "cached"
    assert (second.h2d_bytes_per_s, second.host_adamw_params_per_s) == (
        first.h2d_bytes_per_s,
        first.host_adamw_params_per_s,
    )
    assert profile_hardware("cpu", force=True).source == "measured"


def test_a_damaged_or_foreign_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    profile_hardware("cpu")
    path = next(Path(tmp_path).glob("profile-*.json"))
    path.write_text("{not json")
    assert profile_hardware("cpu").source == "measured"
    path.write_text(
        '{"key": "another machine", "h2d_bytes_per_s": 1, "d2h_bytes_per_s": 1, '
        '"host_adamw_params_per_s": 1, "matmul_flops": 0}'
    )
    assert profile_hardware("cpu").source == "measured"


def test_free_memory_is_read_fresh_even_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    profile_hardware("cpu")
    total = profile_mod.ram_total_and_available()[0]  # part of the cache key: keep it
    monkeypatch.setattr(profile_mod, "ram_total_and_available", lambda: (total, 3 << 30))
    cached = profile_hardware("cpu")
    assert cached.source == "cached" and cached.ram_available_bytes == 3 << 30


def test_conservative_profile_uses_the_fixed_rates():
    p = conservative_profile("cpu")
    assert p.source == "conservative" and p.h2d_bytes_per_s == profile_mod.CONSERVATIVE_RATES["h2d_bytes_per_s"]
    assert p.ram_available_bytes > 0 and p.pinned_limit_bytes > 0


def test_built_by_hand_from_the_six_fields():
    p = HardwareProfile(
        vram_total_bytes=4 << 30,
        vram_free_bytes=4 << 30,
        ram_available_bytes=16 << 30,
        pinned_limit_bytes=8 << 30,
        h2d_bytes_per_s=12e9,
        d2h_bytes_per_s=12e9,
    )
    assert p.source == "given" and "4.0 GiB" in p.describe()
    with pytest.raises(TypeError):
        HardwareProfile(vram_total_bytes=1)  # the six memory and PCIe figures are required


@pytest.mark.gpu
def test_gpu_profile_measures_pcie_and_matmul(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    p = profile_hardware("cuda", force=True)
    assert p.h2d_bytes_per_s > 1e9 and p.d2h_bytes_per_s > 1e9 and p.matmul_flops > 1e12
    assert 0 < p.vram_free_bytes <= p.vram_total_bytes == torch.cuda.get_device_properties(0).total_memory


@pytest.mark.gpu
def test_gpu_profile_sees_a_per_process_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(4 * 2**30 / total)
    try:
        p = profile_hardware("cuda")
        assert p.vram_total_bytes <= 4 * 2**30 and p.vram_free_bytes <= 4 * 2**30
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
