"""Quantized storage of frozen weights."""

from .weight import QuantizedWeight

__all__ = ["QuantizedWeight"]
