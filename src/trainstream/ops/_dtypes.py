"""torch dtypes <-> the native DType codes (native/include/trainstream/dtype.h)."""

import torch

NONE = -1
CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def code(dtype: torch.dtype | None) -> int:
    return NONE if dtype is None else CODES[dtype]
