"""parallel_draws(): large CPU draws split over threads, values fixed by the seed alone."""

import hf_models
import pytest
import torch

from trainstream.integrations.huggingface import random_draws
from trainstream.integrations.huggingface.random_draws import parallel_draws


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(random_draws, "CHUNK", 1024)  # toy tensors still split into many chunks


def _drawn(seed: int, threads: int, n: int = 10_000) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        x = torch.empty(n)
        with parallel_draws():
            torch.nn.init.normal_(x, mean=0.0, std=1.0)
        return x
    finally:
        torch.set_num_threads(before)


def test_the_values_depend_on_the_seed_and_not_on_the_threads():
    assert torch.equal(_drawn(0, 1), _drawn(0, 2))
    assert torch.equal(_drawn(0, 2), _drawn(0, 2))
    assert not torch.equal(_drawn(0, 2), _drawn(1, 2))


def test_each_chunk_and_each_draw_has_its_own_stream():
    x = _drawn(0, 2, n=4 * 1024)
    chunks = x.view(4, 1024)
    for i in range(4):
        for j in range(i):
            assert not torch.equal(chunks[i], chunks[j])
    torch.manual_seed(0)
    a, b = torch.empty(4096), torch.empty(4096)
    with parallel_draws():
        a.normal_()
        b.normal_()
    assert not torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_distributions_are_the_ones_asked_for(dtype):
    torch.manual_seed(0)
    n = 200_000
    normal, init_normal, uniform, init_uniform = (torch.empty(n, dtype=dtype) for _ in range(4))
    with parallel_draws():
        normal.normal_(3.0, 0.5)  # positional mean and std
        torch.nn.init.normal_(init_normal, mean=-1.0, std=0.02)
        uniform.uniform_(-2.0, 5.0)
        torch.nn.init.uniform_(init_uniform, a=1.0, b=2.0)
    for x, mean, std in ((normal, 3.0, 0.5), (init_normal, -1.0, 0.02)):
        assert abs(x.float().mean().item() - mean) < 5 * std / n**0.5
        assert abs(x.float().std().item() / std - 1) < 0.01
    for x, low, high in ((uniform, -2.0, 5.0), (init_uniform, 1.0, 2.0)):
        assert low <= x.float().min().item() and x.float().max().item() <= high
        assert abs(x.float().mean().item() - (low + high) / 2) < 0.01 * (high - low)


def test_what_it_does_not_split_runs_as_torch_would():
    """A caller's generator, a small or non-contiguous tensor, an integer one: torch's own draw,
    from torch's own generator."""
    cases = [
        lambda g: torch.empty(100).normal_(generator=g),  # small
        lambda g: torch.empty(4096, 4).t().normal_(generator=g),  # not contiguous
        lambda g: torch.empty(8192).normal_(generator=torch.Generator().manual_seed(7)),  # the caller's
    ]
    for make in cases:
        torch.manual_seed(5)
        with parallel_draws():
            ours = make(None)
        torch.manual_seed(5)
        torch.randint(0, 2**62, (1,))  # what parallel_draws() takes of the default generator
        assert torch.equal(ours, make(None))
    with parallel_draws():
        ints = torch.zeros(8192, dtype=torch.int64).random_(0, 10)
    assert 0 <= ints.min() and ints.max() < 10


def test_a_draw_autograd_sees_is_torchs_own():
    """With grad enabled a tensor that requires grad is left to torch: a leaf is refused as
    torch refuses it, and a non-leaf's draw is recorded in the graph."""
    leaf = torch.nn.Parameter(torch.empty(8192))
    with parallel_draws(), pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.normal_()
    x = torch.ones(8192, requires_grad=True)
    with parallel_draws():
        y = x * 2
        y.normal_()
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))  # normal_'s gradient is zero, as torch's graph says


def test_the_draws_are_fixed_by_the_seed_before_a_random_load(tmp_path):
    pytest.importorskip("transformers")
    from trainstream.integrations.huggingface import load_model

    hf_models.config("llama").save_pretrained(tmp_path)
    loads = []
    for _ in range(2):
        torch.manual_seed(3)
        loads.append(load_model(str(tmp_path), quantize="none", random_weights=True, dtype=torch.float32))
    assert max(p.numel() for p in loads[0].parameters()) >= 2 * random_draws.CHUNK  # some draws were split
    for (name, a), (_, b) in zip(loads[0].named_parameters(), loads[1].named_parameters()):
        assert torch.equal(a, b), name
