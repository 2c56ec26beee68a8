"""What wrap() does to place the weights, at the cost it must: frozen weights quantized
straight into the host transfer memory (no copy of the codes), and the arena's pieces
pinned by a thread of its own while they are filled ([Note: pinning ahead] in
engine/device.py), with the same pieces and tensors as the arena that pins on demand, and
no thread left behind, whether wrap() succeeds or fails."""

import threading
import types

import pytest
import torch
from helpers import PAGED, assert_same_bits, machine_bytes
from models import tiny_gpt

import trainstream
from trainstream import options
from trainstream.api import _engine_of
from trainstream.engine.device import Backend, HostArena
from trainstream.engine.layout import arena_sizes
from trainstream.engine.moments import copy_limit, lay_out, region_limit
from trainstream.engine.placement import plan_run
from trainstream.ops import quant as qops
from trainstream.quant import QuantizedWeight

PINNER = "trainstream-arena-pinner"
CPU = Backend(torch.device("cpu"))


def _pinners() -> list:
    return [t for t in threading.enumerate() if t.name == PINNER]


def _frozen_gpt():
    torch.manual_seed(0)
    model, batch, loss_fn = tiny_gpt()
    for name, p in model.named_parameters():
        if name.startswith("layers.") and name.endswith(("qkv.weight", "fc.weight", "out.weight")):
            p.requires_grad_(False)
    return model, batch, loss_fn


def _wrap(model, **options):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return trainstream.wrap(model, opt, device="cpu", offload=True, **dict(PAGED, **options))


# -- quantized straight into the arena --------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_paged_frozen_weights_are_quantized_into_the_arena_itself(fmt, monkeypatch):
    model, _, _ = _frozen_gpt()
    originals = {p: p.detach().clone() for p in model.parameters() if not p.requires_grad}
    written = []  # codes addresses the quantizer wrote to
    run = qops._run

    def spy(dequantize, fmt_code, values, codes, absmax, block_size):
        if not dequantize:
            written.append(codes.data_ptr())
        return run(dequantize, fmt_code, values, codes, absmax, block_size)

    monkeypatch.setattr(qops, "_run", spy)
    model, _ = _wrap(model, quantize=fmt)
    engine = _engine_of(model)
    pieces = [(p.data_ptr(), p.data_ptr() + p.numel()) for p in engine.weights.arena.pieces]
    quantized = [s for u in engine.block_units for s in u.slots if s.quant is not None]
    assert quantized and all(u.paged for u in engine.block_units)
    for s in quantized:
        ptr = s.quant.codes.data_ptr()
        assert ptr in written, s.name  # the quantizer's own output, not a copy of it
        assert any(lo <= ptr < hi for lo, hi in pieces), s.name
        want = QuantizedWeight.quantize(originals[s.param], fmt)
        assert_same_bits(s.quant.codes, want.codes)
        assert_same_bits(s.quant.absmax, want.absmax)


# -- the arena pinning ahead ------------------------------------------------------------------------

# (numel, dtype) of the takes: sizes below, at and above a (shrunk) MAX_PIECE, so that tails,
# new pieces and a piece larger than MAX_PIECE all occur
TAKES = [(300, torch.float32), (17, torch.uint8), (1000, torch.bfloat16), (5000, torch.float32), (1, torch.int8)] * 4
TAKES += [(40_000, torch.uint8), (3, torch.float32), (2048, torch.float32)]


def _sizes(takes):
    return [HostArena.size_of(n, dtype) for n, dtype in takes]


def _carve(arena, takes):
    """Take every tensor: each as (piece index, byte offset in it, shape, dtype)."""
    out = []
    for n, dtype in takes:
        t = arena.take((n,), dtype)
        k = next(i for i, p in enumerate(arena.pieces) if p.data_ptr() <= t.data_ptr() < p.data_ptr() + p.numel())
        out.append((k, t.data_ptr() - arena.pieces[k].data_ptr(), tuple(t.shape), t.dtype))
    return out


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(HostArena, "MAX_PIECE", 8192)


def test_pinning_ahead_hands_out_the_pieces_and_tensors_of_the_arena_pinning_on_demand(small_pieces):
    total = sum(_sizes(TAKES))
    on_demand = HostArena(CPU, total)
    want = _carve(on_demand, TAKES)
    ahead = HostArena(CPU, total)
    with ahead.pinning_ahead(_sizes(TAKES)):
        got = _carve(ahead, TAKES)
    assert got == want
    assert [p.numel() for p in ahead.pieces] == [p.numel() for p in on_demand.pieces]
    assert [p.numel() for p in on_demand.pieces] == HostArena.piece_sizes(total, _sizes(TAKES))
    assert ahead.remaining == 0 and not _pinners()


def test_pieces_are_powers_of_two_doubling_at_most_unless_one_tensor_needs_more(small_pieces):
    total = sum(_sizes(TAKES))
    arena = HostArena(CPU, total)
    with arena.pinning_ahead(_sizes(TAKES)):
        carved = _carve(arena, TAKES)
    sizes = [p.numel() for p in arena.pieces]
    assert all(s & (s - 1) == 0 for s in sizes)
    assert max(sizes) == 1 << (40_000 - 1).bit_length()
    for k, size in enumerate(sizes):  # past the cap only as the power of two of a larger tensor
        opener = next(HostArena.size_of(shape[0], dtype) for i, _, shape, dtype in carved if i == k)
        cap = max(HostArena.MAX_PIECE, 2 * sizes[k - 1]) if k else HostArena.MAX_PIECE
        assert size <= cap or size == 1 << (opener - 1).bit_length(), k
    # waste only at a piece's tail, where the tensor that opened the next piece did not fit
    for k in range(len(sizes) - 1):
        end = max(offset + HostArena.size_of(shape[0], dtype) for i, offset, shape, dtype in carved if i == k)
        first_next = next(HostArena.size_of(shape[0], dtype) for i, _, shape, dtype in carved if i == k + 1)
        assert first_next > sizes[k] - end, k


def test_the_first_piece_is_at_most_max_piece_and_each_later_one_at_most_twice_the_last():
    # 3 GiB of 16 MiB tensors: a MAX_PIECE first (filling starts early), not one 2 GiB piece
    sizes = HostArena.piece_sizes(3 << 30, [16 << 20] * 192)
    m = HostArena.MAX_PIECE
    assert sizes == [m, 2 * m, 4 * m, 4 * m, m] and sum(sizes) == 3 << 30


def _slot(shape, dtype, trainable, quant_format=None):
    param = torch.empty(shape, dtype=dtype, device="meta")
    return types.SimpleNamespace(
        param=param,
        dtype=dtype,
        trainable=trainable,
        device_state=False,
        quant_format=quant_format,
        quant_block=64,
        is_linear=len(shape) == 2,
        shard=None,  # one process: no data-parallel shard
    )


def _llama7b_units(dtype, trainable, quant_format=None):
    """Llama-2-7B's parameters as the pager's units, every block paged: the embedding, 32
    blocks (4 attention projections, 3 MLP projections, 2 norms), the final norm, the head."""
    h, m, v = 4096, 11008, 32000

    def unit(shapes, paged, quantized):
        slots = [_slot(s, dtype, trainable, quant_format if quantized and len(s) == 2 else None) for s in shapes]
        return types.SimpleNamespace(slots=slots, trainable=[s for s in slots if s.trainable], paged=paged)

    block = [(h, h)] * 4 + [(m, h), (m, h), (h, m)] + [(h,), (h,)]
    return (
        [unit([(v, h)], False, False)]
        + [unit(block, True, True) for _ in range(32)]
        + [unit([(h,), (v, h)], False, False)]
    )


def _moment_takes(units):
    """The device update arena's takes for `units` (moments.lay_out at 1 GiB in flight)."""
    takes = []

    def record(shape, dtype):
        takes.append(HostArena.size_of(shape[0], dtype))
        return torch.empty(shape, dtype=dtype, device="meta")

    lay_out(units, torch.float32, region_limit(1 << 30), copy_limit(1 << 30), record)
    return takes


@pytest.mark.parametrize(
    "layout",
    ["full fine-tune bf16", "frozen bf16 paged", "nf4 codes paged", "gpu-mode moments"],
)
def test_a_7b_layouts_pieces_pin_at_most_5_percent_more_than_it_needs(layout):
    # Pieces capped at MAX_PIECE each abandoned a tail of up to 172 MiB (an MLP master) per
    # piece: 66 GiB pinned for the full fine-tune's 50.2
    if layout == "full fine-tune bf16":
        takes = arena_sizes(_llama7b_units(torch.bfloat16, True))  # master, stage, copy
    elif layout == "frozen bf16 paged":
        takes = arena_sizes([u for u in _llama7b_units(torch.bfloat16, False) if u.paged])
    elif layout == "nf4 codes paged":
        takes = arena_sizes([u for u in _llama7b_units(torch.bfloat16, False, "nf4") if u.paged])
    else:
        takes = _moment_takes(_llama7b_units(torch.bfloat16, True))
    need = sum(takes)
    assert need > 3 << 30  # the layouts are the 7B's: 50.2, 12.6, 3.4 and 50.2 GiB
    pinned = HostArena.pinned_for(takes)
    assert need <= pinned <= 1.05 * need, (pinned / 2**30, need / 2**30)
    arena = HostArena(types.SimpleNamespace(is_cuda=False, host_empty=_meta_empty), need)
    for n in takes:
        arena.take((n,), torch.uint8)
    assert arena.reserved == pinned  # take() follows the rule pinned_for counts


def _meta_empty(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _plan_layout():
    """A ModelLayout of meta tensors: 4 blocks of a 1024x1024 weight and a bias, a head."""
    from trainstream.engine.layout import ModelLayout, Slot, Unit

    def slot(name, shape):
        return Slot(torch.nn.Parameter(torch.empty(shape, device="meta")), name, torch.float32, True, True)

    blocks = [
        Unit(f"block {i}", i, [slot(f"l{i}.weight", (1024, 1024)), slot(f"l{i}.bias", (1024,))]) for i in range(4)
    ]
    head = Unit("head", None, [slot("head.weight", (1024, 1024))])
    for u in [*blocks, head]:
        for s in u.slots:
            s.unit = u
    return ModelLayout(blocks, [head], [], [], [], 0)


def _plan_on(is_cuda, pinned_bytes):
    backend = Backend(torch.device("cpu"))
    backend.is_cuda = is_cuda  # the planner reads only this of the backend here
    layout = _plan_layout()
    opts = options.parse(dict(param_offload=True, activation_offload=False, moment_dtype="float32"))
    return layout, plan_run(opts, layout, machine_bytes(1 << 40, pinned_bytes=pinned_bytes), backend)


def test_the_planner_counts_what_the_arena_pins_not_only_the_tensors_in_it():
    layout, plan = _plan_on(True, 1 << 40)
    assert list(plan.paged) == [0, 1, 2, 3]
    for u in layout.block_units:  # as the engine applies the plan
        u.paged = True
    takes = arena_sizes(layout.units)
    pinned = HostArena.pinned_for(takes)
    assert pinned > sum(takes)  # this layout leaves tails: the count is seen
    assert plan.budget["pinned"] == pinned
    assert plan.budget["host"]["unused ends of pinned pieces"] == pinned - sum(takes)
    with pytest.raises(trainstream.DoesNotFit, match="pinned memory"):
        _plan_on(True, (pinned + sum(takes)) // 2)  # holds the tensors, not the pieces
    assert _plan_on(False, 1 << 40)[1].budget["host"]["unused ends of pinned pieces"] == 0  # never touched


class _GatedBackend(Backend):
    """A CPU backend whose host_empty pins its first piece at once and waits for `gate`
    before each later one: the pinning thread is still alive while the block runs."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.gate, self.calls = threading.Event(), 0

    def host_empty(self, shape, dtype):
        self.calls += 1
        if self.calls > 1:
            assert self.gate.wait(timeout=60)
        return super().host_empty(shape, dtype)


def test_the_pinning_thread_is_joined_when_the_block_raises(small_pieces):
    backend = _GatedBackend()
    arena = HostArena(backend, sum(_sizes(TAKES)))
    with pytest.raises(RuntimeError, match="injected failure"):
        with arena.pinning_ahead(_sizes(TAKES)):
            arena.take((300,), torch.float32)
            assert _pinners()  # pinning the second piece
            backend.gate.set()
            raise RuntimeError("injected failure")
    assert not _pinners()


class _FailingBackend(Backend):
    """A CPU backend whose host_empty fails at its `at`-th call (0-based)."""

    def __init__(self, at: int):
        super().__init__(torch.device("cpu"))
        self.at, self.calls = at, 0

    def host_empty(self, shape, dtype):
        self.calls += 1
        if self.calls > self.at:
            raise MemoryError("injected pinning failure")
        return super().host_empty(shape, dtype)


def test_a_pinning_failure_is_raised_from_the_take_that_needs_the_piece(small_pieces):
    sizes = _sizes(TAKES)
    pieces = HostArena.piece_sizes(sum(sizes), sizes)
    assert len(pieces) > 2
    arena = HostArena(_FailingBackend(at=2), sum(sizes))
    taken = 0
    with pytest.raises(MemoryError, match="injected pinning failure"):
        with arena.pinning_ahead(sizes):
            for n, dtype in TAKES:
                arena.take((n,), dtype)
                taken += 1
    assert len(arena.pieces) == 2 and not _pinners()
    # every take the two pinned pieces hold went; the first one that needed a third raised
    fit = max(i for i in range(len(sizes) + 1) if len(HostArena.piece_sizes(sum(sizes), sizes[:i])) <= 2)
    assert taken == fit


def test_a_pinning_failure_no_take_reached_is_raised_at_the_blocks_end(small_pieces):
    sizes = _sizes(TAKES)
    arena = HostArena(_FailingBackend(at=1), sum(sizes))
    with pytest.raises(MemoryError, match="injected pinning failure"):
        with arena.pinning_ahead(sizes):
            arena.take((300,), torch.float32)  # only the first piece is used
    assert not _pinners()


def test_pinning_ahead_refuses_more_than_the_arena_holds_and_a_second_time():
    arena = HostArena(CPU, 128)
    with pytest.raises(RuntimeError, match="more than it holds"):
        with arena.pinning_ahead([64, 128]):
            pass
    with arena.pinning_ahead([64]):
        arena.take((16,), torch.float32)
    with pytest.raises(RuntimeError, match="pins ahead once"):
        with arena.pinning_ahead([64]):
            pass
    assert not _pinners()


def test_a_take_that_was_not_announced_is_a_sizing_bug(small_pieces):
    arena = HostArena(CPU, 1 << 20)
    with pytest.raises(RuntimeError, match="not among those pinned ahead"):
        with arena.pinning_ahead([64]):
            arena.take((16,), torch.float32)
            arena.take((100_000,), torch.uint8)  # needs a second piece nobody announced
    assert not _pinners()


def test_a_pinning_thread_that_never_started_leaves_takes_pinning_on_demand(monkeypatch):
    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refused)
    arena = HostArena(CPU, 1 << 20)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        with arena.pinning_ahead([1 << 20]):
            pass
    monkeypatch.undo()
    # a take waiting on the thread that never ran would wait forever: here it pins its own piece
    taken = []
    taker = threading.Thread(target=lambda: taken.append(arena.take((1 << 20,), torch.uint8)), daemon=True)
    taker.start()
    taker.join(timeout=60)
    assert not taker.is_alive() and taken[0].numel() == 1 << 20


def test_the_pinning_thread_makes_the_engines_gpu_current_before_it_pins(monkeypatch):
    # A fresh thread's current device is 0: pinned there, with GPU 0's context alive, the
    # memory maps onto cuda:0 only and an engine on cuda:1 could not read its paged weights.
    calls = []

    class CudaLike(Backend):
        def __init__(self):
            super().__init__(torch.device("cpu"))
            self.is_cuda, self._index = True, 1  # all the pinning thread reads of a GPU backend

        def host_empty(self, shape, dtype):
            calls.append(("pin", threading.current_thread().name))
            return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    arena = HostArena(CudaLike(), 3 << 20)
    with arena.pinning_ahead([1 << 20] * 3):
        for _ in range(3):
            arena.take((1 << 20,), torch.uint8)
    assert calls[0] == ("set_device", 1)
    assert calls[1:] == [("pin", PINNER)] * len(arena.pieces)


# -- wrap() ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_wrap_leaves_no_pinning_thread_behind(fmt):
    model, batch, loss_fn = _frozen_gpt()
    model, opt = _wrap(model, **({"quantize": fmt} if fmt else {}))
    assert not _pinners()
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()
    trainstream.unwrap(model)


def _state(model) -> dict:
    return {n: (p.untyped_storage().data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_a_pinning_failure_refuses_wrap_and_leaves_the_model_as_it_was(fmt, monkeypatch):
    model, _, _ = _frozen_gpt()
    before = _state(model)
    host_empty = Backend.host_empty

    def failing_in_the_pinner(self, shape, dtype):
        if threading.current_thread().name == PINNER:
            raise MemoryError("injected pinning failure")
        return host_empty(self, shape, dtype)

    monkeypatch.setattr(Backend, "host_empty", failing_in_the_pinner)
    with pytest.raises(MemoryError, match="injected pinning failure"):
        _wrap(model, **({"quantize": fmt} if fmt else {}))
    assert not _pinners() and not hasattr(model, "_trainstream_engine")
    after = _state(model)
    assert after.keys() == before.keys()
    for name, (ptr, values) in before.items():
        assert after[name][0] == ptr, name
        assert torch.equal(after[name][1], values), name


def test_a_take_refused_midway_joins_the_thread(monkeypatch):
    take = HostArena.take
    calls = []

    def failing(self, shape, dtype):
        calls.append(None)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        return take(self, shape, dtype)

    monkeypatch.setattr(HostArena, "take", failing)
    model, _, _ = _frozen_gpt()
    with pytest.raises(RuntimeError, match="injected failure"):
        _wrap(model, quantize="int8")
    assert not _pinners()


# -- on a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_pieces_pinned_ahead_are_pinned(small_pieces):
    backend = Backend(torch.device("cuda"))
    arena = HostArena(backend, sum(_sizes(TAKES)))
    with arena.pinning_ahead(_sizes(TAKES)):
        taken = [arena.take((n,), dtype) for n, dtype in TAKES]
    assert len(arena.pieces) > 2 and all(p.is_pinned() for p in arena.pieces)
    assert all(t.is_pinned() for t in taken)
    assert not _pinners()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_paged_weights_stay_readable_on_a_second_gpu_while_gpu_0_has_a_context():
    torch.zeros(1, device="cuda:0")  # GPU 0's primary context exists
    torch.cuda.set_device(1)
    try:
        torch.manual_seed(0)
        model, _, _ = tiny_gpt()
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = trainstream.wrap(model, opt, device="cuda:1", offload=True, **PAGED)
        engine = _engine_of(model)
        assert engine.weights.arena.pieces and all(p.is_pinned() for p in engine.weights.arena.pieces)
        assert engine.weights.unreadable == []
        trainstream.unwrap(model)
    finally:
        torch.cuda.set_device(0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_cuda_paged_quantized_codes_are_pinned_and_the_run_trains(fmt):
    model, batch, loss_fn = _frozen_gpt()
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cuda", offload=True, quantize=fmt, **PAGED)
    engine = _engine_of(model)
    assert all(p.is_pinned() for p in engine.weights.arena.pieces) and not _pinners()
    quantized = [s for u in engine.block_units for s in u.slots if s.quant is not None]
    assert quantized
    for s in quantized:
        assert s.quant.codes.is_pinned() and s.quant.absmax.is_pinned()
        want = QuantizedWeight.quantize(originals[s.name], fmt)
        assert_same_bits(s.quant.codes, want.codes)
    loss = loss_fn(model, batch(0, "cuda"))
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    assert torch.isfinite(loss).item()


# -- the model walked once ----------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.LayerNorm(dim))
        self.out = torch.nn.Linear(dim, dim, bias=False)


class _Tied(torch.nn.Module):
    """Three blocks; the head is tied to block 1's `out` weight; a root parameter; a nested
    module outside the blocks; block 2 reuses block 0's LayerNorm (shared between blocks)."""

    def __init__(self, dim=8):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(3))
        self.blocks[2].inner[1] = self.blocks[0].inner[1]
        self.tail = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(dim, 2))
        self.head = torch.nn.Linear(dim, dim, bias=False)
        self.head.weight = self.blocks[1].out.weight


def test_build_units_names_owners_and_finds_blocks_shared_with_the_outside():
    from trainstream.engine.layout import build_units

    model = _Tied()
    trainable = {model.tail[1].weight}
    blocks, outside, shared = build_units(model, list(model.blocks), trainable)
    assert shared == [1]  # block 1's out.weight is the head's weight
    assert [[s.name for s in u.slots] for u in blocks] == [
        ["blocks.0.inner.0.weight", "blocks.0.inner.0.bias", "blocks.0.inner.1.weight", "blocks.0.inner.1.bias"]
        + ["blocks.0.out.weight"],
        ["blocks.1.inner.0.weight", "blocks.1.inner.0.bias", "blocks.1.inner.1.weight", "blocks.1.inner.1.bias"]
        + ["blocks.1.out.weight"],
        ["blocks.2.inner.0.weight", "blocks.2.inner.0.bias", "blocks.2.out.weight"],  # its LayerNorm is block 0's
    ]
    assert [(u.name, [s.name for s in u.slots]) for u in outside] == [
        ("<root>", ["scale"]),
        ("tail.1", ["tail.1.weight", "tail.1.bias"]),
    ]
    assert [s.trainable for s in outside[1].slots] == [True, False]
    assert [s.is_linear for s in blocks[0].slots] == [True, True, False, False, True]
    assert all(s.unit is u for u in blocks + outside for s in u.slots)
