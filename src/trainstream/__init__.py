"""TrainStream: train and fine-tune PyTorch models larger than GPU memory.

Public API of this release: :class:`OffloadAdamW`, :class:`QuantizedWeight` and the
low-level :mod:`trainstream.ops`.
"""
from ._version import __version__
from . import ops
from .optim import OffloadAdamW
from .quant import QuantizedWeight

__all__ = ["__version__", "OffloadAdamW", "QuantizedWeight", "ops"]
