"""Element-type codes shared with the C++ core (csrc/include/metamat/dtype.h, ``enum class DType``).

One table for the init engine's segments and the reader's ops; ``tests/test_dtypes.py``
checks it against the compiled ``_C.DTYPE_CODES``.
"""
from __future__ import annotations

import torch

__all__ = ["RAW", "CODES", "FILL_DTYPES", "CONVERTIBLE", "code_of", "itemsize"]

RAW = 0  # bytes copied unchanged (the reader's no-conversion code)
CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
#: dtypes the init engine writes
FILL_DTYPES = tuple(CODES)
#: dtypes the reader converts between
CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)


def code_of(dtype: torch.dtype) -> int:
    """The core's code for ``dtype``.

    Raises:
        KeyError: ``dtype`` has no code (the core neither fills nor converts it).
    """
    return CODES[dtype]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (called per tensor and chunk: no tensor made)."""
    return dtype.itemsize
