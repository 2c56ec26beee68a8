"""Host memory the planner plans against: the smallest of MemAvailable and what each memory
cgroup of the process leaves (v2 memory.max, v1 memory.limit_in_bytes), read from a
simulated /proc and /sys/fs/cgroup tree; the events say which one bound the plan."""

import sys

import pytest
import torch
from models import mlp

import trainstream
from trainstream.planner import profile
from trainstream.sizes import GiB, MiB

MACHINE_RAM, MACHINE_AVAILABLE = 64 * GiB, 60 * GiB


@pytest.fixture
def cgroups(tmp_path, monkeypatch):
    """A simulated machine of 64 GiB (60 available) and a cgroup tree to fill in: returns
    write(path, text) for files under the simulated /sys/fs/cgroup, and the /proc/self/cgroup
    file to write."""
    root = tmp_path / "sys-fs-cgroup"
    root.mkdir()
    proc = tmp_path / "proc-self-cgroup"
    monkeypatch.setattr(profile, "CGROUP_ROOT", root)
    monkeypatch.setattr(profile, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(profile, "ram_total_and_available", lambda: (MACHINE_RAM, MACHINE_AVAILABLE))

    def write(path: str, text) -> None:
        f = root / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"{text}\n")

    return write, proc


def test_a_v2_limit_on_a_parent_binds_its_child(cgroups):
    write, proc = cgroups
    proc.write_text("0::/job.slice/step_0\n")
    write("job.slice/memory.max", 4 * GiB)
    write("job.slice/memory.current", 1 * GiB)
    write("job.slice/memory.stat", f"anon 123\ninactive_file {GiB // 2}\nactive_file 7\n")
    write("job.slice/step_0/memory.max", "max")  # the step has no limit of its own
    write("job.slice/step_0/memory.current", 1 * GiB)
    memory = profile.host_memory()
    # Inactive file cache is dropped before the limit kills: it counts as available.
    assert memory.available == 4 * GiB - (GiB - GiB // 2)
    assert memory.total == 4 * GiB
    assert memory.bound_by.endswith("job.slice/memory.max")
    assert memory.total_bound_by.endswith("job.slice/memory.max")


def test_a_v1_memory_controller_limit(cgroups):
    write, proc = cgroups
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n")
    write("memory/docker/abc/memory.limit_in_bytes", 2 * GiB)
    write("memory/docker/abc/memory.usage_in_bytes", 512 * MiB)
    write("memory/docker/abc/memory.stat", "cache 5\ntotal_inactive_file 0\n")
    write("memory/memory.limit_in_bytes", 9223372036854771712)  # the root: v1's "no limit"
    memory = profile.host_memory()
    assert memory.available == 2 * GiB - 512 * MiB
    assert memory.total == 2 * GiB
    assert memory.bound_by.endswith("memory/docker/abc/memory.limit_in_bytes")


def test_inside_a_container_the_path_of_the_host_falls_back_to_the_root(cgroups):
    # A container sees the host's path in /proc/self/cgroup but has its own cgroup mounted
    # at /sys/fs/cgroup.
    write, proc = cgroups
    proc.write_text("0::/kubepods/pod1/container2\n")
    write("memory.max", 8 * GiB)
    write("memory.current", 3 * GiB)
    memory = profile.host_memory()
    assert memory.available == 5 * GiB
    assert memory.bound_by.endswith("sys-fs-cgroup/memory.max")


def test_no_limit_leaves_memavailable(cgroups):
    write, proc = cgroups
    proc.write_text("0::/user.slice\n")
    write("user.slice/memory.max", "max")
    write("user.slice/memory.current", 10 * GiB)
    assert profile.host_memory() == (MACHINE_RAM, MACHINE_AVAILABLE, "MemAvailable", "RAM")


def test_memavailable_binds_when_it_is_the_smaller(cgroups):
    write, proc = cgroups
    proc.write_text("0::/big\n")
    write("big/memory.max", 100 * GiB)
    write("big/memory.current", 1 * GiB)
    assert profile.host_memory() == (MACHINE_RAM, MACHINE_AVAILABLE, "MemAvailable", "RAM")


def test_a_cgroup_over_its_limit_leaves_nothing(cgroups):
    write, proc = cgroups
    proc.write_text("0::/full\n")
    write("full/memory.max", 1 * GiB)
    write("full/memory.current", 1 * GiB + 4096)
    assert profile.host_memory().available == 0


def test_without_cgroup_files_memavailable_is_all(cgroups):
    _, proc = cgroups  # /proc/self/cgroup not written: not Linux, or no cgroups mounted
    assert profile.cgroup_limits() == []
    assert profile.host_memory().available == MACHINE_AVAILABLE


def test_without_psutil_meminfo_is_read(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:    1 kB\nMemAvailable:    8192 kB\n")
    monkeypatch.setattr(profile, "PROC_MEMINFO", meminfo)
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    assert profile.ram_total_and_available() == (16384 * 1024, 8192 * 1024)


def test_psutil_gives_the_portable_figures_where_installed(monkeypatch):
    psutil = pytest.importorskip("psutil")
    vm = psutil.virtual_memory()
    total, available = profile.ram_total_and_available()
    assert total == vm.total
    assert abs(available - vm.available) < vm.total // 10  # read a moment apart


def test_the_profile_plans_against_the_cgroup_and_says_so(cgroups):
    write, proc = cgroups
    proc.write_text("0::/job\n")
    write("job/memory.max", 3 * GiB)
    write("job/memory.current", 1 * GiB)
    p = profile.conservative_profile("cpu")
    assert p.ram_available_bytes == 2 * GiB
    assert p.pinned_limit_bytes == 3 * GiB  # pinned pages are charged to the cgroup too
    assert p.vram_free_bytes == 2 * GiB  # the CPU backend's device is host memory
    assert "RAM 2.0 GiB available (the cgroup limit " in p.describe()
    assert p.ram_bound_by.endswith("job/memory.max")


def test_wrap_events_name_the_cgroup_and_a_model_over_it_does_not_fit(cgroups):
    write, proc = cgroups
    proc.write_text("0::/job\n")
    write("job/memory.max", 3 * GiB)
    write("job/memory.current", 1 * GiB)
    model, _ = trainstream.wrap(mlp(2, 16), device="cpu", offload=True, profile=False)
    events = trainstream.memory_report(model)["events"]
    assert "RAM 2.0 GiB available (the cgroup limit " in events
    assert "job/memory.max" in events
    # The same model in a cgroup with 64 KiB left: refused at wrap(), not killed later.
    write("job/memory.current", 3 * GiB - 64 * 1024)
    with pytest.raises(
        trainstream.DoesNotFit, match=r"host RAM: .*, available 0.00 GiB \(the cgroup limit .*job/memory.max\)"
    ):
        trainstream.wrap(mlp(2, 256), device="cpu", offload=True, profile=False)


@pytest.mark.gpu
def test_gpu_the_pinned_limit_is_the_cgroups_where_it_is_lower(cgroups):
    write, proc = cgroups
    proc.write_text("0::/job\n")
    write("job/memory.max", 3 * GiB)
    write("job/memory.current", 1 * GiB)
    p = profile.conservative_profile(torch.device("cuda", 0))
    assert p.ram_available_bytes == 2 * GiB
    assert p.pinned_limit_bytes == 3 * GiB  # pinned pages are charged to the cgroup
    assert p.pinned_bound_by.endswith("job/memory.max")
