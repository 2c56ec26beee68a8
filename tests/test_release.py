"""Release engineering: one version source and the tag check, the declared torch bound against
CI, the wheel and publish workflows, the CUDA-major check of every CMake build, and the messages
of trainstream._native (load failure, builds without kernels, the driver gate) as pure functions
of injected versions."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainstream
from trainstream import _distribution, _native
from trainstream._distribution import Installed

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_version = _load_tool("check_version")


def _workflow(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _on(workflow: dict) -> dict:
    # PyYAML reads the key `on` as the boolean True (YAML 1.1).
    return workflow.get("on", workflow.get(True))


# --- one version source -------------------------------------------------------------------


def test_the_version_is_read_from_version_py_only():
    project = PYPROJECT["project"]
    assert "version" not in project
    assert "version" in project["dynamic"]
    provider = PYPROJECT["tool"]["scikit-build"]["metadata"]["version"]
    assert provider == {"provider": "scikit_build_core.metadata.regex", "input": "src/trainstream/_version.py"}


def test_the_tag_check_reads_the_version_the_package_has():
    assert check_version.read_version() == trainstream.__version__


def test_the_installed_metadata_carries_the_same_version():
    ours = [d for d in _distribution.installed() if d.ours]
    if not ours:
        pytest.skip("trainstream is imported from a checkout, not an installed distribution")
    assert importlib.metadata.version(ours[0].name) == trainstream.__version__


def test_read_version_takes_the_first_assignment(tmp_path):
    path = tmp_path / "_version.py"
    path.write_text('"""doc"""\n\n__version__ = "1.2.3rc1"\n')
    assert check_version.read_version(path) == "1.2.3rc1"
    path.write_text("VERSION_LIST = [1]\n")
    with pytest.raises(ValueError, match="no __version__"):
        check_version.read_version(path)


@pytest.mark.parametrize(
    "tag, ok",
    [("v1.2.0", True), ("refs/tags/v1.2.0", True), ("1.2.0", False), ("v1.2", False), ("v1.2.0.post1", False)],
)
def test_the_tag_must_be_v_and_the_version_as_written(tag, ok):
    problems = check_version.tag_problems(tag, "1.2.0")
    assert (problems == []) is ok, problems
    if not ok:
        assert "expected tag 'v1.2.0'" in problems[0]


def test_every_file_must_carry_the_version_and_each_distribution_its_wheels_and_one_sdist():
    files = [
        Path("trainstream_cu130-1.2.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"),
        Path("trainstream_cu130-1.2.0.tar.gz"),
        Path("trainstream_cu128-1.2.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"),
        Path("trainstream_cu128-1.2.0.tar.gz"),
    ]
    expect = ["trainstream-cu130", "trainstream-cu128"]
    assert check_version.file_problems(files, "1.2.0", expect) == []

    stale = [Path("trainstream_cu130-1.1.0-cp312-cp312-manylinux_2_28_x86_64.whl")]
    problems = check_version.file_problems(files + stale, "1.2.0", expect)
    assert problems == [
        "trainstream_cu130-1.1.0-cp312-cp312-manylinux_2_28_x86_64.whl: version 1.1.0, but the package version is 1.2.0"
    ]

    problems = check_version.file_problems(files[:3] + [Path("notes.txt")], "1.2.0", expect)
    assert problems == [
        "notes.txt: neither a wheel nor an sdist",
        "trainstream-cu128: 0 sdists among the files, expected 1",
    ]

    problems = check_version.file_problems(files[2:], "1.2.0", expect)
    assert problems == [
        "trainstream-cu130: no wheel among the files",
        "trainstream-cu130: 0 sdists among the files, expected 1",
    ]


def test_the_tag_check_as_the_workflow_runs_it(tmp_path):
    script = ROOT / "tools" / "check_version.py"
    version = trainstream.__version__
    ok = subprocess.run([sys.executable, str(script), "--tag", f"v{version}"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    wheel = tmp_path / f"trainstream_cu130-{version}-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.touch()
    bad = subprocess.run(
        [sys.executable, str(script), "--tag", "v0.0.0", "--expect", "trainstream-cu130", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert f"tag 'v0.0.0' does not match the package version '{version}'" in bad.stderr
    assert "trainstream-cu130: 0 sdists among the files, expected 1" in bad.stderr


# --- the declared torch bound and the CI that keeps it true -----------------------------------


def _torch_lower_bound() -> str:
    (spec,) = [d for d in PYPROJECT["project"]["dependencies"] if re.match(r"torch\b", d)]
    match = re.fullmatch(r"torch>=([0-9.]+)", spec.replace(" ", ""))
    assert match, f"torch dependency {spec!r}: expected a plain lower bound"
    return match.group(1)


def test_ci_runs_the_suite_on_the_declared_lower_bound_and_on_the_newest_torch():
    from packaging.version import Version

    ci = _workflow("ci.yml")
    torches = [entry["torch"] for entry in ci["jobs"]["test"]["strategy"]["matrix"]["include"]]
    assert "newest" in torches
    oldest = [t for t in torches if t != "newest"]
    assert oldest and Version(min(oldest, key=Version)) == Version(_torch_lower_bound())
    assert "workflow_call" in _on(ci)  # the release calls it as its test gate


def test_the_lower_bound_torch_has_what_the_engine_calls():
    # The reason for the bound: torch 2.7 has no _top_saved_tensors_default_hooks.
    from packaging.version import Version

    if Version(torch.__version__.split("+")[0]) < Version(_torch_lower_bound()):
        pytest.fail(f"torch {torch.__version__} is older than the declared lower bound {_torch_lower_bound()}")
    assert callable(torch._C._autograd._top_saved_tensors_default_hooks)
    assert callable(torch._C._current_graph_task_id)


# --- wheels, sdists, publishing ---------------------------------------------------------------


def test_wheels_cover_the_pythons_the_messages_promise():
    identifiers = PYPROJECT["tool"]["cibuildwheel"]["build"].split()
    minors = sorted(int(re.fullmatch(r"cp3(\d+)-manylinux_x86_64", i).group(1)) for i in identifiers)
    assert minors == list(range(minors[0], minors[-1] + 1))
    assert minors[-1] >= 14
    assert PYPROJECT["project"]["requires-python"] == f">=3.{minors[0]}"
    assert f"CPython 3.{minors[0]} to 3.{minors[-1]} on Linux x86_64" in _native.WHEEL_PLATFORMS
    image = PYPROJECT["tool"]["cibuildwheel"]["manylinux-x86_64-image"]
    glibc = re.fullmatch(r"manylinux_(\d+)_(\d+)", image).groups()
    assert f"glibc {glibc[0]}.{glibc[1]} or newer" in _native.WHEEL_PLATFORMS


def test_the_workflow_builds_and_publishes_every_distribution_the_package_names():
    wheels = _workflow("wheels.yml")
    jobs = wheels["jobs"]
    dists = sorted(_distribution.DIST_FOR_CUDA_MAJOR.values())
    built = {entry["dist"]: entry["cuda_major"] for entry in jobs["build"]["strategy"]["matrix"]["include"]}
    assert sorted(built) == dists
    assert all(_distribution.cuda_major_of(d) == int(major) for d, major in built.items())
    assert sorted(jobs["sdist"]["strategy"]["matrix"]["dist"]) == dists
    check = " ".join(step.get("run", "") for step in jobs["dists"]["steps"])
    assert "tools/check_version.py" in check
    assert sorted(re.findall(r"--expect (\S+)", check)) == dists


def test_a_tag_publishes_after_the_tests_with_trusted_publishing():
    wheels = _workflow("wheels.yml")
    assert _on(wheels)["push"]["tags"] == ["v*"]
    jobs = wheels["jobs"]

    def upstream(job: str) -> set[str]:
        needs = jobs[job].get("needs", [])
        needs = [needs] if isinstance(needs, str) else needs
        return set(needs).union(*(upstream(n) for n in needs)) if needs else set()

    assert {"version", "tests", "build", "sdist", "gpu", "dists"} <= upstream("publish")
    assert jobs["tests"]["uses"] == "./.github/workflows/ci.yml"
    assert jobs["gpu"]["uses"] == "./.github/workflows/gpu.yml"
    version_step = " ".join(step.get("run", "") for step in jobs["version"]["steps"])
    assert 'tools/check_version.py --tag "$GITHUB_REF_NAME"' in version_step

    publish = jobs["publish"]
    assert publish["environment"]["name"] == "pypi"
    assert publish["permissions"] == {"id-token": "write"}
    assert any(step.get("uses", "").startswith("pypa/gh-action-pypi-publish@") for step in publish["steps"])
    assert "publish" in upstream("release")
    assert jobs["release"]["permissions"] == {"contents": "write"}
    assert "gh release create" in jobs["release"]["steps"][-1]["run"]
    for job in ("tests", "gpu", "dists", "publish", "release"):
        assert "refs/tags/" in jobs[job]["if"], job


def test_gpu_workflow_tests_an_installed_wheel():
    gpu = _workflow("gpu.yml")
    assert "wheels-run-id" in _on(gpu)["workflow_call"]["inputs"]
    runs = [step.get("run", "") for step in gpu["jobs"]["gpu"]["steps"]]
    installs = [r for r in runs if "pip install" in r and "--find-links wheelhouse" in r]
    assert installs, "the wheel is installed from wheelhouse"
    assert not any(re.search(r"pip install[^\n]*(\s-e\s|\s\.\s*$)", r, re.M) for r in runs), "no install of the tree"
    assert any("pytest tests -m gpu" in r for r in runs)
    assert any("trainstream.bench --quick" in r for r in runs)


def test_the_package_is_typed():
    assert (importlib.resources.files("trainstream") / "py.typed").is_file()
    assert "Typing :: Typed" in PYPROJECT["project"]["classifiers"]


# --- the CUDA-major check in every CMake build ------------------------------------------------


def _cmake_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not on PATH")
    script = tmp_path / "check.cmake"
    script.write_text(f'include("{(ROOT / "cmake" / "CudaMajor.cmake").as_posix()}")\n{body}\n')
    return subprocess.run([cmake, "-P", str(script)], capture_output=True, text=True)


@pytest.mark.parametrize(
    "name, explicit, nvcc, error",
    [
        ("trainstream_cu130", "", "13.0.88", None),
        (
            "trainstream-cu130",
            "",
            "12.8.93",
            "trainstream-cu130 is the distribution for CUDA 13, but the CUDA compiler",
        ),
        ("trainstream-cu128", "", "12.4.131", None),
        ("trainstream-cu128", "", "13.0.88", "is the distribution for CUDA 12"),
        ("trainstream-cu130", "12", "12.8.93", "TRAINSTREAM_EXPECT_CUDA_MAJOR=12, but the distribution"),
        ("trainstream", "", "12.8.93", None),  # a plain CMake build with nothing to expect
        ("trainstream", "13", "12.8.93", "is the distribution for CUDA 13"),
    ],
)
def test_cmake_refuses_an_nvcc_of_another_major_than_the_name(tmp_path, name, explicit, nvcc, error):
    result = _cmake_script(
        tmp_path,
        f'ts_expected_cuda_major(expected "{name}" "{explicit}")\nts_check_cuda_major("{name}" "${{expected}}" "{nvcc}")',
    )
    if error is None:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0
        assert error in re.sub(r"\s+", " ", result.stderr)


def test_cmakelists_checks_the_major_in_every_cuda_build():
    text = (ROOT / "CMakeLists.txt").read_text()
    enable = text.index("enable_language(CUDA)")
    check = text.index(
        'ts_check_cuda_major("${TS_DIST_NAME}" "${TS_EXPECT_CUDA_MAJOR}" "${CMAKE_CUDA_COMPILER_VERSION}")'
    )
    assert enable < check < text.index("set(TS_WITH_CUDA ON)")
    assert 'ts_expected_cuda_major(TS_EXPECT_CUDA_MAJOR "${TS_DIST_NAME}"' in text


# --- which distributions are installed --------------------------------------------------------


@pytest.mark.parametrize(
    "name, major",
    [("trainstream-cu130", 13), ("trainstream_cu128", 12), ("Trainstream-CU130", 13), ("trainstream", None)],
)
def test_cuda_major_of_a_distribution_name(name, major):
    assert _distribution.cuda_major_of(name) == major


@pytest.mark.parametrize(
    "cuda, dist", [("13.0", "trainstream-cu130"), ("12.4", "trainstream-cu128"), (None, None), ("11.8", None)]
)
def test_the_distribution_for_a_torch(cuda, dist):
    assert _distribution.dist_for_torch(cuda) == dist


def _fake_distribution(root: Path, name: str, version: str, package: str = "trainstream") -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{package}/__init__.py,,\n{info.name}/METADATA,,\n")


def test_installed_finds_an_unrelated_project_of_the_same_import_name(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "trainstream", "0.4.1")
    _fake_distribution(tmp_path, "elsewhere", "1.0", package="elsewhere")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = {d.name: d for d in _distribution.installed()}
    assert found["trainstream"] == Installed("trainstream", "0.4.1", direct=False)
    assert not found["trainstream"].ours
    assert "elsewhere" not in found


def test_python_m_trainstream_reports_the_unrelated_project(tmp_path):
    _fake_distribution(tmp_path, "trainstream", "0.4.1")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "trainstream"], capture_output=True, text=True, env=env, check=True)
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("distributions")]
    assert "CONFLICT: " in row and "trainstream 0.4.1" in row
    assert "an unrelated project that also installs a package named 'trainstream'" in row
    assert "pip uninstall -y trainstream" in row


CU128 = Installed("trainstream-cu128", "0.2.0", direct=False)
CU130 = Installed("trainstream-cu130", "0.2.0", direct=False)
OTHER = Installed("trainstream", "0.4.1", direct=False)


def test_conflict_needs_two_distributions():
    assert _distribution.conflict([], "trainstream-cu130") is None
    assert _distribution.conflict([CU130], "trainstream-cu130") is None


def test_conflict_of_both_cuda_majors_says_which_to_keep():
    text = _distribution.conflict([CU128, CU130], "trainstream-cu130")
    assert "only one TrainStream distribution (one CUDA major) can be installed at a time" in text
    assert text.endswith("pip uninstall -y trainstream-cu128 trainstream-cu130, then pip install trainstream-cu130.")


# --- the load-failure message -----------------------------------------------------------------

ERROR = ImportError("No module named 'trainstream._C'")


def test_load_failure_names_the_installed_and_the_needed_distribution():
    text = _native.load_failure_message(ERROR, [CU128], "2.14.1+cu130", "13.0", "/venv/bin/python")
    assert "could not be loaded: No module named 'trainstream._C'." in text
    assert "You have trainstream-cu128 0.2.0 (built for CUDA 12)" in text
    assert "torch 2.14.1+cu130 uses CUDA 13.0, so the distribution you need is trainstream-cu130" in text
    assert (
        "'/venv/bin/python -m pip uninstall -y trainstream-cu128 && /venv/bin/python -m pip install trainstream-cu130'"
        in text
    )


def test_load_failure_with_the_right_distribution_says_reinstall_it():
    text = _native.load_failure_message(ERROR, [CU128], "2.8.0+cu128", "12.8", "/py")
    assert "You have trainstream-cu128 0.2.0 (built for CUDA 12), the one for torch 2.8.0+cu128 (CUDA 12.8)" in text
    assert "'/py -m pip install --force-reinstall --no-deps trainstream-cu128'" in text
    assert "trainstream-cu130" not in text


def test_load_failure_on_a_cpu_torch_keeps_the_installed_distribution():
    text = _native.load_failure_message(ERROR, [CU128], "2.13.0+cpu", None, "/py")
    assert "You have trainstream-cu128 0.2.0" in text and "--force-reinstall --no-deps trainstream-cu128" in text
    assert "trainstream-cu130" not in text


def test_load_failure_without_a_distribution_is_a_checkout():
    text = _native.load_failure_message(ERROR, [], "2.14.1+cu130", "13.0", "/py")
    assert "No TrainStream distribution is installed for this Python (/py)" in text
    assert "'/py -m pip install trainstream-cu130'" in text and "'/py -m pip install .'" in text


def test_load_failure_with_the_unrelated_project_says_so_first():
    text = _native.load_failure_message(ERROR, [OTHER, CU130], "2.14.1+cu130", "13.0", "/py")
    assert "trainstream 0.4.1, trainstream-cu130 0.2.0 are installed together and overwrite each other's files" in text
    assert "pip uninstall -y trainstream trainstream-cu130, then pip install trainstream-cu130." in text


def test_lib_builds_the_message_from_what_is_installed(monkeypatch):
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_import_error", ERROR)
    monkeypatch.setattr(_distribution, "installed", lambda: [CU128])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(
        RuntimeError, match=r"You have trainstream-cu128 .* the distribution you need is trainstream-cu130"
    ):
        _native.lib()


# --- a build without kernels (the sdist built without nvcc) -----------------------------------


def test_an_sdist_built_without_nvcc_says_what_happened_and_the_ways_out():
    text = _native.no_kernels_message("X", [CU130], "13.0")
    assert text.startswith("X needs a CUDA GPU, but this trainstream build has no CUDA kernels: ")
    assert "pip found no trainstream-cu130 0.2.0 wheel for this platform and Python" in text
    assert "built the source distribution on this machine, which has no CUDA compiler (nvcc)" in text
    assert f"Wheels exist for {_native.WHEEL_PLATFORMS}" in text
    assert "the CUDA 13.x toolkit" in text
    assert "'pip install --force-reinstall --no-cache-dir --no-binary trainstream-cu130 trainstream-cu130'" in text
    assert "or install on a platform that has wheels" in text
    assert "'pip install trainstream-cu130'" not in text  # the thing the user just did


def test_an_sdist_build_of_the_other_major_names_the_one_to_install():
    text = _native.no_kernels_message("X", [CU128], "13.0")
    assert "the CUDA 12.x toolkit" in text
    assert "the distribution to install is trainstream-cu130, not trainstream-cu128" in text


def test_a_local_build_without_nvcc_says_install_the_wheel_or_rebuild():
    local = Installed("trainstream-cu130", "0.2.0", direct=True)
    text = _native.no_kernels_message("X", [local], "12.8")
    assert (
        "(it was built without nvcc). Install the wheel for your torch's CUDA ('pip install trainstream-cu128')" in text
    )


def test_require_cuda_on_an_sdist_build_without_kernels(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_native, "build_info", lambda: {"cuda": False})
    monkeypatch.setattr(_distribution, "installed", lambda: [CU130])
    with pytest.raises(RuntimeError, match="built the source distribution on this machine"):
        _native.require_cuda("X")


# --- the driver gate --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "driver, runtime",
    [(12040, 12080), (12080, 12080), (13020, 13000), (13000, 12080), (0, 13000)],
    ids=["12.4 driver, 12.8 build", "same", "newer minor", "newer major", "no driver"],
)
def test_a_driver_of_the_builds_major_is_accepted(driver, runtime):
    assert _native.driver_refusal(driver, runtime) is None


def test_a_driver_of_an_older_major_is_refused_with_the_ways_out():
    text = _native.driver_refusal(12080, 13000)
    assert text.startswith("the NVIDIA driver supports CUDA 12.8, but this build was compiled with CUDA 13.0")
    assert "needs a driver of CUDA 13.x (on Linux 580 or newer)" in text
    assert "only cannot JIT-compile PTX newer than itself" in text
    assert text.endswith("Update the driver, or use torch and trainstream built for CUDA 12 (trainstream-cu128).")


WHEEL_ARCHS = "75-real 80-real 86-real 89-real 90-real 100-real 103-real 120-real 121"


@pytest.mark.parametrize(
    "capability, archs, expected",
    [
        ((9, 0), WHEEL_ARCHS, True),
        ((8, 7), WHEEL_ARCHS, True),  # sm_86 code runs on sm_87
        ((12, 1), WHEEL_ARCHS, True),
        ((7, 0), WHEEL_ARCHS, False),
        ((13, 0), WHEEL_ARCHS, False),  # a GPU newer than the build: PTX only
        ((8, 0), "86-real", False),
        ((9, 0), "90a-real", True),
        ((9, 1), "90a-real", False),  # arch-specific code runs on its own GPU only
        ((10, 3), "100f", True),
        ((9, 0), "90-virtual", False),
        ((9, 0), "native", None),
    ],
)
def test_has_sass(capability, archs, expected):
    assert _native.has_sass(capability, archs) is expected


def test_an_older_minor_is_refused_only_where_ptx_must_be_jit_compiled():
    assert _native.ptx_refusal(13000, 13010, [(9, 0), (12, 0)], WHEEL_ARCHS) is None
    assert _native.ptx_refusal(13010, 13010, [(13, 0)], WHEEL_ARCHS) is None
    assert _native.ptx_refusal(13000, 13010, [(9, 0)], "native") is None
    text = _native.ptx_refusal(13000, 13010, [(9, 0), (13, 0)], WHEEL_ARCHS)
    assert f"this build ({WHEEL_ARCHS}) has no kernels compiled for sm_130" in text
    assert "the NVIDIA driver supports CUDA 13.0 and cannot load PTX newer than that" in text
    assert text.endswith("Update the driver to CUDA 13.1 or newer.")


def test_driver_summary_says_what_an_older_minor_cannot_do():
    assert _native.driver_summary(0, 13000) == "no driver"
    assert _native.driver_summary(13000, 13000) == "13.0"
    assert "cannot JIT-compile its PTX for newer GPUs" in _native.driver_summary(13000, 13010)
    assert _native.driver_summary(12080, 13000).startswith("12.8: the NVIDIA driver supports CUDA 12.8")


class _FakeNative:
    def __init__(self, driver: int, runtime: int):
        self.info = {"driver_version": driver, "runtime_version": runtime, "device_count": 1, "error": ""}

    def cuda_info(self):
        return self.info


def _gpu_machine(monkeypatch, torch_cuda, build_cuda, driver, runtime, capability, archs=WHEEL_ARCHS):
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(_native, "lib", lambda: _FakeNative(driver, runtime))
    monkeypatch.setattr(_native, "build_info", lambda: {"cuda": True, "cuda_version": build_cuda, "cuda_archs": archs})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)


def test_require_cuda_accepts_an_older_minor_driver(monkeypatch):
    # trainstream-cu128 on the 12.4 driver that runs torch cu124.
    _gpu_machine(monkeypatch, "12.4", "12.8.93", driver=12040, runtime=12080, capability=(9, 0))
    _native.require_cuda("X")


def test_require_cuda_refuses_an_older_major_driver(monkeypatch):
    _gpu_machine(monkeypatch, "13.0", "13.0.88", driver=12080, runtime=13000, capability=(9, 0))
    with pytest.raises(
        RuntimeError, match=r"X: the NVIDIA driver supports CUDA 12\.8, .* needs a driver of CUDA 13\.x"
    ):
        _native.require_cuda("X")


def test_require_cuda_refuses_an_older_minor_driver_for_ptx(monkeypatch):
    _gpu_machine(monkeypatch, "13.1", "13.1.80", driver=13000, runtime=13010, capability=(13, 0))
    with pytest.raises(RuntimeError, match=r"X: this build .* has no kernels compiled for sm_130"):
        _native.require_cuda("X")


@pytest.mark.gpu
def test_the_real_driver_passes_the_gate():
    info = _native.lib().cuda_info()
    assert _native.driver_refusal(info["driver_version"], info["runtime_version"]) is None
    capabilities = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    archs = _native.build_info()["cuda_archs"]
    assert _native.ptx_refusal(info["driver_version"], info["runtime_version"], capabilities, archs) is None
