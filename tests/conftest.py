import random

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same seeds, so a failure reproduces."""
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _profile_cache(tmp_path_factory):
    """Hardware profiles measured by the tests are cached in a temporary directory, never in
    the user's home."""
    import os

    old = os.environ.get("TRAINSTREAM_CACHE_DIR")
    os.environ["TRAINSTREAM_CACHE_DIR"] = str(tmp_path_factory.mktemp("trainstream-cache"))
    yield
    if old is None:
        os.environ.pop("TRAINSTREAM_CACHE_DIR", None)
    else:
        os.environ["TRAINSTREAM_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _cpu_stands_in_for_the_gpu_optimizer(monkeypatch):
    """optimizer_mode="gpu" on the CPU backend runs the device update's moment layout with
    the host AdamW standing in for the kernel, so the suite covers that layout without a GPU;
    users get an error there (tests/test_fuzz.py checks it with this turned off)."""
    from trainstream import options

    monkeypatch.setattr(options, "CPU_STANDS_IN_FOR_GPU_OPTIMIZER", True)
