"""ops.quant.dequantize_many: a list of (codes, absmax, out) in one call, bit for bit the
per-tensor dequantize and its pure-torch twin, on CPU and CUDA (tests marked gpu)."""

import pytest
import torch
from helpers import assert_same_bits

from trainstream import ops
from trainstream.ops import quant as qops
from trainstream.ops import reference

QUANTIZE = {"nf4": ops.quantize_nf4, "int8": ops.quantize_int8}
DEQUANTIZE = {"nf4": ops.dequantize_nf4, "int8": ops.dequantize_int8}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Odd sizes, sizes that are not a multiple of the block or of the GPU's 512-value warp step,
# one exactly a warp step, an empty one, and one of several warp steps with a tail.
SHAPES = [(1,), (7,), (64,), (512,), (0,), (33, 5), (1001,), (96, 128), (3 * 512 + 9,), (70_003,)]


def _inputs(fmt, block_size, device="cpu", seed=0):
    """Codes and absmax of every shape in SHAPES, and an out dtype for each (cycling)."""
    g = torch.Generator().manual_seed(seed)
    codes, absmax, shapes, dtypes = [], [], [], []
    for i, shape in enumerate(SHAPES):
        x = (torch.randn(shape, generator=g) * 0.02).to(DTYPES[i % 3])
        c, a = QUANTIZE[fmt](x, block_size)
        codes.append(c.to(device))
        absmax.append(a.to(device))
        shapes.append(shape)
        dtypes.append(DTYPES[(i + 1) % 3])
    return codes, absmax, shapes, dtypes


def _one_at_a_time(fmt, codes, absmax, shapes, dtypes, block_size):
    return [DEQUANTIZE[fmt](c, a, s, d, block_size) for c, a, s, d in zip(codes, absmax, shapes, dtypes)]


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("block_size", [2, 6, 64, 100, 256])
def test_matches_the_per_tensor_op_and_the_twin(fmt, block_size):
    codes, absmax, shapes, dtypes = _inputs(fmt, block_size, seed=block_size)
    outs = [torch.full(s, float("nan"), dtype=d) for s, d in zip(shapes, dtypes)]
    assert qops.dequantize_many(fmt, codes, absmax, outs, block_size) is None
    each = _one_at_a_time(fmt, codes, absmax, shapes, dtypes, block_size)
    twin = reference.dequantize_many(fmt, codes, absmax, shapes, dtypes, block_size)
    for out, one, ref in zip(outs, each, twin):
        assert_same_bits(out, one)
        assert_same_bits(out, ref)


def test_an_empty_batch_does_nothing():
    qops.dequantize_many("nf4", [], [], [])


def test_views_of_one_buffer_are_each_written_and_nothing_between():
    # The engine's fetch: a unit's weights as views of one buffer, with gaps between them.
    codes, absmax, shapes, _ = _inputs("nf4", 64)
    sizes = [torch.Size(s).numel() for s in shapes]
    flat = torch.full((sum(sizes) + 8 * len(sizes),), 7.0, dtype=torch.bfloat16)
    outs, at = [], 0
    for shape, n in zip(shapes, sizes):
        outs.append(flat[at : at + n].view(shape))
        at += n + 8
    qops.dequantize_many_trusted("nf4", codes, absmax, outs, 64)
    for out, one in zip(outs, _one_at_a_time("nf4", codes, absmax, shapes, [torch.bfloat16] * len(shapes), 64)):
        assert_same_bits(out, one)
    at = 0
    for n in sizes:
        assert torch.equal(flat[at + n : at + n + 8], torch.full((8,), 7.0, dtype=torch.bfloat16))
        at += n + 8


def _good():
    c, a = ops.quantize_nf4(torch.randn(100), 64)
    return [c], [a], [torch.empty(100)]


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(format="fp4"), ValueError, r"dequantize_many: format must be one of \['nf4', 'int8'\], got 'fp4'"),
        (dict(codes="x"), TypeError, r"dequantize_many: codes must be a list or tuple of torch.Tensor"),
        (dict(outs=[None]), TypeError, r"dequantize_many: outs\[0\] must be a torch.Tensor"),
        (dict(absmax=[]), ValueError, r"codes, absmax and outs must have one entry per tensor, got 1, 0 and 1"),
        (dict(block_size=3), ValueError, r"dequantize_many: block_size must be an even integer >= 2"),
        (dict(block_size=32), ValueError, r"absmax must be a contiguous float32 tensor of 4 elements"),
        (dict(outs=[torch.empty(101)]), ValueError, r"codes must be a contiguous torch.uint8 tensor of 51 elements"),
        (dict(outs=[torch.empty(100, dtype=torch.int32)]), ValueError, r"\(tensor 0\): out must be a contiguous"),
        (dict(outs=[torch.empty(200)[::2]]), ValueError, r"\(tensor 0\): out must be a contiguous"),
        (dict(format="int8"), ValueError, r"codes must be a contiguous torch.int8 tensor of 100 elements"),
    ],
)
def test_bad_input_names_the_argument(change, error, match):
    codes, absmax, outs = _good()
    args = dict(format="nf4", codes=codes, absmax=absmax, outs=outs, block_size=64)
    args.update(change)
    with pytest.raises(error, match=match):
        qops.dequantize_many(**args)


def test_tensors_on_two_devices_are_refused():
    codes, absmax, outs = _good()
    on_meta = [t.to("meta") for t in (codes[0], absmax[0], outs[0])]
    with pytest.raises(ValueError, match=r"dequantize_many: every tensor must be on one device, outs\[1\]"):
        qops.dequantize_many("nf4", [codes[0], on_meta[0]], [absmax[0], on_meta[1]], [outs[0], on_meta[2]])


def test_the_engine_dequantizes_a_unit_into_one_buffer_with_one_call(monkeypatch):
    from helpers import RESIDENT, train

    frozen = lambda n: n.startswith("layers.") and n.endswith(("qkv.weight", "fc.weight", "out.weight"))  # noqa: E731
    calls = []
    original = qops.dequantize_many_trusted

    def counting(format, codes, absmax, outs, block_size):
        calls.append(len(outs))
        return original(format, codes, absmax, outs, block_size)

    monkeypatch.setattr(qops, "dequantize_many_trusted", counting)
    _, _, (model, _) = train("gpt", dict(RESIDENT, quantize="nf4"), steps=1, freeze=frozen)
    assert calls and set(calls) == {3}  # each fetch: the block's three quantized weights at once
    pager = model._trainstream_engine.weights
    unit = pager.units[1]
    before = pager.fetched_bytes
    pager.attach(unit)
    views = unit.fetched
    assert len(views) == 3 and len({v.untyped_storage().data_ptr() for v in views.values()}) == 1
    storage = next(iter(views.values())).untyped_storage()
    assert all((v.storage_offset() * v.element_size()) % pager.DEQUANT_ALIGN == 0 for v in views.values())
    assert pager.fetched_bytes - before == storage.nbytes() == sum(-(-v.nbytes // 256) * 256 for v in views.values())
    for slot, v in views.items():
        assert_same_bits(v, slot.quant.dequantize())
        ptr = v.untyped_storage().data_ptr()
        assert pager.fetched_slot(v, ptr) is slot and pager.fetched_slot(v[1:].t(), ptr) is slot
    pager.release(unit)
    assert not pager.fetched_storages


# -- CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("block_size", [2, 6, 8, 64, 100, 256, 4096])
def test_cuda_batch_matches_the_per_tensor_kernel(fmt, block_size):
    codes, absmax, shapes, dtypes = _inputs(fmt, block_size, device="cuda", seed=block_size)
    outs = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in zip(shapes, dtypes)]
    qops.dequantize_many(fmt, codes, absmax, outs, block_size)
    for out, one in zip(outs, _one_at_a_time(fmt, codes, absmax, shapes, dtypes, block_size)):
        assert_same_bits(out.cpu(), one.cpu())
    cpu = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
    qops.dequantize_many(fmt, [c.cpu() for c in codes], [a.cpu() for a in absmax], cpu, block_size)
    for out, host in zip(outs, cpu):  # the same codes give the same bits on both devices
        assert_same_bits(out.cpu(), host)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_cuda_unaligned_views_and_more_tensors_than_one_launch_holds(fmt):
    # 150 tensors: three launches of at most 64; every third out and codes offset off the
    # fast path's alignment (the general path for all of its steps).
    g = torch.Generator().manual_seed(1)
    codes, absmax, outs, expected = [], [], [], []
    for i in range(150):
        n = 512 * (i % 4) + 37 * (i % 5)
        x = torch.randn(n + 2, generator=g).to(torch.bfloat16)
        unaligned = i % 3 == 0
        c, a = QUANTIZE[fmt](x[2:].cuda() if unaligned else x[:n].cuda(), 64)
        if unaligned:  # codes one byte off too
            c = torch.cat([c.new_zeros(1), c])[1:]
        out = (
            torch.empty(n + 2, dtype=torch.bfloat16, device="cuda")[2:] if unaligned else torch.empty(n, device="cuda")
        )
        codes.append(c)
        absmax.append(a)
        outs.append(out)
        expected.append(DEQUANTIZE[fmt](c, a, (n,), out.dtype, 64))
    qops.dequantize_many(fmt, codes, absmax, outs, 64)
    for out, one in zip(outs, expected):
        assert_same_bits(out.cpu(), one.cpu())


@pytest.mark.gpu
def test_cuda_batch_runs_on_the_current_stream():
    codes, absmax, shapes, dtypes = _inputs("nf4", 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        outs = [torch.empty(sh, dtype=d, device="cuda") for sh, d in zip(shapes, dtypes)]
        qops.dequantize_many("nf4", codes, absmax, outs, 64)
        sums = [o.float().sum() for o in outs]  # the same stream: sees the finished values
    torch.cuda.synchronize()
    for total, one in zip(sums, _one_at_a_time("nf4", codes, absmax, shapes, dtypes, 64)):
        assert total.item() == one.float().sum().item()


@pytest.mark.gpu
def test_cuda_compute_stream_follows_the_current_stream():
    from trainstream.engine.device import Backend

    backend = Backend(torch.device("cuda", torch.cuda.current_device()))
    default = torch.cuda.current_stream()
    assert backend.compute_stream() == default
    assert backend.compute_stream() is backend.compute_stream()  # reused while current
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert backend.compute_stream() == s
        assert backend.compute_stream().cuda_stream == s.cuda_stream
    assert backend.compute_stream() == default


@pytest.mark.gpu
def test_cuda_current_stream_handle_is_the_current_streams():
    from trainstream.ops._streams import current_stream_handle

    index = torch.cuda.current_device()
    assert current_stream_handle(index) == torch.cuda.current_stream(index).cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert current_stream_handle(index) == s.cuda_stream != torch.cuda.default_stream(index).cuda_stream


def _one_buffer(shapes, dtypes):
    """Each tensor's values in one buffer, each at a 256-byte boundary (as an engine fetch
    lays a unit out): (numels, byte offsets, the buffer's bytes)."""
    numels, offsets, total = [], [], 0
    for shape, dtype in zip(shapes, dtypes):
        numels.append(torch.Size(shape).numel())
        offsets.append(total)
        total += -(-numels[-1] * dtype.itemsize // 256) * 256
    return numels, offsets, total


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("block_size", [6, 64, 4096])
def test_cuda_prepared_dequantize_is_the_batch_into_one_buffer(fmt, block_size):
    """PreparedDequantize (a resident unit's fetch): every weight at its byte offset of one
    buffer, mixed dtypes in one call, bit for bit the per-tensor op, on the current stream;
    run again into another buffer gives the same bits (its arguments are made once)."""
    codes, absmax, shapes, dtypes = _inputs(fmt, block_size, device="cuda", seed=block_size)
    numels, offsets, total = _one_buffer(shapes, dtypes)
    prepared = qops.PreparedDequantize(fmt, codes, absmax, numels, dtypes, offsets, block_size)
    expected = _one_at_a_time(fmt, codes, absmax, shapes, dtypes, block_size)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    for _ in range(2):
        with torch.cuda.stream(s):
            torch.cuda._sleep(1 << 28)  # the fill below lands late: a launch on another stream would be overwritten
            buffer = torch.full((total,), 0xFF, dtype=torch.uint8, device="cuda")  # NaN where not written
            assert prepared.run(buffer)
            outs = [
                buffer[o : o + n * d.itemsize].view(d).view(sh) for o, n, d, sh in zip(offsets, numels, dtypes, shapes)
            ]
            copies = [out.clone() for out in outs]  # the same stream: the finished values
        torch.cuda.synchronize()
        for out, one in zip(copies, expected):
            assert_same_bits(out.cpu(), one.cpu())


@pytest.mark.gpu
def test_cuda_prepared_dequantize_leaves_traced_calls_to_the_registered_ops():
    """Under a dispatch mode (the registered ops' fake and traced paths), run() does nothing
    and says so: the caller takes dequantize_many_trusted, which the mode sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    codes, absmax, shapes, dtypes = _inputs("nf4", 64, device="cuda")
    numels, offsets, total = _one_buffer(shapes, dtypes)
    prepared = qops.PreparedDequantize("nf4", codes, absmax, numels, dtypes, offsets, 64)
    buffer = torch.zeros(total, dtype=torch.uint8, device="cuda")
    with Seen():
        assert not prepared.run(buffer)
    assert not buffer.any()
    assert prepared.run(buffer)
    assert buffer.any()
