"""Suite `quant`: NF4 and int8 (de)quantization against bitsandbytes and the memory ceiling.

GPU rows (when a GPU is visible): dequantize to bf16 and quantize from bf16 for three weight
shapes of 7B-70B models, bitsandbytes' NF4 kernels and a bf16 copy of the output size (the
memory ceiling) in the same run. Bytes = bf16 values + codes + fp32 absmax (block 64).
CPU rows: quantize throughput in GB/s of bf16 input, one thread and all threads (the rate
at which a checkpoint can be quantized while it is read).
"""

from __future__ import annotations

import torch

from .. import _native, ops
from ..ops import _dtypes
from ..ops import quant as qops
from .common import cuda_median_seconds, markdown_table, median_seconds

SHAPES = [(3584, 18944), (5120, 13824), (8192, 28672)]
BLOCK = 64


def _bytes(n: int, fmt: str) -> int:
    codes = n // 2 if fmt == "nf4" else n
    return 2 * n + codes + (n // BLOCK) * 4


def _bnb():
    try:
        import bitsandbytes.functional as F

        return F
    except Exception:
        return None


def gpu_rows(shapes, iters: int) -> list[dict]:
    F = _bnb()
    rows = []
    for shape in shapes:
        w = torch.randn(*shape, dtype=torch.bfloat16, device="cuda")
        n = w.numel()
        label = f"{shape[0]}x{shape[1]}"

        def add(op, impl, fn, nbytes):
            t = cuda_median_seconds(fn, iters=iters)
            rows.append({"shape": label, "op": op, "impl": impl, "us": t * 1e6, "TBps": nbytes / t / 1e12})

        packed, absmax = ops.quantize_nf4(w, BLOCK)
        codes8, absmax8 = ops.quantize_int8(w, BLOCK)
        out = torch.empty_like(w)
        add("dequantize", "bf16 copy of the output (ceiling)", lambda: out.copy_(w), 4 * n)
        add(
            "dequantize",
            "trainstream NF4",
            lambda: ops.dequantize_nf4(packed, absmax, shape, torch.bfloat16, out=out),
            _bytes(n, "nf4"),
        )
        add(
            "dequantize",
            "trainstream int8",
            lambda: ops.dequantize_int8(codes8, absmax8, shape, torch.bfloat16, out=out),
            _bytes(n, "int8"),
        )
        add("quantize", "trainstream NF4", lambda: ops.quantize_nf4(w, BLOCK), _bytes(n, "nf4"))
        add("quantize", "trainstream int8", lambda: ops.quantize_int8(w, BLOCK), _bytes(n, "int8"))
        if F is not None:
            q, state = F.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4", compress_statistics=False)
            add(
                "dequantize",
                "bitsandbytes NF4",
                lambda: F.dequantize_4bit(q, state, quant_type="nf4"),
                _bytes(n, "nf4"),
            )
            add(
                "quantize",
                "bitsandbytes NF4",
                lambda: F.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4", compress_statistics=False),
                _bytes(n, "nf4"),
            )
            same = torch.equal(packed, q.view(-1)) and torch.equal(absmax, state.absmax)
            rows.append(
                {"shape": label, "op": "check", "impl": "NF4 codes and absmax equal bitsandbytes'", "equal": same}
            )
        del w, out, packed, absmax, codes8, absmax8
        torch.cuda.empty_cache()
    _ratios(rows)
    return rows


def _ratios(rows):
    for r in rows:
        peer = next(
            (p for p in rows if p["shape"] == r["shape"] and p["op"] == r["op"] and p["impl"] == "bitsandbytes NF4"),
            None,
        )
        if peer and "TBps" in r and r["impl"].startswith("trainstream"):
            r["vs_bitsandbytes"] = r["TBps"] / peer["TBps"]


def cpu_rows(threads: int, numel: int) -> list[dict]:
    """Host quantize throughput on one thread and on all of them (the native call, to pick
    the pool size; ops.quantize_* always use the all-cores pool)."""
    native = _native.lib()
    x = torch.randn(numel, dtype=torch.bfloat16)
    absmax = torch.empty(-(-numel // BLOCK))
    rows = []
    for fmt, code, codes in (
        ("NF4", qops.NF4, torch.empty(numel // 2, dtype=torch.uint8)),
        ("int8", qops.INT8, torch.empty(numel, dtype=torch.int8)),
    ):
        for t in sorted({1, threads}):
            pool = ops.get_pool(t)

            def run():
                native.quant_queue(
                    pool,
                    False,
                    code,
                    numel,
                    BLOCK,
                    _dtypes.code(torch.bfloat16),
                    x.data_ptr(),
                    codes.data_ptr(),
                    absmax.data_ptr(),
                ).wait()

            s = median_seconds(run, iters=5)
            rows.append(
                {
                    "op": f"CPU quantize {fmt}",
                    "threads": t,
                    "GBps_bf16_in": numel * 2 / s / 1e9,
                    "GBps_per_thread": numel * 2 / s / 1e9 / t,
                }
            )
    return rows


def run(*, threads: int, quick: bool) -> dict:
    result = {"block_size": BLOCK}
    parts = []
    if torch.cuda.is_available():
        rows = gpu_rows(SHAPES[:1] if quick else SHAPES, iters=10 if quick else 30)
        result["gpu_rows"] = rows
        table = [r for r in rows if r["op"] != "check"]
        parts.append(
            markdown_table(
                [
                    ("shape", "shape (bf16)"),
                    ("op", "op"),
                    ("impl", "implementation"),
                    ("us", "us"),
                    ("TBps", "TB/s"),
                    ("vs_bitsandbytes", "x bitsandbytes"),
                ],
                table,
            )
        )
        checks = [r for r in rows if r["op"] == "check"]
        if checks:
            parts.append(
                "NF4 codes and absmax identical to bitsandbytes': "
                + ", ".join(f"{r['shape']} {'yes' if r['equal'] else 'NO'}" for r in checks)
                + "."
            )
        else:
            parts.append("bitsandbytes not importable: no peer rows.")
    rows = cpu_rows(threads, 1 << 22 if quick else 1 << 26)
    result["cpu_rows"] = rows
    parts.append(
        markdown_table(
            [
                ("op", "op"),
                ("threads", "threads"),
                ("GBps_bf16_in", "GB/s (bf16 in)"),
                ("GBps_per_thread", "GB/s per thread"),
            ],
            rows,
        )
    )
    note = f"Block size {BLOCK}; bytes = bf16 values + codes + fp32 absmax."
    if torch.cuda.is_available():
        note += " GPU times: CUDA events around 10 back-to-back calls, median of 30."
    parts.append(note)
    result["markdown"] = "\n\n".join(parts)
    return result
