"""TrainStream: train and fine-tune PyTorch models larger than GPU memory.

Public API of this release: :func:`wrap`, :func:`unwrap`, :func:`memory_report`,
:func:`profile_hardware`, :class:`HardwareProfile`, :class:`DoesNotFit`,
:class:`OffloadAdamW`, :class:`QuantizedWeight`, :func:`chunked_cross_entropy`,
:func:`causal_lm_loss`, :func:`quantize_model`, :func:`plot_memory` and the low-level
:mod:`trainstream.ops`.
"""

from . import ops
from ._version import __version__
from .api import memory_report, unwrap, wrap
from .errors import DoesNotFit
from .loss import causal_lm_loss, chunked_cross_entropy
from .optim import OffloadAdamW
from .planner import HardwareProfile, profile_hardware
from .plot import plot_memory
from .quant import QuantizedWeight, quantize_model

__all__ = [
    "__version__",
    "wrap",
    "unwrap",
    "memory_report",
    "profile_hardware",
    "HardwareProfile",
    "DoesNotFit",
    "OffloadAdamW",
    "QuantizedWeight",
    "chunked_cross_entropy",
    "causal_lm_loss",
    "quantize_model",
    "plot_memory",
    "ops",
]
