"""Quantized storage of frozen weights."""

from .model import quantize_model
from .weight import QuantizedWeight

__all__ = ["QuantizedWeight", "quantize_model"]
