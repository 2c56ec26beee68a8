"""QuantizedWeight: one frozen weight held as NF4 or int8 codes plus per-block absmax."""

from __future__ import annotations

import math

import torch

from ..ops import _args
from ..ops import quant as qops

FORMATS = ("nf4", "int8")


def code_layout(numel: int, format: str) -> tuple[int, torch.dtype]:
    """How many codes a weight of `numel` values takes as `format`, and their dtype (NF4:
    two per byte)."""
    return (-(-numel // 2), torch.uint8) if format == "nf4" else (numel, torch.int8)


def quantized_nbytes(numel: int, format: str, block_size: int) -> int:
    """Bytes a weight of `numel` values takes as `format`: codes plus one fp32 absmax per block."""
    return code_layout(numel, format)[0] + 4 * -(-numel // block_size)


def _check_format(format) -> None:
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"QuantizedWeight: format must be one of {FORMATS}, got {format!r}")


def _check_codes(codes, absmax, shape: torch.Size, format: str, block_size: int) -> None:
    """Codes and absmax laid out as quantize makes them for `shape`: dequantize_into trusts
    them (it reads numel(shape) codes and a scale per block at their addresses)."""
    _args.tensor("QuantizedWeight", "codes", codes)
    _args.tensor("QuantizedWeight", "absmax", absmax)
    qops.check_codes(
        "QuantizedWeight", qops.NF4 if format == "nf4" else qops.INT8, codes, absmax, math.prod(shape), block_size
    )


class QuantizedWeight:
    """Codes, absmax, and what is needed to rebuild the weight: shape, dtype, format and
    block size. ``dequantize()`` gives the weight back in its dtype on the codes' device."""

    __slots__ = ("codes", "absmax", "shape", "dtype", "format", "block_size")

    def __init__(
        self, codes: torch.Tensor, absmax: torch.Tensor, shape, dtype: torch.dtype, format: str, block_size: int = 64
    ):
        _check_format(format)
        self.block_size = qops.check_block_size(block_size)
        self.shape = torch.Size(_args.shape("QuantizedWeight", "shape", shape))
        self.dtype = _args.dtype("QuantizedWeight", "dtype", dtype, qops.VALUE_DTYPES)
        _check_codes(codes, absmax, self.shape, format, self.block_size)
        self.codes = codes
        self.absmax = absmax
        self.format = format

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: str = "nf4", block_size: int = 64, *, out=None) -> QuantizedWeight:
        """`weight` as `format` codes. `out`: a (codes, absmax) pair on the weight's device,
        laid out as quantize makes them (ops.quantize_nf4's `out`), which the codes are
        written into and which the result then holds (the engine's host transfer memory)."""
        _check_format(format)
        quantize = qops.quantize_nf4 if format == "nf4" else qops.quantize_int8
        codes, absmax = quantize(weight.detach(), block_size, out=out)
        return cls(codes, absmax, weight.shape, weight.dtype, format, block_size)

    def dequantize(self, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in its dtype, or in `dtype` (each value computed in fp32, then rounded
        to nearest even: the same bits as dequantizing to fp32 and casting)."""
        dequantize = qops.dequantize_nf4 if self.format == "nf4" else qops.dequantize_int8
        dtype = dtype or (out.dtype if out is not None else self.dtype)
        return dequantize(self.codes, self.absmax, self.shape, dtype, self.block_size, out=out)

    def dequantize_into(self, out: torch.Tensor) -> None:
        """Dequantize into `out`, a contiguous tensor of this weight's shape on its device
        (float32, bfloat16 or float16). `out` is checked (ValueError otherwise); the codes
        this class holds are not re-checked (the engine's fetches: qops.dequantize_trusted)."""
        qops.check_out("QuantizedWeight.dequantize_into", out, self.shape, self.codes.device)
        qops.dequantize_trusted(self.format, self.codes, self.absmax, self.block_size, out)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes held: codes plus absmax."""
        return self.codes.numel() * self.codes.element_size() + self.absmax.numel() * 4

    def _with(self, codes: torch.Tensor, absmax: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(codes, absmax, self.shape, self.dtype, self.format, self.block_size)

    def to(self, device, non_blocking: bool = False) -> QuantizedWeight:
        return self._with(
            self.codes.to(device, non_blocking=non_blocking), self.absmax.to(device, non_blocking=non_blocking)
        )

    def pin_memory(self) -> QuantizedWeight:
        return self._with(self.codes.pin_memory(), self.absmax.pin_memory())

    def is_pinned(self) -> bool:
        return self.codes.is_pinned() and self.absmax.is_pinned()

    def __repr__(self) -> str:
        full = math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()
        return (
            f"QuantizedWeight({self.format}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"block_size={self.block_size}, {self.nbytes} bytes vs {full} unquantized, device={self.device})"
        )
