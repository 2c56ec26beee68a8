"""The current CUDA stream as the integer handle the native kernels take.

torch.cuda.current_stream() builds a torch.cuda.Stream object on every call (about 20
microseconds); torch's raw accessor returns the cudaStream_t of the calling thread's
current stream on a device without one, and torch's own generated code reads it so. A
build of torch without it falls back to the Stream's handle.
"""

from __future__ import annotations

import torch

_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """The handle (cudaStream_t as an integer) of the current stream on CUDA device `device_index`."""
    if _raw is not None:
        return _raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
