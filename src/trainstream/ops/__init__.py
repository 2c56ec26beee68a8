"""Validated low-level operations over the native module, and their pure-torch twins.

Each function checks dtypes, devices, contiguity and sizes in Python, then passes data
pointers to ``trainstream._C``; ``reference`` holds the pure-torch twin of each op.
"""

from . import reference
from .adamw import AdamWHandle, adamw_step, adamw_step_gpu, get_pool
from .grad import accumulate_, grad_sq_norms, mark_nonfinite_
from .quant import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4

__all__ = [
    "AdamWHandle",
    "accumulate_",
    "adamw_step",
    "adamw_step_gpu",
    "dequantize_int8",
    "dequantize_nf4",
    "get_pool",
    "grad_sq_norms",
    "mark_nonfinite_",
    "quantize_int8",
    "quantize_nf4",
    "reference",
]
